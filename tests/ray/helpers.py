"""What the fault-tolerance tests share: a short elastic run, waiting for events, and the
samples a run's final weights were trained on."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from stalwart.run_dir import read_jsonl
from tests.cli_helpers import TINY

# 60 tiny steps, a checkpoint every 10, a metrics row every step, gradients summed in one
# order for any world size (so a resized run can be compared bit for bit).
ELASTIC = [*TINY, "train.steps=60", "checkpoint.persist_every=10", "checkpoint.keep_last=0",
           "run.log_every=1", "data.val_every=0", "parallel.dp_replicate=-1",
           "parallel.dp_shard=1", "parallel.invariant_reduction=true",
           "failure.hang_timeout_floor_s=3", "scaling.spare_workers=0"]


def wait_for_event(events: Path, kind: str, proc: subprocess.Popen,
                   timeout: float = 180) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in read_jsonl(events) if e["kind"] == kind] if events.exists() else []
        if found:
            return found[0]
        if proc.poll() is not None:
            raise AssertionError(f"the run ended before a {kind} event:\n"
                                 f"{proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.1)
    raise AssertionError(f"no {kind} event within {timeout}s")


def consumed_samples(run_dir: Path) -> set[int]:
    """Global sample indices the final weights were trained on: the last record of each step.

    A step trained again after a restore replaces the record of the lost one (the sample
    order is a function of the global index, so the indices name the samples exactly).
    """
    rows = read_jsonl(run_dir / "metrics.jsonl")
    last = {r["step"]: r for r in rows}
    out: set[int] = set()
    for step, row in last.items():
        batch = row["samples_seen"] // step  # the global batch is constant
        out.update(range(row["samples_seen"] - batch, row["samples_seen"]))
    assert len(out) == max(last) * (rows[-1]["samples_seen"] // rows[-1]["step"]), \
        "a sample was trained twice or skipped"
    return out
