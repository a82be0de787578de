"""`stalwart submit` ships code, not credentials: Ray's own packaging of the working directory,
with the excludes stalwart passes, holds none of them and no sweep state; `--dry-run` lists
exactly what Ray packs, names each credential it leaves out, and contacts nothing; submitting
from $HOME or /, or a config the upload would leave out, is refused before anything else.

No cluster: Ray's packaging (`create_package`, what the job SDK calls before it uploads) runs
locally, and the CLI runs as a user types it with an address that would record any contact.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from ray._private import ray_constants
from ray._private.runtime_env import packaging

from stalwart.cli import jobs, upload
from stalwart.core.errors import ConfigError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

STALWART = str(Path(sys.executable).with_name("stalwart"))
REFERENCE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "config.toml"
MARK = "SECRET-7f3a9c"  # in every secret file: found in a package, it was shipped

# One of each kind of credential, at the top and deeper down, by the names their tools use:
# each is kept back by a credential rule, and `--dry-run` names it.
CREDENTIALS = (
    ".env", ".env.production", ".envrc", "sub/.env", ".aws/credentials", ".aws/config",
    ".netrc", "_netrc", ".ssh/id_rsa", ".ssh/config", "id_ed25519", "id_rsa.pub",
    "keys/id_ecdsa", "tls/server.pem", "tls/server.key", "client.p12", ".git-credentials",
    ".pypirc", ".npmrc", ".docker/config.json", ".kube/config", ".gnupg/secring.gpg",
    ".azure/accessTokens.json", ".config/gcloud/credentials.db",
    "home/.config/gcloud/application_default_credentials.json", ".ray/auth_token",
    "auth_token",
    # Google's keys and secrets by the names they are downloaded as
    "credentials.json", "task/conf/credentials.json", "gcp-service-account.json",
    "keys/my-service-account-key.json", "client_secret_123.apps.googleusercontent.com.json",
    # tokens: Hugging Face (HF_HOME in the project, and the older ~/.huggingface), GitHub's
    # CLI, Kaggle, Vault, Databricks
    ".cache/huggingface/token", "hf/.cache/huggingface/stored_tokens", ".huggingface/token",
    ".config/gh/hosts.yml", "home/.config/gh/hosts.yml", ".kaggle/kaggle.json",
    "kaggle.json", ".vault-token", ".databrickscfg",
    # passwords in PostgreSQL's, s3cmd's and boto's files; Terraform's state and variables
    ".pgpass", ".s3cfg", ".boto", "infra/terraform.tfstate", "infra/terraform.tfstate.backup",
    "infra/prod.tfvars", "infra/.terraform/terraform.tfstate",
)
# Kept back by the other rules (so `--dry-run` does not call them credentials).
NEVER_SHIPPED = (
    ".local-cluster/auth_token", ".local-cluster/env",
    # a deploy/local state directory under another name: its .rayignore keeps it out
    "mycluster/auth_token", "mycluster/env", "mycluster/.rayignore",
    # a sweep's state (its tuner.pkl is unpickled by `sweep --resume`), in ./sweeps or in a
    # storage of its own
    "sweeps/s1/tuner.pkl", "sweeps/s1/experiment_state-2025-01-01_00-00-00.json",
    "sweeps/s1/sweep_results.json", "results/s2/tuner.pkl",
    # no secrets, but never a job's: runs, checkpoints, environments, VCS data
    "runs/old/events.jsonl", "checkpoints/step_1/x.bin", ".venv/bin/python", ".git/config",
)
SECRETS = CREDENTIALS + NEVER_SHIPPED
# What the job needs, including names close to a secret's that must still ship.
PROJECT = ("config.toml", "task/model.py", "task/id_utils.py", "task/keys.py",
           "task/credentials.py", "task/token.py", "task/sweeps/grid.py", "task/boto_io.py",
           "data/tokens.txt", "data/tokenizer.json", ".cache/huggingface/hub/model.txt",
           "environment.md", "README.md")


def _project(root: Path) -> Path:
    for name in SECRETS:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{MARK} {name}\n")
    (root / "mycluster" / ".rayignore").write_text("*\n")  # as deploy/local/up.sh writes it
    for name in PROJECT:
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"project file {name}\n")
    shutil.copy(REFERENCE_CONFIG, root / "config.toml")
    return root


def _excludes(root: Path) -> list[str]:
    spec = jobs.JobSpec(config=jobs.config_in("config.toml", root),
                        run_dir=root / "runs" / "new")
    return spec.runtime_env(root, storage="")["excludes"]


def _ray_package(root: Path, out: Path) -> zipfile.ZipFile:
    """The zip Ray's job SDK uploads: create_package with the excludes it composes (Ray's
    defaults, then the runtime_env's), as upload_working_dir_if_needed does."""
    excludes = ray_constants.get_runtime_env_default_excludes() + _excludes(root)
    packaging.create_package(str(root), out, include_gitignore=True, excludes=excludes)
    return zipfile.ZipFile(out)


