"""deploy/: the KubeRay manifests and the Dockerfile hold what their tools need.

Neither Kubernetes nor Docker runs here, so each file is checked by reading it: the
fields KubeRay's RayCluster and RayJob require, the values that must agree across files (the
Ray and Python versions pyproject pins, the ports KubeRay's head service looks up by name, one
image for every pod, checkpoint storage every pod sees), a RayJob entrypoint that is a valid
`stalwart run` command line for a real config. (The Slurm script: test_deploy_slurm.py; the
manifests against KubeRay's own schemas: test_deploy_crds.py.)
"""

from __future__ import annotations

import argparse
import itertools
import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from stalwart.cli.main import _parser
from stalwart.core.config import JobConfig, load_config

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parents[2]
KUBERNETES = REPO / "deploy" / "kubernetes"
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

# The kinds deploy/kubernetes may hold, with the apiVersion each must carry.
API_VERSIONS = {"RayCluster": "ray.io/v1", "RayJob": "ray.io/v1", "PersistentVolumeClaim": "v1",
                "Secret": "v1"}
# KubeRay builds the head service from the head container's ports, found by these names.
HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def _lower_bound(specifier: SpecifierSet) -> str:
    (low,) = [s.version for s in specifier if s.operator == ">="]
    return low


def _ray_version() -> str:
    """pyproject's lower bound on Ray as a full release (`>=2.60` -> `2.60.0`): the image's Ray."""
    (ray,) = [r for r in map(Requirement, PROJECT["dependencies"]) if r.name == "ray"]
    parts = _lower_bound(ray.specifier).split(".")
    return ".".join(parts + ["0"] * (3 - len(parts)))


RAY_VERSION = _ray_version()
PYTHON_TAG = "py" + _lower_bound(SpecifierSet(PROJECT["requires-python"])).replace(".", "")
# The CPU build of torch that CI installs (.ci/run) is the one the image installs.
(TORCH_VERSION,) = set(re.findall(r"torch==([\w.+]+)", (REPO / ".ci" / "run").read_text()))


# ---------------------------------------------------------------------------- reading


