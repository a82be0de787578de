"""The CLI end to end on a local Ray: stop a run with Ctrl-C, resume it, and the final weights
equal an uninterrupted run's bit for bit."""

from __future__ import annotations

import json
import shlex
import signal
import subprocess

import pytest
import torch

from stalwart.core.events import read_jsonl
from tests.cli_helpers import (
    REFERENCE_CONFIG,
    STALWART,
    exported_weights,
    sets,
    stalwart_here,
    wait_for_step,
)
from tests.ray.conftest import NO_SPARE, RUN, STEPS

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("local_ray")]

UNFAILED = sets(*RUN, NO_SPARE)  # stopped and resumed, never failed: no warm spare


def test_interrupt_then_resume_equals_uninterrupted(tmp_path, straight_run):
    config = str(REFERENCE_CONFIG)

    interrupted = tmp_path / "interrupted"
    proc = subprocess.Popen([STALWART, "run", config, *UNFAILED, "--run-dir", "interrupted"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for_step(interrupted / "metrics.jsonl", 20, proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, f"expected 130 (stopped)\n{out}\n{err}"
    # The command that continues the run, as the run printed it and as `status` does.
    [printed] = [line.split("continue:", 1)[1].strip() for line in out.splitlines()
                 if "continue:" in line]
    assert printed == "stalwart run interrupted/config.toml --run-dir interrupted --auto-resume"
    status = stalwart_here("status", "interrupted", cwd=tmp_path, check=1).stdout
    assert status.splitlines()[-1] == f"  continue:   {printed}"
    stop = [e for e in read_jsonl(interrupted / "events.jsonl") if e["kind"] == "stopped"]
    assert len(stop) == 1 and 20 <= stop[0]["step"] < STEPS
    stopped_at = stop[0]["step"]

    # Without --resume the run dir is refused and left as it is.
    before = (interrupted / "events.jsonl").read_bytes()
    refused = stalwart_here("run", config, *UNFAILED, "--run-dir", "interrupted", cwd=tmp_path,
                            check=2)
    assert "--resume" in refused.stderr
    assert (interrupted / "events.jsonl").read_bytes() == before

    # Resumed with the printed command, in this test's process (the stop above needed a
    # process of its own to signal).
    stalwart_here(*shlex.split(printed)[1:], cwd=tmp_path)
    events = read_jsonl(interrupted / "events.jsonl")
    resumed = [e for e in events if e["kind"] == "resumed"]
    assert [e["from_step"] for e in resumed] == [stopped_at]
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == STEPS

    # The metrics continue where the stop left off, and the last losses agree exactly.
    straight_rows = read_jsonl(straight_run / "metrics.jsonl")
    resumed_rows = read_jsonl(interrupted / "metrics.jsonl")
    assert [r["step"] for r in resumed_rows] == list(range(1, STEPS + 1))
    assert resumed_rows[-1]["loss"] == straight_rows[-1]["loss"]

    a = exported_weights(straight_run, tmp_path, "straight")
    b = exported_weights(interrupted, tmp_path, "resumed")
    assert a.keys() == b.keys() and len(a) > 5
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs after resume"

    # Retention: keep_last=2 committed checkpoints remain, the final step among them.
    steps = sorted(p.name for p in (interrupted / "checkpoints").glob("step_*"))
    assert steps[-1] == f"step_{STEPS:09d}" and len(steps) == 2, steps
    manifest = json.loads((interrupted / "checkpoints" / steps[-1] / "manifest.json").read_text())
    assert manifest["step"] == STEPS and manifest["world_size"] == 2