def test_ray_packs_the_project_and_none_of_the_secrets(tmp_path):
    root = _project(tmp_path / "proj")
    package = _ray_package(root, tmp_path / "pkg.zip")
    assert sorted(package.namelist()) == sorted(PROJECT)
    assert MARK.encode() not in (tmp_path / "pkg.zip").read_bytes()


@pytest.fixture()
def listener() -> Iterator[tuple[str, socket.socket]]:
    """An address that would see any connection: a dry run must make none."""
    server = socket.create_server(("127.0.0.1", 0))
    server.setblocking(False)
    yield f"http://127.0.0.1:{server.getsockname()[1]}", server
    server.close()


def _connected(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
    except BlockingIOError:
        return False
    return True


def _stalwart(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([STALWART, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=50)


def test_dry_run_lists_what_ray_packs_and_contacts_nothing(tmp_path, listener):
    address, server = listener
    root = _project(tmp_path / "proj")
    package = _ray_package(root, tmp_path / "pkg.zip")
    env = {**os.environ, "RAY_ADDRESS": address, "RAY_API_SERVER_ADDRESS": address}
    proc = _stalwart("submit", "config.toml", "--run-dir", "runs/new", "--dry-run", cwd=root,
                     env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    listed = {ln.split(maxsplit=1)[1]: int(ln.split()[0]) for ln in lines
              if ln[:1] == " " or ln[:1].isdigit()}
    assert listed == {i.filename: i.file_size for i in package.infolist()}
    size = sum(listed.values())
    assert f"would upload {len(PROJECT)} files, {size} bytes (0.0 MiB) from {root}" in lines
    assert "nothing submitted (--dry-run)" in lines
    assert not _connected(server)
    # no address at all is fine too
    bare = {k: v for k, v in env.items() if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS")}
    again = _stalwart("submit", "config.toml", "--run-dir", "runs/new", "--dry-run", cwd=root,
                      env=bare)
    assert again.returncode == 0 and again.stdout == proc.stdout, again.stderr


def test_dry_run_shows_a_link_that_leads_outside(tmp_path):
    root = _project(tmp_path / "proj")
    (tmp_path / "outside.txt").write_text("elsewhere\n")
    (root / "data" / "linked.txt").symlink_to(tmp_path / "outside.txt")
    (entry,) = [e for e in upload.listing(root, _excludes(root)).entries
                if e.path == "data/linked.txt"]
    assert entry.target == (tmp_path / "outside.txt").resolve() and entry.size == 10
    assert f"data/linked.txt  (link to {entry.target})" in upload.describe(
        upload.listing(root, _excludes(root)))


@pytest.mark.parametrize("where", ["home", "above home", "root"])
def test_submit_from_home_or_root_is_refused_before_the_cluster(tmp_path, listener, where):
    address, server = listener
    home = tmp_path / "home" / "me"
    _project(home)
    cwd = {"home": home, "above home": tmp_path, "root": Path("/")}[where]
    env = {**os.environ, "HOME": str(home)}
    for extra in ((), ("--dry-run",)):
        proc = _stalwart("submit", "config.toml", "--address", address, *extra, cwd=cwd,
                         env=env)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert proc.stdout == ""
        assert proc.stderr.startswith(f"stalwart: error: refusing to submit from {cwd}, ")
        assert proc.stderr.count("\n") == 1, proc.stderr
    assert not _connected(server)


def test_refuse_home_or_root_allows_a_project_below_home(tmp_path):
    home = tmp_path / "me"
    upload.refuse_home_or_root(home / "proj", home=home)  # no error
    for cwd in (home, tmp_path, Path("/")):
        with pytest.raises(ConfigError, match="a job ships its whole working directory"):
            upload.refuse_home_or_root(cwd, home=home)


def _left_out(stdout: str) -> set[str]:
    prefix = "left out (credential): "
    return {ln.removeprefix(prefix) for ln in stdout.splitlines() if ln.startswith(prefix)}


def test_secret_files_the_environment_names_are_left_out_whatever_their_names(tmp_path):
    root = _project(tmp_path / "proj")
    (root / "task" / "cluster-token.txt").write_text(f"{MARK} token\n")
    (root / "mykey.txt").write_text(f"{MARK} key\n")
    (root / "old" / "previous.txt").parent.mkdir()
    (root / "old" / "previous.txt").write_text(f"{MARK} previous key\n")
    (root / "notes").mkdir()
    (root / "notes" / "sa.txt").write_text(f"{MARK} service account\n")
    env = {**os.environ, "RAY_AUTH_TOKEN_PATH": str(root / "task" / "cluster-token.txt"),
           "STALWART_CHECKPOINT_KEY_FILE": "mykey.txt",  # relative: to the cwd
           "STALWART_CHECKPOINT_TRUSTED_KEY_FILES": os.pathsep.join(
               ["/elsewhere/k", str(root / "old" / "previous.txt")]),
           "GOOGLE_APPLICATION_CREDENTIALS": "./notes/../notes/sa.txt"}
    excludes = jobs.JobSpec(config=jobs.config_in("config.toml", root),
                            run_dir=root / "runs" / "new").runtime_env(root, "", environ=env)
    named = {"/task/cluster-token.txt", "/mykey.txt", "/old/previous.txt", "/notes/sa.txt"}
    assert named <= set(excludes["excludes"])
    proc = _stalwart("submit", "config.toml", "--dry-run", cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr
    assert f"would upload {len(PROJECT)} files" in proc.stdout
    assert _left_out(proc.stdout) == {*CREDENTIALS, *(n[1:] for n in named)}


def test_dry_run_names_every_credential_it_leaves_out_and_nothing_else(tmp_path):
    root = _project(tmp_path / "proj")
    named_by_env = (*upload.SECRET_FILE_ENV_VARS, *upload.SECRET_PATH_LIST_ENV_VARS)
    env = {k: v for k, v in os.environ.items() if k not in named_by_env}
    proc = _stalwart("submit", "config.toml", "--dry-run", cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr
    # NEVER_SHIPPED (runs, sweeps, deploy state) is left out too, but not as a credential
    assert _left_out(proc.stdout) == set(CREDENTIALS)
    lines = proc.stdout.splitlines()
    assert lines.index(f"would upload {len(PROJECT)} files, "
                       f"{sum((root / p).stat().st_size for p in PROJECT)} bytes (0.0 MiB) "
                       f"from {root}") == len(PROJECT)


def test_a_named_secret_behind_a_link_is_left_out_where_named_and_where_it_leads(tmp_path):
    root = _project(tmp_path / "proj")
    (root / "vault").mkdir()
    (root / "vault" / "innocent.txt").write_text(f"{MARK} key\n")
    (root / "signing").symlink_to(root / "vault" / "innocent.txt")
    named = upload.secret_files_in(root, {"STALWART_CHECKPOINT_KEY_FILE": "signing"})
    assert named == ["/signing", "/vault/innocent.txt"]
    shipped = {e.path for e in upload.listing(root, [*_excludes(root), *named]).entries}
    assert not {"signing", "vault/innocent.txt"} & shipped


def test_glob_characters_in_a_named_file_match_that_file_only(tmp_path):
    (tmp_path / "k[1]*.txt").write_text("key\n")
    (tmp_path / "k1x.txt").write_text("not a key\n")
    named = upload.secret_files_in(tmp_path, {"HF_TOKEN_PATH": "k[1]*.txt"})
    assert [e.path for e in upload.listing(tmp_path, named).entries] == ["k1x.txt"]


def test_the_default_key_file_is_left_out_when_the_working_directory_holds_it(
        tmp_path, monkeypatch):
    home = tmp_path / "me"
    monkeypatch.setenv("HOME", str(home))
    cwd = home / ".config"  # below home: allowed, and it holds stalwart/checkpoint.key
    assert "/stalwart/checkpoint.key" in jobs.secret_excludes(cwd, environ={})
    assert not [p for p in jobs.secret_excludes(home / "proj", environ={}) if "stalwart" in p]


def test_a_config_the_upload_would_leave_out_is_refused_before_the_cluster(tmp_path, listener):
    address, server = listener
    root = _project(tmp_path / "proj")
    (root / "sweeps" / "base.toml").write_text((root / "config.toml").read_text())
    proc = _stalwart("submit", "sweeps/base.toml", "--address", address, cwd=root,
                     env=dict(os.environ))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == (
        "stalwart: error: config file 'sweeps/base.toml' would be left out of the upload (by a "
        ".gitignore, a .rayignore, or what submit never ships: runs/, checkpoints/, sweeps/, "
        "credentials), so the job could not read it; keep it where it ships, outside those\n")
    assert not _connected(server)
