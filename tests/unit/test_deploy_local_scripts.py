"""deploy/local's scripts refuse bad input before they start anything, turn on Ray's token
authentication, and down.sh stops and removes only what up.sh started and made.

Each refusal runs the script as a user would and checks that it exits with 2 and one
`up.sh: error:` line, and that no state directory (so no node) came of it. The token and the
private temp dir are checked on a cluster of fake nodes (a `ray` on PATH that records what it
got and waits for SIGTERM); down.sh runs on state directories crafted to point it at what is
not the cluster's. The real cluster is started and stopped in tests/e2e/test_deploy_local.py.
"""

from __future__ import annotations

import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

LOCAL = Path(__file__).resolve().parents[2] / "deploy" / "local"
UP, DOWN = LOCAL / "up.sh", LOCAL / "down.sh"
# The venv's bin first: up.sh checks ports with the Python next to `ray`.
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def _run(script: Path, *args: str, cwd: Path,
         env: dict[str, str] = ENV) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=30)


@pytest.mark.parametrize("script", [UP, DOWN], ids=lambda p: p.name)
def test_scripts_parse_and_say_how_to_use_them(script, tmp_path):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    usage = _run(script, "--help", cwd=tmp_path)
    assert usage.returncode == 0 and "--state-dir DIR" in usage.stdout


@pytest.mark.parametrize(("args", "says"), [
    (["--nodes", "0"], "--nodes must be a positive integer, got '0'"),
    (["--nodes", "19"], "at most 18 nodes"),
    (["--cpus-per-node", "two"], "--cpus-per-node must be a positive integer"),
    (["--object-store-mb", "10"], "--object-store-mb must be at least 75"),
    (["--port", "65000"], "--port 65000 with 2 nodes needs ports up to 65599"),
    (["--port", "20000", "--dashboard-port", "20100"], "lies in the cluster's ports"),
    (["--bogus"], "unknown option --bogus"),
])
def test_up_refuses_bad_options(tmp_path, args, says):
    proc = _run(UP, *args, "--state-dir", "state", cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("up.sh: error:"), proc.stderr
    assert says in proc.stderr and proc.stderr.count("\n") == 1
    assert not (tmp_path / "state").exists()


def _free_range(span: int) -> int:
    """A port P with P .. P+span free now, below the ephemeral range (nothing self-binds there)."""
    for _ in range(50):
        base = random.randrange(20000, 30000 - span, 10)
        try:
            for port in range(base, base + span + 1):
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("", port))
            return base
        except OSError:
            continue
    raise AssertionError("no free range of ports")


