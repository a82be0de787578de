"""deploy/local and `stalwart submit`, exactly as a user types them, on one real cluster.

One cluster for the module (starting one takes seconds, each job tens of them): `up.sh` with
2 nodes x 2 CPUs on free ports, used from a project directory holding only the reference
config (the task itself is installed with stalwart). Every job's run dir is checked on disk.
The last test runs `down.sh` and looks for any process left in the nodes' sessions.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from stalwart.core.events import read_jsonl
from tests.cli_helpers import (
    REFERENCE_CONFIG,
    STALWART,
    TINY,
    exported_weights,
    sets,
    wait_for_event,
    wait_for_step,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
UP, DOWN = REPO / "deploy" / "local" / "up.sh", REPO / "deploy" / "local" / "down.sh"
BIN = Path(sys.executable).parent
CONFIG = "examples/gpt/config.toml"
PORT_SPAN = 600  # up.sh with 2 nodes binds P .. P+599 (deploy/local/README.md)


@dataclass(frozen=True)
class Cluster:
    state_dir: Path
    project: Path
    env: dict[str, str]
    """The user's environment after `. DIR/env`."""
    pids: dict[str, int]

    @property
    def dashboard(self) -> str:
        return self.env["STALWART_DASHBOARD"]

    def stalwart(self, *args: str, check: int | None = 0, timeout: float = 180
                 ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([STALWART, *args], cwd=self.project, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check is not None and proc.returncode != check:
            raise AssertionError(f"stalwart {' '.join(args)} exited {proc.returncode}, "
                                 f"expected {check}\n--- stdout\n{proc.stdout}\n--- stderr\n"
                                 f"{proc.stderr}")
        return proc


def _ports_free(ports: range) -> bool:
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
            except OSError:
                return False
    return True


def _free_port_base() -> int:
    """P with P .. P+PORT_SPAN (the cluster's ports and the dashboard's) free, below the
    ephemeral range, where no self-bound port of another process will appear meanwhile."""
    for _ in range(50):
        base = random.randrange(20000, 30000 - PORT_SPAN, 10)
        if _ports_free(range(base, base + PORT_SPAN + 1)):
            return base
    raise AssertionError("no free range of ports for the cluster")


def _user_env() -> dict[str, str]:
    """This environment without a Ray address or token of its own, and the venv's bin first
    (up.sh runs the `ray` on PATH; the nodes run jobs' `stalwart` from theirs)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") and not k.startswith("RAY_AUTH")}
    return {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}"}


def _sourced(env_file: Path, env: dict[str, str]) -> dict[str, str]:
    """The environment after `. env_file`, as a user's shell would have it."""
    out = subprocess.run(["bash", "-c", f". {env_file} && env -0"], env=env, check=True,
                         capture_output=True, text=True, timeout=30).stdout
    return dict(line.split("=", 1) for line in out.split("\0") if line)


def _session_members(sid: int) -> list[int]:
    """Live processes whose session or process group is `sid`."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                pid = int(entry.name)
                if sid in (os.getsid(pid), os.getpgid(pid)):
                    members.append(pid)
            except (ProcessLookupError, PermissionError):
                continue
    return members


def _token_file_state() -> bytes | None:
    path = Path.home() / ".ray" / "auth_token"
    return path.read_bytes() if path.exists() else None


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("deploy_local")
    project = root / "project"
    (project / "examples" / "gpt").mkdir(parents=True)
    shutil.copy(REFERENCE_CONFIG, project / CONFIG)
    state_dir = root / "cluster"
    port = _free_port_base()
    user_token = _token_file_state()
    up = subprocess.run(
        ["bash", str(UP), "--nodes", "2", "--cpus-per-node", "2", "--state-dir", str(state_dir),
         "--port", str(port), "--dashboard-port", str(port + PORT_SPAN)],
        cwd=project, env=_user_env(), capture_output=True, text=True, timeout=180)
    pids = ({name: int(pid) for name, pid in (line.split() for line in
                                              (state_dir / "pids").read_text().splitlines())}
            if (state_dir / "pids").exists() else {})
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert f". {state_dir}/env" in up.stdout and "stalwart submit" in up.stdout
        assert _token_file_state() == user_token  # the user's own token is left alone
        yield Cluster(state_dir=state_dir, project=project, pids=pids,
                      env=_sourced(state_dir / "env", _user_env()))
    finally:
        if (state_dir / "pids").exists():  # a test failed before test_down ran
            subprocess.run(["bash", str(DOWN), "--state-dir", str(state_dir)], timeout=120)


def _events(run_dir: Path) -> list[dict]:
    return read_jsonl(run_dir / "events.jsonl")


def test_up_starts_two_nodes_with_token_auth(cluster):
    env = cluster.env
    assert env["RAY_AUTH_MODE"] == "token"
    assert env["RAY_AUTH_TOKEN"] == (cluster.state_dir / "auth_token").read_text().strip()
    assert (cluster.state_dir / "auth_token").stat().st_mode & 0o077 == 0
    assert env["RAY_API_SERVER_ADDRESS"] == env["STALWART_DASHBOARD"]
    assert set(cluster.pids) == {"node-0", "node-1"}
    for pid in cluster.pids.values():
        assert os.getsid(pid) == pid  # what down.sh relies on
    alive = subprocess.run(
        [sys.executable, "-c", "import ray; ray.init(logging_level='ERROR'); "
         "print(sum(n['Alive'] for n in ray.nodes()))"],
        env=env, capture_output=True, text=True, timeout=120)
    assert alive.stdout.strip() == "2", alive.stdout + alive.stderr


def test_up_refuses_a_running_cluster_and_taken_ports(cluster, tmp_path):
    port = cluster.env["RAY_ADDRESS"].rsplit(":", 1)[1]
    again = subprocess.run(["bash", str(UP), "--state-dir", str(cluster.state_dir), "--port",
                            port], env=_user_env(), capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "already holds a running cluster" in again.stderr
    taken = subprocess.run(["bash", str(UP), "--state-dir", str(tmp_path / "other"), "--port",
                            port], env=_user_env(), capture_output=True, text=True, timeout=60)
    assert taken.returncode == 2 and f"port {port} is taken" in taken.stderr
    assert not (tmp_path / "other" / "pids").exists()


@contextlib.contextmanager
def another_ray_started_later() -> Iterator[None]:
    """A Ray of its own started after the cluster, as a `stalwart run` without --address
    does: it becomes /tmp/ray's "current cluster", which must not capture the jobs' drivers."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import ray, sys; ray.init(address='local', num_cpus=1, "
         "include_dashboard=False, logging_level='ERROR'); print('up', flush=True); "
         "sys.stdin.read(); ray.shutdown()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=_user_env())
    try:
        assert proc.stdout.readline().strip() == "up"
        yield
    finally:
        proc.stdin.close()  # it shuts its Ray down and exits
        proc.wait(timeout=60)


# The driver-loss test's run; submitted once, without a failure, it is also the reference
# that test's weights must equal.
STEPS = 160
STRAIGHT = sets(*TINY, f"train.steps={STEPS}", "checkpoint.persist_every=30", "run.log_every=1")


@dataclass(frozen=True)
class Submitted:
    run_dir: Path
    submit: str
    logs: str
    status: str


@pytest.fixture(scope="module")
def straight(cluster) -> Submitted:
    """`submit`, then `logs --follow` to its end, then `status`: a job without a failure."""
    with another_ray_started_later():
        submit = cluster.stalwart("submit", CONFIG, "--address", cluster.dashboard, *STRAIGHT,
                                  "--run-dir", "runs/ok", "--job-id", "stalwart-ok")
        logs = cluster.stalwart("logs", "stalwart-ok", "--follow")
    status = cluster.stalwart("status", "stalwart-ok", "--address", cluster.dashboard)
    # relative to the submitter, made absolute
    return Submitted(cluster.project / "runs" / "ok", submit.stdout, logs.stdout, status.stdout)


def test_submit_then_logs_follow_to_success(straight):
    run_dir = straight.run_dir
    assert "submitted job stalwart-ok" in straight.submit and str(run_dir) in straight.submit
    assert f"FINISHED at step {STEPS}" in straight.logs
    assert "job stalwart-ok: SUCCEEDED" in straight.logs
    assert straight.status.startswith("job stalwart-ok: SUCCEEDED")
    assert str(run_dir) in straight.status
    events = _events(run_dir)
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == STEPS


def test_stop_checkpoints_the_run_and_says_how_to_resume_it(cluster):
    """`logs --follow` stopped by Ctrl-C leaves the job running; `stalwart stop` checkpoints
    it and prints the --resume to continue with (which the driver-loss test below submits)."""
    run_dir = cluster.project / "runs" / "stopped"
    cluster.stalwart("submit", CONFIG, *sets(*TINY, "train.steps=2000",
                                             "checkpoint.persist_every=10"),
                     "--run-dir", str(run_dir), "--job-id", "stalwart-stop")
    # As in a terminal: Ctrl-C's default action, even when pytest itself runs with SIGINT
    # ignored (a background job of a shell; the child would inherit that).
    follow = subprocess.Popen([STALWART, "logs", "stalwart-stop", "--follow"],
                              cwd=cluster.project, env=cluster.env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for_step(run_dir / "metrics.jsonl", 20, follow, timeout=120)
        # Ctrl-C once it follows (a line of the job's log came through), not while it starts.
        assert follow.stdout is not None and follow.stdout.readline()
        follow.send_signal(signal.SIGINT)  # Ctrl-C stops the following, not the job
        _, err = follow.communicate(timeout=30)
    finally:
        follow.kill()
    assert follow.returncode == 130 and "job stalwart-stop goes on" in err
    assert "RUNNING" in cluster.stalwart("status", "stalwart-stop").stdout.splitlines()[0]

    stop = cluster.stalwart("stop", "stalwart-stop")
    assert "job stalwart-stop: STOPPED" in stop.stdout
    # The command that continues the run: the one `stalwart status RUN_DIR` prints too.
    continue_line = stop.stdout.splitlines()[-1]
    assert continue_line == (f"  continue:   stalwart run {run_dir}/config.toml --run-dir "
                             f"{run_dir} --auto-resume")
    assert cluster.stalwart("status", str(run_dir), check=1).stdout.splitlines()[-1] == \
        continue_line
    events = _events(run_dir)
    stopped = [e for e in events if e["kind"] == "stopped"]
    assert len(stopped) == 1  # the run saw a SIGTERM and checkpointed its last step
    commits = [e["step"] for e in events if e["kind"] == "checkpoint_committed"]
    assert commits[-1] == stopped[0]["step"]


def _driver_pid(cluster: Cluster, job_id: str) -> int:
    """The PID of a job's driver (`stalwart run`), from the cluster's job API. Asked here,
    not by a Python of its own that imports Ray's job SDK: on a busy machine that start
    took longer than the rest of the run."""
    request = urllib.request.Request(
        f"{cluster.dashboard}/api/jobs/{job_id}",
        headers={"Authorization": f"Bearer {cluster.env['RAY_AUTH_TOKEN']}"})
    deadline = time.monotonic() + 60
    while not (driver := json.load(urllib.request.urlopen(request, timeout=30)
                                   ).get("driver_info")):
        assert time.monotonic() < deadline, f"job {job_id} has no driver"
        time.sleep(0.1)
    return int(driver["pid"])


def _wait_for_step(run_dir: Path, step: int) -> None:
    wait_for_step(run_dir / "metrics.jsonl", step, None, timeout=120)


def test_a_killed_then_terminated_driver_loses_no_step_and_auto_resume_ends_bit_identical(
        cluster, straight, tmp_path):
    """SIGKILL of a job's driver: its workers commit the step in flight and exit. The job
    submitted again with --auto-resume continues from there. SIGTERM of that one's driver
    checkpoints the step in flight and stops; a third submit, with the --resume that a stop
    prints, finishes with the weights of the failure-free run."""
    run = STRAIGHT
    run_dir = cluster.project / "runs" / "driver-lost"
    cluster.stalwart("submit", CONFIG, *run, "--run-dir", str(run_dir), "--auto-resume",
                     "--job-id", "stalwart-driver-kill")
    # Each driver's pid is looked up before the step it is killed at, which must leave
    # room for the steps after it.
    _wait_for_step(run_dir, 1)
    killed = _driver_pid(cluster, "stalwart-driver-kill")
    _wait_for_step(run_dir, 40)
    os.kill(killed, signal.SIGKILL)
    logged = read_jsonl(run_dir / "metrics.jsonl")[-1]["step"]

    cluster.stalwart("submit", CONFIG, *run, "--run-dir", str(run_dir), "--auto-resume",
                     "--job-id", "stalwart-driver-term")
    resumed = _wait_for_event(run_dir, "resumed")
    # at most one step behind the last step the killed driver logged (the last periodic
    # commit, step 30, is at least 10 behind)
    assert resumed["from_step"] >= logged - 1
    terminated = _driver_pid(cluster, "stalwart-driver-term")
    # A few steps after the resume, not more: the driver takes the workers' steps in batches
    # (a poll every 0.5 s) and passes the stop on at its next poll; on an idle machine a
    # SIGTERM sent 20 steps after the resume once landed after the job's last step.
    _wait_for_step(run_dir, resumed["from_step"] + 5)
    os.kill(terminated, signal.SIGTERM)
    logs = cluster.stalwart("logs", "stalwart-driver-term", "--follow", check=1)
    stopped = [e for e in _events(run_dir) if e["kind"] == "stopped"]
    assert len(stopped) == 1 and f"STOPPED at step {stopped[0]['step']}" in logs.stdout
    commits = [e["step"] for e in _events(run_dir) if e["kind"] == "checkpoint_committed"]
    assert commits[-1] == stopped[0]["step"]  # the step in flight, checkpointed

    again = cluster.stalwart("submit", CONFIG, *run, "--run-dir", str(run_dir), "--resume",
                             "--follow")
    assert again.stdout.rstrip().endswith("SUCCEEDED")
    events = _events(run_dir)
    assert [e["from_step"] for e in events if e["kind"] == "resumed"] == [
        resumed["from_step"], stopped[0]["step"]]
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == STEPS
    a = exported_weights(straight.run_dir, tmp_path, "straight")
    b = exported_weights(run_dir, tmp_path, "lost")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _wait_for_event(run_dir: Path, kind: str) -> dict:
    return wait_for_event(run_dir / "events.jsonl", kind, None, timeout=120)


def test_ray_job_submit_runs_stalwart_and_a_killed_worker_is_recovered(cluster):
    """Ray's own `ray job submit` of `stalwart run`: the job succeeds through a killed worker."""
    run_dir = cluster.project / "runs" / "ray-job"
    proc = subprocess.run(
        [str(BIN / "ray"), "job", "submit", "--address", cluster.dashboard, "--working-dir",
         ".", "--", "stalwart", "run", CONFIG, "--address", "auto", "--run-dir", str(run_dir),
         *sets(*TINY, "train.steps=30"), "--inject", "kill:rank=1,step=15"],
        cwd=cluster.project, env=cluster.env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "succeeded" in proc.stdout
    events = _events(run_dir)
    assert "recovered" in [e["kind"] for e in events]
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == 30


def test_a_sweep_runs_on_the_cluster(cluster):
    """`stalwart sweep --address`: two trials of 1 worker each, side by side on the cluster."""
    sweep = cluster.project / "sweep.toml"
    overrides = [*TINY, "train.steps=10", "scaling.num_workers=1"]
    sweep.write_text(f'config = "{CONFIG}"\nset = {json.dumps(overrides)}\n'
                     'metric = "loss"\n[search]\n"train.lr" = { grid = [1e-3, 1e-2] }\n')
    proc = cluster.stalwart("sweep", "sweep.toml", "--address", cluster.env["RAY_ADDRESS"],
                            timeout=200)
    assert "best: " in proc.stdout
    results = json.loads((cluster.project / "sweeps" / "sweep" / "sweep_results.json"
                          ).read_text())
    assert sorted(t["params"]["train.lr"] for t in results["trials"]) == [1e-3, 1e-2]
    assert {(t["state"], t["step"]) for t in results["trials"]} == {("finished", 10)}


def test_run_joins_the_cluster_at_its_address(cluster):
    """`stalwart run --address HOST:PORT` from the user's shell: the driver here, on the
    cluster's Ray (token authentication from the sourced env)."""
    run_dir = cluster.project / "runs" / "joined"
    cluster.stalwart("run", CONFIG, *sets(*TINY, "train.steps=20"), "--run-dir", str(run_dir),
                     "--address", cluster.env["RAY_ADDRESS"])
    events = _events(run_dir)
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == 20


def test_unknown_job_is_one_clear_error(cluster):
    proc = cluster.stalwart("status", "raysubmit_nosuchjob", check=2)
    assert proc.stderr == (f"stalwart: error: the cluster at {cluster.dashboard} has no job "
                           f"'raysubmit_nosuchjob' (`ray job list` lists its jobs)\n")


def test_down_stops_every_process_of_the_cluster(cluster):
    assert all(_session_members(pid) for pid in cluster.pids.values())  # the check can fail
    proc = subprocess.run(["bash", str(DOWN), "--state-dir", str(cluster.state_dir)],
                          env=_user_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    deadline = time.monotonic() + 10  # the kernel reaps the last ones asynchronously
    while (left := {pid: _session_members(pid) for pid in cluster.pids.values()
                    if _session_members(pid)}) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes left in the cluster's sessions: {left}"
    # what stays: the logs, and the ignore files that keep them out of uploads and commits
    assert sorted(p.name for p in cluster.state_dir.iterdir()) == [".gitignore", ".rayignore",
                                                                   "logs"]