def _documents() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, doc) for path in sorted(KUBERNETES.glob("*.y*ml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


DOCUMENTS = _documents()


def _one(kind: str) -> dict[str, Any]:
    (doc,) = [d for _, d in DOCUMENTS if d["kind"] == kind]
    return doc


def _cluster_specs() -> dict[str, dict[str, Any]]:
    return {"RayCluster": _one("RayCluster")["spec"],
            "RayJob.rayClusterSpec": _one("RayJob")["spec"]["rayClusterSpec"]}


def _groups(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Head first, then the worker groups: each has rayStartParams and a pod template."""
    return [spec["headGroupSpec"], *spec["workerGroupSpecs"]]


def _container(group: dict[str, Any]) -> dict[str, Any]:
    return group["template"]["spec"]["containers"][0]  # the Ray container comes first


def _cpus(quantity: str | int | float) -> float:
    """A Kubernetes CPU quantity (`2`, `"1.5"`, `"500m"`) in CPUs."""
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _shared_mounts(group: dict[str, Any]) -> set[str]:
    """Mount paths of the group's Ray container backed by a ReadWriteMany claim of storage.yaml."""
    claims = {d["metadata"]["name"] for _, d in DOCUMENTS if d["kind"] == "PersistentVolumeClaim"
              and "ReadWriteMany" in d["spec"]["accessModes"]}
    volumes = {v["name"] for v in group["template"]["spec"].get("volumes", [])
               if v.get("persistentVolumeClaim", {}).get("claimName") in claims}
    return {m["mountPath"] for m in _container(group).get("volumeMounts", [])
            if m["name"] in volumes}


def _under(path: str, mounts: set[str]) -> bool:
    return any(PurePosixPath(path).is_relative_to(m) for m in mounts)


def _entrypoint() -> tuple[argparse.Namespace, JobConfig]:
    """The RayJob's entrypoint parsed as the CLI parses it, and the config it resolves to (the
    image's absolute path to it read from the checkout: the image copies examples/ there)."""
    argv = shlex.split(_one("RayJob")["spec"]["entrypoint"])
    assert argv[:2] == ["stalwart", "run"], f"entrypoint is not `stalwart run ...`: {argv}"
    args = _parser().parse_args(argv[1:])
    config = PurePosixPath(args.config)
    assert config.is_absolute(), f"entrypoint config {config}: Ray picks the entrypoint's cwd"
    in_repo = REPO / config.relative_to(_dockerfile_workdir())
    assert in_repo.is_file(), f"entrypoint config {config} is not the repo's {in_repo}"
    # validates every --set key and value, as `stalwart run` does before starting anything
    return args, load_config(in_repo, args.overrides)


# ---------------------------------------------------------------------------- KubeRay


def test_the_manifests_are_found() -> None:
    # guards the scan: with no documents, the parametrized tests below would prove nothing
    assert sorted(d["kind"] for _, d in DOCUMENTS) == ["PersistentVolumeClaim", "RayCluster",
                                                        "RayJob", "Secret", "Secret"]


@pytest.mark.parametrize(("name", "doc"), DOCUMENTS, ids=[f"{n}:{d.get('kind')}"
                                                          for n, d in DOCUMENTS])
def test_every_document_has_a_known_kind_its_api_version_and_a_name(name: str,
                                                                     doc: dict[str, Any]) -> None:
    assert doc.get("kind") in API_VERSIONS, f"{name}: unexpected kind {doc.get('kind')!r}"
    assert doc.get("apiVersion") == API_VERSIONS[doc["kind"]], name
    assert DNS_LABEL.fullmatch(doc["metadata"]["name"]), name


@pytest.mark.parametrize("where", _cluster_specs())
def test_cluster_spec_has_what_kuberay_requires(where: str) -> None:
    spec = _cluster_specs()[where]
    assert spec["rayVersion"] == RAY_VERSION, f"{where}: rayVersion is not pyproject's Ray"
    head = spec["headGroupSpec"]
    assert head["rayStartParams"].get("dashboard-host") == "0.0.0.0", where
    ports = {p["name"]: p["containerPort"] for p in _container(head).get("ports", [])}
    assert {name: ports.get(name) for name in HEAD_PORTS} == HEAD_PORTS, where
    assert spec["workerGroupSpecs"], f"{where}: no worker group"
    names = [g["groupName"] for g in spec["workerGroupSpecs"]]
    assert len(set(names)) == len(names) and all(map(DNS_LABEL.fullmatch, names)), names
    for group in _groups(spec):
        label = f"{where}: {group.get('groupName', 'head')}"
        params = group["rayStartParams"]
        # the CRD types rayStartParams as map[string]string: a bare number is rejected
        assert all(isinstance(v, str) for v in params.values()), f"{label}: {params}"
        container = _container(group)
        assert container["image"], label
        limits = container["resources"]["limits"]
        assert {"cpu", "memory"} <= set(limits), f"{label}: limits {limits}"
        # Ray's logical CPUs are the pod's CPUs; only the head may keep training off (0)
        allowed = {_cpus(limits["cpu"])} | ({0.0} if group is head else set())
        assert _cpus(params["num-cpus"]) in allowed, f"{label}: num-cpus vs limits.cpu"
    for group in spec["workerGroupSpecs"]:
        counts = [group[k] for k in ("minReplicas", "replicas", "maxReplicas")]
        assert all(isinstance(c, int) for c in counts), counts
        assert 0 <= counts[0] <= counts[1] <= counts[2], f"{group['groupName']}: {counts}"


def _logical_cpus(spec: dict[str, Any]) -> float:
    return _cpus(spec["headGroupSpec"]["rayStartParams"]["num-cpus"]) + sum(
        g["replicas"] * _cpus(g["rayStartParams"]["num-cpus"]) for g in spec["workerGroupSpecs"])


def _needed_cpus(config: JobConfig) -> float:
    sc = config.scaling
    return (sc.num_workers + sc.spare_workers) * sc.cpus_per_worker


def test_the_raycluster_fits_the_reference_task() -> None:
    config = load_config(REPO / "examples" / "gpt" / "config.toml")
    assert _logical_cpus(_one("RayCluster")["spec"]) >= _needed_cpus(config)


def test_every_pod_runs_one_image() -> None:
    # Ray needs the same Ray and Python on every node; the RayJob submitter uses the head's
    images = {_container(g)["image"] for spec in _cluster_specs().values() for g in _groups(spec)}
    assert len(images) == 1, images


def test_rayjob_runs_on_the_same_cluster_as_raycluster() -> None:
    assert _cluster_specs()["RayJob.rayClusterSpec"] == _cluster_specs()["RayCluster"]


def test_rayjob_submits_and_cleans_up() -> None:
    spec = _one("RayJob")["spec"]
    assert spec["submissionMode"] == "K8sJobMode"
    assert spec["shutdownAfterJobFinishes"] is True
    ttl = spec["ttlSecondsAfterFinished"]
    assert isinstance(ttl, int) and ttl >= 0, ttl


def test_rayjob_entrypoint_is_a_stalwart_run_that_joins_the_cluster_and_fits_it() -> None:
    args, config = _entrypoint()
    assert args.command == "run"
    # without --address, stalwart starts a Ray of its own inside the head pod
    assert args.address == "auto", args.address
    assert _logical_cpus(_one("RayJob")["spec"]["rayClusterSpec"]) >= _needed_cpus(config)
    # a retried (backoffLimit) or re-applied RayJob continues the run instead of being refused
    assert args.auto_resume is True
    assert args.resume is False, "--resume refuses the first attempt's new run dir"


def test_rayjob_retries_a_failed_run() -> None:
    retries = _one("RayJob")["spec"].get("backoffLimit", 0)
    assert isinstance(retries, int) and retries >= 1, retries


def test_rayjob_stops_its_run_with_sigterm_and_time_to_checkpoint() -> None:
    # read by Ray's job supervisor from the job's runtime env (a plain `ray job submit` gets
    # SIGTERM and 3 s); Ray's runtime env takes env_vars as strings only
    env = yaml.safe_load(_one("RayJob")["spec"]["runtimeEnvYAML"])["env_vars"]
    assert all(isinstance(v, str) for v in env.values()), env
    assert env["RAY_JOB_STOP_SIGNAL"] == "SIGTERM"
    _, config = _entrypoint()
    stop_timeout_s = config.failure.stop_timeout_s
    # the run's own stop deadline, and time to stop the workers and exit, before SIGKILL
    assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) >= stop_timeout_s + 30, env


def test_no_pod_mounts_dev_shm_itself() -> None:
    # KubeRay mounts a memory-backed /dev/shm in the Ray container, sized to its memory limit
    # (ray-operator/controllers/ray/common/pod.go, addEmptyDir); one of ours would stop it
    # (it skips a path already mounted) and leave /dev/shm unsized
    for where, spec in _cluster_specs().items():
        for group in _groups(spec):
            mounts = [m["mountPath"] for m in _container(group).get("volumeMounts", [])]
            assert "/dev/shm" not in mounts, f"{where}: {group.get('groupName', 'head')}"
            assert "plasma-directory" not in group["rayStartParams"], "no /dev/shm then"


def test_rayjob_checkpoints_and_run_dir_are_on_storage_every_pod_sees() -> None:
    args, config = _entrypoint()
    groups = _groups(_one("RayJob")["spec"]["rayClusterSpec"])
    storage = config.checkpoint.storage
    assert storage, "checkpoint.storage is unset: it would be the head pod's local run dir"
    scheme, sep, rest = storage.partition("://")
    if sep and scheme != "file":
        return  # an object store (s3://, gs://, ...): every pod reaches it over the network
    path = rest if sep else storage
    for group in groups:
        assert _under(path, _shared_mounts(group)), (
            f"{storage} is not on a ReadWriteMany volume of {group.get('groupName', 'head')}")
    # the driver (on the head) writes the run dir: on the volume, it outlives the cluster
    assert args.run_dir and _under(args.run_dir, _shared_mounts(groups[0])), args.run_dir


# ---------------------------------------------------------------------------- Dockerfile


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, its arguments) with continuation lines joined and ARG defaults expanded."""
    text = DOCKERFILE.read_text().replace("\\\n", " ")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    pairs = [(op.upper(), rest.strip()) for op, _, rest in (ln.partition(" ") for ln in lines)]
    defaults = dict(rest.split("=", 1) for op, rest in pairs if op == "ARG" and "=" in rest)
    defaults = {k: v.strip('"') for k, v in defaults.items()}

    def expand(rest: str) -> str:
        return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults.get(m[1] or m[2], m[0]), rest)

    return [(op, expand(rest)) for op, rest in pairs]


def _run_flags(rest: str) -> tuple[list[str], list[str]]:
    """A RUN's own flags (`--mount=...`) and its shell command's tokens."""
    tokens = shlex.split(rest)
    flags = list(itertools.takewhile(lambda t: t.startswith("--"), tokens))
    return flags, tokens[len(flags):]


def _runs() -> list[list[str]]:
    """The commands of every RUN, in order, as argv lists (a `a && b` RUN gives two)."""
    commands = []
    for op, rest in _instructions():
        if op == "RUN":
            tokens = _run_flags(rest)[1]
            cuts = [-1] + [i for i, t in enumerate(tokens) if t in ("&&", "||", ";")] + [len(tokens)]
            commands += [tokens[a + 1:b] for a, b in itertools.pairwise(cuts)]
    return commands


def _dockerfile_workdir() -> str:
    return [rest for op, rest in _instructions() if op == "WORKDIR"][-1]


def test_dockerfile_builds_on_the_ray_image_pyproject_pins() -> None:
    (base,) = [rest for op, rest in _instructions() if op == "FROM"]
    assert base == f"rayproject/ray:{RAY_VERSION}-{PYTHON_TAG}-cpu"


def test_dockerfile_installs_cpu_torch_then_the_project() -> None:
    torch = [tokens for tokens in _runs() if f"torch=={TORCH_VERSION}" in tokens]
    assert torch, f"no RUN installs torch=={TORCH_VERSION}"
    tokens = torch[0]
    assert tokens[:2] == ["pip", "install"]
    assert tokens[tokens.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    # the checkout, bind-mounted whole for one RUN (.dockerignore trims it)
    (source,) = [flag.split("target=")[1].split(",")[0] for op, rest in _instructions()
                 if op == "RUN" for flag in _run_flags(rest)[0]
                 if flag.startswith("--mount=type=bind,source=.,")]
    install = [t for t in _runs() if t[:2] == ["pip", "install"]
               and any(a.startswith(source) for a in t)]
    assert install, f"no RUN pip-installs the project mounted at {source}"
    assert _runs().index(tokens) < _runs().index(install[0]), "torch must come first"


def test_dockerfile_runs_as_a_non_root_user_from_a_workdir_with_the_examples() -> None:
    users = [rest for op, rest in _instructions() if op == "USER"]
    assert users and users[-1] not in ("root", "0"), users
    workdir = _dockerfile_workdir()
    assert any(f"{workdir}/examples" in tokens for tokens in _runs()), (
        f"examples/ is not copied into the WORKDIR {workdir}")


def test_dockerignore_keeps_local_state_out_of_the_build_context() -> None:
    # (`**/x` leaves out x at any depth, the root's included)
    entries = {ln.strip().rstrip("/").removeprefix("**/")
               for ln in (REPO / ".dockerignore").read_text().splitlines()
               if ln.strip() and not ln.startswith("#")}
    assert {".git", ".venv", "runs", "bench/results"} <= entries, entries
