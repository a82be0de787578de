"""`stalwart run --address` joins a Ray cluster started with `ray start`, as a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stalwart.core.events import read_jsonl
from stalwart.parallel.distributed import free_port
from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture()
def ray_cluster(tmp_path):
    """A head node from `ray start --block`, stopped through its own PID (never by name)."""
    port = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    log = (tmp_path / "ray-start.log").open("w")
    proc = subprocess.Popen([RAY, "start", "--head", f"--port={port}", "--num-cpus=2",
                             "--include-dashboard=false", "--disable-usage-stats", "--block"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 60
        while "block forever" not in (tmp_path / "ray-start.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "ray-start.log").read_text()
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", env
    finally:
        proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its daemons on SIGTERM
        proc.wait(timeout=60)
        log.close()


def test_run_on_a_ray_start_cluster(tmp_path, ray_cluster):
    address, env = ray_cluster
    cmd = ["run", str(REFERENCE_CONFIG), *sets(*TINY, "train.steps=20"), "--run-dir", "joined",
           "--address", address]
    proc = subprocess.run([str(Path(sys.executable).with_name("stalwart")), *cmd],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    events = read_jsonl(tmp_path / "joined" / "events.jsonl")
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == 20


def test_unreachable_address_is_one_clear_error(tmp_path):
    proc = stalwart("run", str(REFERENCE_CONFIG), "--address", f"127.0.0.1:{free_port()}",
                    "--run-dir", "nowhere", cwd=tmp_path, check=2, timeout=120)
    assert proc.stderr.startswith("stalwart: error: --address") and "nothing answers" in proc.stderr
    assert not (tmp_path / "nowhere").exists()
