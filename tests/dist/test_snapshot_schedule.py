"""An auto snapshot schedule on real gloo ranks: with one rank's link throttled, every rank
snapshots the same steps (each exchange's all-reduce gives them the same figures), the
interval grows until the exchange hides behind the steps, a stop between planned snapshots
meets every rank before it stages, and each rank ends holding its peer's snapshot of the
step before the newest."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from stalwart.checkpointing.memory.tier import MemoryTier
from stalwart.checkpointing.snapshot_schedule import AUTO, SnapshotSchedule
from tests.dist.toy_state import Toy

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

STEPS, STOP_AT = 40, 37
STEP_S = 0.02
ELEMENTS = 64 * 1024  # 256 KiB of float32 per rank
# Rank 1 sends at 12 Mbit/s: 256 KiB then take about 0.17 s, eight or nine steps.
THROTTLED, MBPS = 1, 12.0


class Link:
    """The hooks of a snapshot, with a slow link on the throttled rank (the fault injector's
    `slow-link` does the same)."""

    def __init__(self, rank: int) -> None:
        self.bytes_per_s = MBPS * 1e6 / 8 if rank == THROTTLED else 0.0

    def mid_copy(self, step: int) -> None:
        pass

    def before_payload(self, step: int) -> None:
        pass

    def sending(self, step: int, nbytes: int) -> None:
        if self.bytes_per_s:
            time.sleep(nbytes / self.bytes_per_s)


def train(rank: int, world: int) -> dict:
    toy, tier, hooks = Toy(rank, ELEMENTS), MemoryTier(), Link(rank)
    schedule = SnapshotSchedule(AUTO, persist_every=STEPS, last_step=STEPS, budget=0.05,
                                share=1.0)
    tier.join(toy.view(), rank=rank, generation=0, nodes=["n0", "n1"], replicas=1,
              limit_gb=1.0, schedule=schedule)
    taken, changes = [], []
    summary = torch.zeros(1)
    for step in range(1, STEPS + 1):
        started = time.perf_counter()
        time.sleep(STEP_S)  # forward and backward
        tier.wait_copy_done()
        tier.wait_replicated()
        dist.all_reduce(summary)  # the step's summary
        for t in toy.tensors.values():
            t.add_(1)
        toy.step = step
        due = tier.due(step, time.perf_counter() - started)
        if due or step == STOP_AT:  # a stop, as the worker snapshots it
            tier.snapshot(step, hooks=hooks)
            taken.append(step)
        changes += [(d.step, d.previous, d.interval) for d in tier.schedule_report().changes]
    tier.replicator.wait()
    tier.replicator.barrier()
    held = sorted((h.source, h.step) for h in tier.inventory().holdings)
    tier.leave()
    return {"taken": taken, "changes": changes, "held": held}


def test_ranks_snapshot_the_same_steps_and_a_slow_link_grows_the_interval() -> None:
    from tests.dist.launcher import run_ranks

    results = run_ranks(train, 2)
    taken, changes = results[0]["taken"], results[0]["changes"]
    assert results[1]["taken"] == taken and results[1]["changes"] == changes
    assert changes and changes[0][1] == 1 and max(new for _, _, new in changes) >= 5, changes
    assert STOP_AT in taken and taken[-1] == STEPS
    # Each rank keeps two snapshots of its own and two of its peer's: the last two steps.
    for rank, result in enumerate(results):
        peer = 1 - rank
        assert result["held"] == sorted([(rank, s) for s in taken[-2:]]
                                        + [(peer, s) for s in taken[-2:]])