@pytest.mark.parametrize("offset", [0, 15, 250, 600], ids=["gcs", "node-0", "worker", "dashboard"])
def test_up_refuses_a_taken_port_naming_it(tmp_path, offset):
    base = _free_range(600)  # 2 nodes: P .. P+599, and the dashboard at P+600
    with socket.socket() as taken:
        taken.bind(("", base + offset))
        taken.listen()
        proc = _run(UP, "--port", str(base), "--dashboard-port", str(base + 600),
                    "--state-dir", "state", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    flag = "--dashboard-port" if offset == 600 else "--port"
    assert proc.stderr.startswith(f"up.sh: error: port {base + offset} is taken (1 taken")
    assert f"choose another {flag}" in proc.stderr
    assert not (tmp_path / "state").exists()


def test_down_refuses_a_directory_without_a_cluster(tmp_path):
    proc = _run(DOWN, "--state-dir", "nothing", cwd=tmp_path)
    assert proc.returncode == 2 and "no cluster recorded in nothing" in proc.stderr


# ---------------------------------------------------------------------------- token auth

# `ray start`: records its token settings, then its arguments (the fake python counts those),
# and blocks until SIGTERM, as `ray start --block` does.
FAKE_RAY = """#!/bin/bash
trap 'exit 0' TERM
printf 'mode=%s\\ntoken=%s\\n' "${RAY_AUTH_MODE:-}" "${RAY_AUTH_TOKEN:-}" >"$FAKE_DIR/env.$$"
printf '%s\\n' "$@" >"$FAKE_DIR/argv.$$"
while :; do sleep 0.1; done
"""
# The python next to `ray`, which up.sh runs: the real one, but for its wait for the nodes
# (the program that imports ray), which returns once every fake node has started.
FAKE_PYTHON = """#!/bin/bash
if [ "${1:-}" = - ]; then
    shift
    program=$(cat)
    if grep -q '^import ray' <<<"$program"; then  # its arguments: PORT DASHBOARD_PORT NODES ...
        until [ "$(find "$FAKE_DIR" -name 'argv.*' | wc -l)" -ge "$3" ]; do sleep 0.05; done
        exit 0
    fi
    exec %(python)s - "$@" <<<"$program"
fi
exec %(python)s "$@"
"""


def _record(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def _pids(state_dir: Path) -> dict[str, int]:
    return {name: int(pid) for name, pid in (line.split() for line in
                                             (state_dir / "pids").read_text().splitlines())}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def fake_cluster(tmp_path) -> Iterator[tuple[Path, dict[str, str]]]:
    """up.sh's cluster of 2 fake nodes: (its state directory, the environment it ran in)."""
    fakes = tmp_path / "fakes"
    bin_dir = fakes / "bin"
    bin_dir.mkdir(parents=True)
    for name, body in (("ray", FAKE_RAY),
                       ("python", FAKE_PYTHON % {"python": shlex.quote(sys.executable)})):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = {**ENV, "PATH": f"{bin_dir}{os.pathsep}{ENV['PATH']}", "FAKE_DIR": str(fakes)}
    base = _free_range(600)
    state_dir = tmp_path / "state"
    up = _run(UP, "--port", str(base), "--dashboard-port", str(base + 600), "--state-dir",
              str(state_dir), cwd=tmp_path, env=env)
    pids = _pids(state_dir) if (state_dir / "pids").exists() else {}
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield state_dir, env
    finally:
        if (state_dir / "pids").exists():
            _run(DOWN, "--state-dir", str(state_dir), "--timeout", "5", cwd=tmp_path, env=env)
        for pid in pids.values():  # the fake nodes, should down.sh have failed
            if not _gone(pid):
                os.killpg(pid, signal.SIGKILL)


def test_up_starts_every_node_with_the_clusters_token_in_a_private_temp_dir(fake_cluster):
    state_dir, env = fake_cluster
    token_file = state_dir / "auth_token"
    token = token_file.read_text().strip()
    assert len(token) == 64 and token_file.stat().st_mode & 0o777 == 0o600
    fakes = Path(env["FAKE_DIR"])
    pids = _pids(state_dir)
    assert len(pids) == 2
    ray_temp = Path((state_dir / "ray_temp_dir").read_text().strip())
    for pid in pids.values():
        assert _record(fakes / f"env.{pid}") == {"mode": "token", "token": token}
        argv = (fakes / f"argv.{pid}").read_text().splitlines()
        assert argv[0] == "start" and f"--temp-dir={ray_temp}" in argv
    # Ray makes its temp dir world-writable itself: its parent is the cluster's, mode 0700
    private = ray_temp.parent
    assert private.parent == Path("/tmp") and private.name.startswith("stalwart-ray-")
    assert private.stat().st_mode & 0o777 == 0o700 and private.stat().st_uid == os.getuid()
    # `. DIR/env` gives the shell the same token settings
    sourced = subprocess.run(["bash", "-c", f". {state_dir}/env && "
                              'echo "$RAY_AUTH_MODE $RAY_AUTH_TOKEN"'], env=env,
                             capture_output=True, text=True, timeout=30)
    assert sourced.stdout.split() == ["token", token]
    # down.sh stops these nodes (they are what up.sh started) and removes the private dir
    down = _run(DOWN, "--state-dir", str(state_dir), "--timeout", "10", cwd=state_dir, env=env)
    assert down.returncode == 0, down.stdout + down.stderr
    assert down.stdout.count("stopping node-") == 2, down.stdout
    deadline = time.monotonic() + 10  # reaped by init, asynchronously
    while not all(map(_gone, pids.values())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(_gone, pids.values())) and not private.exists()


# ---------------------------------------------------------------------------- down.sh


def _state(tmp_path: Path, ray_temp_dir: str, pids: str = "") -> Path:
    """A state directory as up.sh leaves it, with the given ray_temp_dir and pids."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "pids").write_text(pids)
    (state_dir / "ray_temp_dir").write_text(ray_temp_dir + "\n")
    return state_dir


@pytest.fixture
def private_dir() -> Iterator[Path]:
    """A directory as up.sh makes it for the Ray temp dir: /tmp/stalwart-ray-XXXXXX."""
    path = Path(tempfile.mkdtemp(prefix="stalwart-ray-", dir="/tmp"))
    try:
        yield path
    finally:
        subprocess.run(["rm", "-rf", "--", str(path)], check=True)


@pytest.mark.parametrize("recorded", ["{dir}/ray", "{dir}"], ids=["up.sh", "earlier-up.sh"])
def test_down_removes_the_clusters_private_temp_dir(tmp_path, private_dir, recorded):
    (private_dir / "ray" / "session_latest").mkdir(parents=True)
    state_dir = _state(tmp_path, recorded.format(dir=private_dir))
    proc = _run(DOWN, "--state-dir", str(state_dir), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not private_dir.exists() and not (state_dir / "ray_temp_dir").exists()


@pytest.mark.parametrize("how", ["dotdot", "symlink", "not-under-tmp"])
def test_down_removes_nothing_that_is_not_the_clusters_private_dir(tmp_path, private_dir, how):
    victim = tmp_path / "victim"
    (victim / "ray").mkdir(parents=True)
    (victim / "ray" / "keep").write_text("x")
    if how == "dotdot":  # /tmp/stalwart-ray-x/../<victim>: passes a plain prefix match
        recorded = f"{private_dir}/../{os.path.relpath(victim, '/tmp')}"
    elif how == "symlink":  # the prefix, but a link to elsewhere; its ray/ is the victim's
        link = Path(f"{private_dir}-link")
        link.symlink_to(victim)
        recorded = f"{link}/ray"
    else:
        recorded = str(victim)
    assert Path(recorded).resolve() in (victim, victim / "ray")  # it does reach the victim
    state_dir = _state(tmp_path, recorded)
    try:
        proc = _run(DOWN, "--state-dir", str(state_dir), cwd=tmp_path)
    finally:
        if how == "symlink":
            link.unlink()
    assert (victim / "ray" / "keep").read_text() == "x" and private_dir.exists()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "not removed" in proc.stderr, proc.stderr


@pytest.mark.parametrize("leader", [True, False], ids=["session-leader", "in-a-session"])
def test_down_leaves_alone_a_live_process_that_took_a_recorded_pid(tmp_path, private_dir,
                                                                   leader):
    # the node died and the system gave its pid to another process: here a sleep of the
    # user's own, in the worst case leading a session of its own as the node did
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=leader)
    try:
        state_dir = _state(tmp_path, f"{private_dir}/ray", pids=f"node-0 {sleeper.pid}\n")
        proc = _run(DOWN, "--state-dir", str(state_dir), "--timeout", "1", cwd=tmp_path)
        assert sleeper.poll() is None, "down.sh signalled a process that is not a node"
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"pid {sleeper.pid} is now another process: left alone" in proc.stdout
    finally:
        sleeper.kill()
        sleeper.wait()
