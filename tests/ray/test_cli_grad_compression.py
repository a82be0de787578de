"""PowerSGD from the CLI on a local Ray: a killed rank comes back from the in-memory tier with
its own error feedback (each rank's is its own, so its snapshot goes to a peer like a shard),
and the run ends bit-identical to one never killed; each step reports its gradient bytes."""

from __future__ import annotations

import pytest

from stalwart.core.events import read_jsonl
from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart_here
from tests.ray.helpers import assert_same_weights, only

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("local_ray")]

POWERSGD = [*TINY, "train.steps=20", "checkpoint.persist_every=10", "checkpoint.keep_last=0",
            "run.log_every=1", "data.val_every=0", "parallel.dp_replicate=2",
            "parallel.dp_shard=1", "parallel.grad_compression=powersgd",
            "parallel.powersgd_start_step=5", "parallel.powersgd_rank=4",
            "failure.max_failures=1"]


def test_a_killed_powersgd_rank_is_restored_from_memory_exactly(tmp_path):
    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*POWERSGD), "--run-dir", "straight",
                  cwd=tmp_path)
    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*POWERSGD), "--inject",
                  "kill:rank=1,step=13", "--run-dir", "killed", cwd=tmp_path)
    recovered = only(read_jsonl(tmp_path / "killed" / "events.jsonl"), "recovered")
    assert (recovered["source"], recovered["from_step"], recovered["lost_steps"]) == (
        "memory", 12, 0)
    assert_same_weights(tmp_path, tmp_path / "straight", tmp_path / "killed")
    rows = read_jsonl(tmp_path / "straight" / "metrics.jsonl")
    sent = {r["step"]: r["grad_bytes"] for r in rows}
    # Plain all-reduce before the start step, the low-rank factors from it on.
    assert sent[1] == sent[5] > 4 * sent[6] and sent[6] == sent[20]
