"""deploy/ keeps secrets where they belong: Ray's token comes from a Kubernetes Secret into
every container, and the Docker build cannot bake a token, a key or a run into the image.
Every deploy path that starts Ray has a test that it turns on Ray's token authentication
(deploy/local's and deploy/slurm's run their scripts with a fake `ray`, in their own files).

Neither Kubernetes nor Docker runs here, so the files are read: the manifests with PyYAML, the
.dockerignore with Docker's own matching rules (rebuilt below: patterns anchored at the
context root, `**` for any number of directories, a path left out with its parent).
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

yaml = pytest.importorskip("yaml", reason="PyYAML reads the manifests (the `test` extra)")

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
DOCKER = REPO / "deploy" / "docker"
TOKEN_KEY = "auth_token"  # the key Ray's KubeRay integration reads (authOptions.secretName)

# Paths a checkout may hold that no image may: credentials, runs, local cluster state.
NEVER_IN_AN_IMAGE = (
    ".env", "examples/.env.local", ".envrc", ".aws/credentials", "sub/.aws/config", ".netrc",
    ".ssh/id_rsa", "id_ed25519", "deploy/id_rsa.pub", "tls/server.pem", "tls/server.key",
    "client.p12", ".git-credentials", ".pypirc", ".npmrc", ".docker/config.json",
    ".kube/config", ".gnupg/secring.gpg", ".config/gcloud/credentials.db", ".ray/auth_token",
    ".local-cluster/auth_token", ".local-cluster/env", "mycluster/auth_token",
    "runs/gpt/events.jsonl", "examples/gpt/runs/x/metrics.jsonl", "checkpoints/step_1/a.bin",
    "bench/results/x.json", ".venv/bin/python", ".git/config",
)
# What the build reads.
NEEDED = ("pyproject.toml", "README.md", "stalwart/cli/jobs.py", "examples/gpt/config.toml",
          "examples/gpt/task.py", "deploy/docker/constraints.txt", "checkpointing/__init__.py")


def _documents() -> list[dict[str, Any]]:
    return [doc for path in sorted(KUBERNETES.glob("*.y*ml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _one(kind: str) -> dict[str, Any]:
    """The one document of `kind`; for a Secret, the Ray token's (the other is the
    checkpoint key's)."""
    (doc,) = [d for d in _documents() if d["kind"] == kind
              and (kind != "Secret" or TOKEN_KEY in d.get("stringData", {}))]
    return doc


def _containers(node: Any, where: str = "") -> list[tuple[str, dict[str, Any]]]:
    """Every container of every pod template in a manifest, wherever it is nested."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "containers":
                found += [(f"{where}/{c['name']}", c) for c in value]
            else:
                found += _containers(value, f"{where}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += _containers(value, f"{where}[{i}]")
    return found


def _secret_name() -> str:
    secret = _one("Secret")
    assert set(secret["stringData"]) == {TOKEN_KEY}, secret["stringData"]
    return secret["metadata"]["name"]


def _pods() -> list[tuple[str, dict[str, Any]]]:
    return [(f"{d['kind']}{w}", c) for d in _documents() if d["kind"] in ("RayCluster", "RayJob")
            for w, c in _containers(d)]


def test_every_container_has_the_token_from_the_secret_and_token_mode():
    pods = _pods()
    # head + worker of each cluster, and the RayJob's submitter: the scan found them all
    assert len(pods) == 5, [w for w, _ in pods]
    assert any("submitterPodTemplate" in where for where, _ in pods)
    for where, container in pods:
        env = {e["name"]: e for e in container.get("env", [])}
        assert env.get("RAY_AUTH_MODE", {}).get("value") == "token", where
        token = env.get("RAY_AUTH_TOKEN", {})
        assert "value" not in token, f"{where}: a token written into the manifest"
        assert token.get("valueFrom", {}).get("secretKeyRef") == {
            "name": _secret_name(), "key": TOKEN_KEY}, where


# Each way deploy/ starts Ray, and the test that it turns on Ray's token authentication for
# every node and the driver (deploy/docker builds the image and starts no Ray).
TOKEN_AUTH_TESTS = {
    "kubernetes": "test_deploy_trust.py::test_every_container_has_the_token_from_the_secret_and_"
                  "token_mode",
    "local": "test_deploy_local_scripts.py::test_up_starts_every_node_with_the_clusters_token_in_"
             "a_private_temp_dir",
    "slurm": "test_deploy_slurm.py::test_every_node_and_the_driver_get_the_jobs_token_and_a_"
             "private_temp_dir",
}


def test_every_deploy_path_has_a_test_that_it_turns_on_token_auth():
    paths = {p.name for p in (REPO / "deploy").iterdir() if p.is_dir()} - {"docker"}
    assert paths == set(TOKEN_AUTH_TESTS), (
        "a deploy path without a test that it turns on Ray's token authentication")
    for test in TOKEN_AUTH_TESTS.values():
        module, name = test.split("::")
        assert f"\ndef {name}(" in (Path(__file__).parent / module).read_text(), test


def test_the_operator_knows_the_secret_too():
    # KubeRay's dashboard client (a RayJob's status) sends the token only with authOptions
    for spec in (_one("RayCluster")["spec"], _one("RayJob")["spec"]["rayClusterSpec"]):
        assert spec["authOptions"] == {"mode": "token", "secretName": _secret_name()}


def test_the_secret_manifest_holds_a_placeholder_never_a_token():
    value = _one("Secret")["stringData"][TOKEN_KEY]
    assert value.startswith("REPLACE-"), "a real token is committed in secret.yaml"
    readme = (KUBERNETES / "README.md").read_text()
    assert f"kubectl create secret generic {_secret_name()} --from-literal={TOKEN_KEY}=" in readme


def test_the_submitter_runs_the_clusters_image():
    images = {c["image"] for _, c in _pods()}
    assert len(images) == 1, images


# ---------------------------------------------------------------------------- Docker


def _dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last matching pattern wins (`!` re-includes); a pattern matches a
    path or any of its parent directories; patterns are anchored at the context root."""
    excluded = False
    for line in (REPO / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:i])) for i in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


