"""stalwart submit's pieces without a cluster: the entrypoint and its quoting, the run dir, the
address, and the pre-flight check against a real HTTP server on a real socket.

The server stands in for a Ray dashboard only in what `check_cluster` reads (GET /api/version
and its status code); it records every request, so a refused submit is seen to send nothing
but that one GET.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import pytest
import ray

from stalwart.cli import jobs
from stalwart.cli.main import _parser, main
from stalwart.core.errors import ClusterError, ConfigError
from stalwart.parallel.distributed import free_port

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

STALWART = str(Path(sys.executable).with_name("stalwart"))
REFERENCE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "config.toml"


# ---------------------------------------------------------------------------- entrypoint


def _spec(**kw) -> jobs.JobSpec:
    base = {"config": PurePosixPath("examples/gpt/config.toml"),
            "run_dir": Path("/shared/runs/my run"), "overrides": (), "injects": ()}
    return jobs.JobSpec(**{**base, **kw})


def test_entrypoint_is_a_stalwart_run_that_joins_the_jobs_cluster():
    spec = _spec(overrides=('checkpoint.storage="s3://bucket/run 1"', "run.name=it's"),
                 injects=("kill:rank=1,step=15",))
    argv = shlex.split(spec.entrypoint())
    assert argv[:2] == ["stalwart", "run"]
    args = _parser().parse_args(argv[1:])  # what the job's shell hands to stalwart
    assert args.command == "run" and args.config == "examples/gpt/config.toml"
    assert args.address == "auto" and args.run_dir == "/shared/runs/my run"
    assert args.overrides == ['checkpoint.storage="s3://bucket/run 1"', "run.name=it's"]
    assert args.inject == ["kill:rank=1,step=15"] and not args.resume


def test_resume_is_passed_through_and_resume_commands_continue_the_run():
    assert _parser().parse_args(shlex.split(_spec(resume=True).entrypoint())[1:]).resume
    spec = _spec(overrides=("train.steps=30",), injects=("kill:rank=1,step=15",))
    submit, run = (_parser().parse_args(shlex.split(c)[1:])
                   for c in spec.resume_commands("http://head:8265"))
    assert (submit.command, submit.address, submit.resume) == ("submit", "http://head:8265", True)
    assert (run.command, run.address, run.resume) == ("run", None, True)
    for args in (submit, run):
        assert args.run_dir == "/shared/runs/my run" and args.overrides == ["train.steps=30"]
        assert args.inject == []  # a fault that fired once is not injected again


def test_trust_unsigned_is_passed_through_to_the_run_and_its_resume_commands():
    spec = _spec(trust_unsigned=True)
    for command in (spec.entrypoint(), *spec.resume_commands("http://head:8265")):
        assert _parser().parse_args(shlex.split(command)[1:]).trust_unsigned
    assert not _parser().parse_args(shlex.split(_spec().entrypoint())[1:]).trust_unsigned


def test_auto_resume_is_passed_through_to_the_run_and_its_resume_commands():
    spec = _spec(auto_resume=True)
    for command in (spec.entrypoint(), *spec.resume_commands("http://head:8265")):
        args = _parser().parse_args(shlex.split(command)[1:])
        assert args.auto_resume and not args.resume  # a retried job: the same command
    # --resume (strict) with run.auto_resume in the config: --resume alone, never both.
    both = _spec(auto_resume=True, resume=True)
    for command in (both.entrypoint(), *both.resume_commands("http://head:8265")):
        args = _parser().parse_args(shlex.split(command)[1:])
        assert args.resume and not args.auto_resume
    assert not _parser().parse_args(shlex.split(_spec().entrypoint())[1:]).auto_resume


def test_runtime_env_ships_cwd_without_runs_state_or_environments(tmp_path):
    spec = _spec(run_dir=tmp_path / "out" / "r1")
    env = spec.runtime_env(tmp_path, storage=str(tmp_path / "ckpt"))
    assert env["working_dir"] == str(tmp_path)
    assert {"/out/r1/", "/ckpt/", ".local-cluster/", ".venv/", ".git/", "runs/"} <= set(
        env["excludes"])
    # `stalwart stop` is a SIGTERM for the run (a stop, as Ctrl-C is), with time to write its
    # checkpoint (failure.stop_timeout_s) and then to exit before Ray's SIGKILL.
    assert env["env_vars"] == {"RAY_JOB_STOP_SIGNAL": "SIGTERM",
                               "RAY_JOB_STOP_WAIT_TIME_S": str(120 + jobs.STOP_MARGIN_S)}
    slow = _spec(stop_timeout_s=600.5).runtime_env(tmp_path, storage="")
    assert slow["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == str(601 + jobs.STOP_MARGIN_S)
    # `stalwart stop` waits as long as the job was told to (its metadata), else the default's.
    assert jobs.stop_wait_of(SimpleNamespace(metadata={"stalwart_stop_wait_s": "661"})) == 661
    assert jobs.stop_wait_of(SimpleNamespace(metadata=None)) == 120 + jobs.STOP_MARGIN_S
    elsewhere = _spec(run_dir=Path("/elsewhere/r1")).runtime_env(tmp_path, storage="s3://b/c")
    assert elsewhere["excludes"] == list(jobs.WORKING_DIR_EXCLUDES)


# ---------------------------------------------------------------------------- paths


def test_run_dir_is_made_absolute_against_the_submitters_cwd(tmp_path):
    default = Path("runs") / "gpt-20260101-000000"
    assert jobs.absolute_run_dir(None, default, tmp_path) == tmp_path / default
    assert jobs.absolute_run_dir("a/../b", default, tmp_path) == tmp_path / "b"
    assert jobs.absolute_run_dir("/shared/r", default, tmp_path) == Path("/shared/r")


def test_config_must_be_inside_cwd(tmp_path):
    (tmp_path / "proj").mkdir()
    cwd = tmp_path / "proj"
    assert jobs.config_in("examples/gpt/config.toml", cwd) == PurePosixPath(
        "examples/gpt/config.toml")
    assert jobs.config_in(cwd / "c.toml", cwd) == PurePosixPath("c.toml")
    for outside in ("../c.toml", str(tmp_path / "c.toml")):
        with pytest.raises(ConfigError, match="outside the working directory"):
            jobs.config_in(outside, cwd)


def test_relative_checkpoint_storage_is_refused_for_a_job():
    for fine in ("", "/shared/ckpt", "s3://bucket/run"):
        jobs.check_storage(fine)
    with pytest.raises(ConfigError, match="relative path"):
        jobs.check_storage("ckpt")


# ---------------------------------------------------------------------------- address


def test_address_flag_wins_then_ray_api_server_address_then_ray_address():
    env = {"RAY_API_SERVER_ADDRESS": "http://a:8265", "RAY_ADDRESS": "http://b:8265"}
    assert jobs.resolve_address("https://c:443/", env) == "https://c:443"
    assert jobs.resolve_address(None, env) == "http://a:8265"
    assert jobs.resolve_address(None, {"RAY_ADDRESS": "http://b:8265"}) == "http://b:8265"


@pytest.mark.parametrize(("flag", "env", "message"), [
    (None, {}, "no cluster given"),
    (None, {"RAY_ADDRESS": "127.0.0.1:6390"}, "$RAY_ADDRESS '127.0.0.1:6390' is not the http"),
    ("head:8265", {}, "--address 'head:8265' is not the http"),
    ("ray://head:10001", {}, "is not the http"),
    ("http://", {}, "is not the http"),
])
def test_address_that_is_not_a_job_api_url_is_refused(flag, env, message):
    with pytest.raises(ClusterError) as err:
        jobs.resolve_address(flag, env)
    assert message in str(err.value)


def test_explicit_address_wins_inside_the_sdk_and_the_environment_is_restored(monkeypatch):
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://other:8265")
    with jobs._api_server_address("http://mine:8265"):
        assert os.environ["RAY_API_SERVER_ADDRESS"] == "http://mine:8265"
    assert os.environ["RAY_API_SERVER_ADDRESS"] == "http://other:8265"
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS")
    with jobs._api_server_address("http://mine:8265"):
        pass
    assert "RAY_API_SERVER_ADDRESS" not in os.environ


# ---------------------------------------------------------------------------- the cluster check


class _Dashboard(ThreadingHTTPServer):
    """Answers GET /api/version like Ray's job API, with the version and status it is given."""

    def __init__(self, ray_version: str, status: int = 200) -> None:
        self.ray_version, self.status, self.requests = ray_version, status, []
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _Dashboard

    def _answer(self) -> None:
        self.server.requests.append((self.command, self.path,
                                     self.headers.get("Authorization")))
        if self.path != "/api/version":
            status, body = 404, b"Not Found"
        elif self.server.status != 200:  # what Ray's token middleware answers
            status, body = self.server.status, b"Forbidden: Invalid authentication token"
        else:
            status, body = 200, json.dumps({"version": "4",
                                            "ray_version": self.server.ray_version}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args) -> None:  # keep pytest's output clean
        pass


