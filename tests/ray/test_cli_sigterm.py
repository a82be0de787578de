"""SIGTERM to a local `stalwart run`, as a scheduler sends it (Slurm's time limit, a pod's
deletion): the step in flight is checkpointed and the driver exits 143; a second SIGTERM
during the stop, or failure.stop_timeout_s, abandons that checkpoint and the previous one
stays; `--auto-resume` then continues the run from its newest checkpoint to the end.

The stops that must not complete freeze the step in flight with a `hang` fault (rank 1
SIGSTOPped), and push hang detection (the heartbeat's and the node agent's) far out so that
nothing but the stop ends the run.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from stalwart.checkpointing.storage.catalog import list_step_dirs
from stalwart.core.events import read_jsonl
from tests.cli_helpers import REFERENCE_CONFIG, STALWART, sets, stalwart, wait_for_step
from tests.ray.conftest import NO_SPARE, RUN

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

PERSIST_EVERY = 50
# 150 steps: room for a stop after step 55, two more runs that stop, and a last that ends.
ARGS = [str(REFERENCE_CONFIG), *sets(*RUN, NO_SPARE, "train.steps=150",
                                     f"checkpoint.persist_every={PERSIST_EVERY}"),
        "--run-dir", "run", "--auto-resume"]
NO_HANG_DETECTION = sets("failure.hang_timeout_floor_s=300", "failure.hang_factor=1000",
                         "failure.stopped_timeout_s=300")


def _start(cwd: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([STALWART, "run", *ARGS, *extra], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _end(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    finally:
        proc.kill()


def _committed(run: Path) -> list[int]:
    return [step for step, done in list_step_dirs(str(run / "checkpoints")) if done]


def _events(run: Path, kind: str) -> list[dict]:
    return [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == kind]


def _rows(run: Path) -> int:
    return len(read_jsonl(run / "metrics.jsonl"))


def _wait_for_more_rows(run: Path, before: int, n: int, proc: subprocess.Popen) -> None:
    """A resumed run logs steps the run dir's metrics already hold: count rows, not steps."""
    deadline = time.monotonic() + 180
    while _rows(run) < before + n:
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not go on"
        time.sleep(0.05)


def test_sigterm_checkpoints_the_step_in_flight_then_auto_resume_finishes(tmp_path):
    run = tmp_path / "run"

    # A new run dir: --auto-resume starts the run. SIGTERM mid-way: a stop at the step in
    # flight, checkpointed although it is no persist_every step.
    proc = _start(tmp_path)
    try:
        wait_for_step(run / "metrics.jsonl", PERSIST_EVERY + 5, proc)
        proc.send_signal(signal.SIGTERM)
    finally:
        out, err = _end(proc)
    assert proc.returncode == 143, f"expected 143 (stopped by SIGTERM)\n{out}\n{err}"
    assert "holds no run yet; starting a new one" in out
    assert out.splitlines()[-1] == ("  continue: stalwart run run/config.toml --run-dir run "
                                    "--auto-resume")
    [stopped] = _events(run, "stopped")
    stop_step = stopped["step"]
    assert PERSIST_EVERY < stop_step < 146 and stop_step % PERSIST_EVERY != 0
    # Kept (keep_last = 2): the stop's checkpoint and the newest persist_every one before it.
    # The stop lands a few steps after the signal; on a loaded machine, dozens.
    persisted = stop_step // PERSIST_EVERY * PERSIST_EVERY
    assert _committed(run) == [persisted, stop_step]
    assert _events(run, "checkpoint_committed")[-1]["step"] == stop_step

    # The step in flight cannot complete (rank 1 frozen): a second SIGTERM abandons its
    # checkpoint, the driver still exits 143, and the stop's checkpoint stays the newest.
    rows = _rows(run)
    proc = _start(tmp_path, "--inject", f"hang:rank=1,step={stop_step + 4}",
                  *NO_HANG_DETECTION)
    try:
        _wait_for_more_rows(run, rows, 3, proc)
        proc.send_signal(signal.SIGTERM)
        time.sleep(2)  # handled by now: two signals at once would arrive as one
        proc.send_signal(signal.SIGTERM)
    finally:
        out, err = _end(proc)
    assert proc.returncode == 143, f"expected 143 (abandoned stop)\n{out}\n{err}"
    assert "SIGTERM during the stop; abandoned the checkpoint" in err
    assert [e["from_step"] for e in _events(run, "resumed")] == [stop_step]
    assert len(_events(run, "stopped")) == 1  # only the first run's
    assert "StopAbandoned" in _events(run, "interrupted")[-1]["reason"]
    assert _committed(run) == [persisted, stop_step]
    # The driver looked on storage once the workers were killed: the log's newest commit is
    # storage's, and the interrupted run's step is not behind it.
    newest = _committed(run)[-1]
    assert _events(run, "checkpoint_committed")[-1]["step"] == newest
    assert _events(run, "interrupted")[-1]["step"] >= newest

    # The same with one SIGTERM: failure.stop_timeout_s ends the stop that cannot complete.
    rows = _rows(run)
    proc = _start(tmp_path, "--inject", f"hang:rank=1,step={stop_step + 4}",
                  *NO_HANG_DETECTION, *sets("failure.stop_timeout_s=3"))
    try:
        _wait_for_more_rows(run, rows, 3, proc)
        proc.send_signal(signal.SIGTERM)
    finally:
        out, err = _end(proc)
    assert proc.returncode == 143, f"expected 143 (stop timed out)\n{out}\n{err}"
    assert "within failure.stop_timeout_s=3s of the SIGTERM" in (
        _events(run, "interrupted")[-1]["reason"])
    assert _committed(run) == [persisted, stop_step]

    # A retried job: the same command continues from the stop's checkpoint to the end.
    done = stalwart("run", *ARGS, cwd=tmp_path)
    assert f"from its checkpoint at step {stop_step}" in done.stdout
    assert [e["from_step"] for e in _events(run, "resumed")] == [stop_step] * 3
    assert read_jsonl(run / "events.jsonl")[-1]["kind"] == "finished"
    assert read_jsonl(run / "events.jsonl")[-1]["step"] == 150
    assert read_jsonl(run / "metrics.jsonl")[-1]["step"] == 150