def _instructions() -> list[tuple[str, str]]:
    text = (DOCKER / "Dockerfile").read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    return [(op.upper(), rest.strip()) for op, _, rest in (ln.partition(" ") for ln in lines)]


@pytest.mark.parametrize("path", NEVER_IN_AN_IMAGE)
def test_dockerignore_keeps_secrets_runs_and_local_state_out_of_the_context(path: str):
    assert _dockerignore_excludes(path), path


@pytest.mark.parametrize("path", NEEDED)
def test_dockerignore_keeps_what_the_build_reads(path: str):
    assert (REPO / path).exists() and not _dockerignore_excludes(path), path


def test_dockerfile_copies_no_context_into_a_layer_and_mounts_it_instead():
    for op, rest in _instructions():
        if op in ("COPY", "ADD"):
            sources = [t for t in shlex.split(rest) if not t.startswith("--")][:-1]
            assert "." not in sources and "./" not in sources, f"{op} {rest}"
    mounts = [rest for op, rest in _instructions()
              if op == "RUN" and "--mount=type=bind,source=.," in rest]
    assert len(mounts) == 1, mounts
    # whatever the RUN copies out of the mount for pip's build is gone before the layer ends
    scratch = re.findall(r"cp -r \S+ (/tmp/\S+)", mounts[0])
    assert all(f"rm -rf {s}" in mounts[0] for s in scratch), mounts[0]


def test_the_image_installs_stalwart_under_the_constraints_file():
    (mount,) = [rest for op, rest in _instructions() if op == "RUN" and "--mount=" in rest]
    target = re.search(r"target=([^,\s]+)", mount)[1]
    assert f"-c {target}/deploy/docker/constraints.txt" in mount, mount


def test_constraints_pin_ray_torch_and_every_direct_dependency_within_pyproject():
    pins = {}
    for line in (DOCKER / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            assert not req.extras, f"pip refuses extras in a constraints file: {line}"
            (spec,) = req.specifier
            assert spec.operator == "==", line
            pins[req.name.replace("_", "-").lower()] = spec.version
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for dep in map(Requirement, project["dependencies"]):
        name = dep.name.replace("_", "-").lower()
        assert name in pins, f"{dep.name} is not pinned"
        assert dep.specifier.contains(pins[name]), f"{name}=={pins[name]} vs {dep}"
    (torch,) = set(re.findall(r"torch==([\w.+]+)", (REPO / ".ci" / "run").read_text()))
    assert pins["torch"] == torch
    dockerfile = (DOCKER / "Dockerfile").read_text()
    assert f"ARG TORCH_VERSION={pins['torch']}" in dockerfile
    assert f"rayproject/ray:{pins['ray']}-" in dockerfile


def test_every_pod_that_may_run_a_driver_has_the_checkpoint_key_from_its_secret():
    key_secret = [d for d in _documents() if d["kind"] == "Secret"
                  and d["metadata"]["name"] == "stalwart-checkpoint-key"]
    assert len(key_secret) == 1
    assert key_secret[0]["stringData"]["checkpoint.key"].startswith("REPLACE-")
    for doc in _documents():
        if doc["kind"] not in ("RayCluster", "RayJob"):
            continue
        cluster = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
        for group in groups:
            pod = group["template"]["spec"]
            volumes = {v["name"]: v for v in pod["volumes"]}
            (container,) = pod["containers"]
            env = {e["name"]: e.get("value") for e in container["env"]}
            path = env["STALWART_CHECKPOINT_KEY_FILE"]
            (mount,) = [m for m in container["volumeMounts"]
                        if path.startswith(m["mountPath"].rstrip("/") + "/")]
            assert mount.get("readOnly") is True
            secret = volumes[mount["name"]]["secret"]
            assert secret["secretName"] == "stalwart-checkpoint-key"
            assert path.rsplit("/", 1)[-1] == "checkpoint.key"
            assert secret["defaultMode"] & 0o007 == 0  # not readable by other users