@pytest.fixture()
def dashboard() -> Iterator[Callable[..., _Dashboard]]:
    servers = []

    def start(ray_version: str, status: int = 200) -> _Dashboard:
        server = _Dashboard(ray_version, status)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_same_ray_version_passes(dashboard):
    server = dashboard(ray.__version__)
    assert jobs.check_cluster(server.address) == ray.__version__
    assert [r[:2] for r in server.requests] == [("GET", "/api/version")]


def test_another_ray_version_is_refused_naming_both(dashboard):
    server = dashboard("2.59.0")
    with pytest.raises(ClusterError) as err:
        jobs.check_cluster(server.address, local_version="2.60.0")
    assert "runs Ray 2.59.0 and this machine Ray 2.60.0" in str(err.value)


@pytest.mark.parametrize(("auth_env", "status", "sent", "says"), [
    ({}, 401, None, "no token was sent: set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN"),
    ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "abc"}, 403, "Bearer abc",
     "refused the token (HTTP 403): RAY_AUTH_TOKEN"),
])
def test_token_is_sent_as_ray_sends_it_and_a_refusal_names_ray_auth_token(
        dashboard, tmp_path, auth_env, status, sent, says):
    # A process of its own: Ray reads RAY_AUTH_MODE once, when it is imported.
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    server = dashboard(ray.__version__, status)
    proc = subprocess.run([STALWART, "status", "raysubmit_x", "--address", server.address],
                          env={**env, **auth_env, "HOME": str(tmp_path)}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("stalwart: error: the cluster at") and says in proc.stderr
    assert server.requests == [("GET", "/api/version", sent)]


def test_unreachable_address_fails_in_seconds():
    start = time.monotonic()
    with pytest.raises(ClusterError, match="nothing answers there"):
        jobs.check_cluster(f"http://127.0.0.1:{free_port()}")
    assert time.monotonic() - start < jobs.CONNECT_TIMEOUT_S + 2


def test_submit_to_another_ray_version_is_one_error_and_sends_nothing(dashboard, tmp_path,
                                                                      monkeypatch, capsys):
    (tmp_path / "examples").mkdir()
    shutil.copy(REFERENCE_CONFIG, tmp_path / "examples" / "config.toml")
    monkeypatch.chdir(tmp_path)
    server = dashboard("2.59.0")
    code = main(["submit", "examples/config.toml", "--set", "train.steps=30",
                 "--address", server.address])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("stalwart: error: the cluster at") and "Ray 2.59.0" in err
    assert [r[:2] for r in server.requests] == [("GET", "/api/version")]  # no upload, no POST /api/jobs/


def test_submit_checks_the_config_before_the_cluster(dashboard, tmp_path, monkeypatch, capsys):
    shutil.copy(REFERENCE_CONFIG, tmp_path / "config.toml")
    monkeypatch.chdir(tmp_path)
    server = dashboard(ray.__version__)
    code = main(["submit", "config.toml", "--set", "train.stepz=10", "--address", server.address])
    assert code == 2 and "unknown key train.stepz" in capsys.readouterr().err
    assert server.requests == []


def test_submit_checks_injected_faults_against_the_config_before_the_cluster(
        dashboard, tmp_path, monkeypatch, capsys):
    # As `stalwart run` would on the cluster: the reference run has 2 workers, no rank 7.
    shutil.copy(REFERENCE_CONFIG, tmp_path / "config.toml")
    monkeypatch.chdir(tmp_path)
    server = dashboard(ray.__version__)
    code = main(["submit", "config.toml", "--inject", "kill:rank=7,step=15",
                 "--address", server.address])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "faults.rank" in err and "must be < scaling.num_workers" in err
    assert server.requests == []
