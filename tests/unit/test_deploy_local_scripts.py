"""deploy/local's scripts refuse bad input before they start anything.

Each refusal runs the script as a user would and checks that it exits with 2 and one
`up.sh: error:` line, and that no state directory (so no node) came of it. The cluster itself
is started and stopped in tests/e2e/test_deploy_local.py.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

LOCAL = Path(__file__).resolve().parents[2] / "deploy" / "local"
UP, DOWN = LOCAL / "up.sh", LOCAL / "down.sh"
# The venv's bin first: up.sh checks ports with the Python next to `ray`.
ENV = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}


def _run(script: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(script), *args], cwd=cwd, env=ENV, capture_output=True,
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
