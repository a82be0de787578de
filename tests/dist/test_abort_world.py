"""Leaving a failed world on two real gloo ranks (the CPU stand-in for NCCL): the flight
recorder names the collective a rank waits in and the rank that never joined it; the abort
covers every group of the world (the default group, DeviceMesh's, a checkpoint writer's and
a memory tier's, each a subgroup of its own), with torch's private abort of every group or,
without it, group by group; and the next world is a new one.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from stalwart.parallel.distributed import (
    abort_process_groups,
    registered_groups,
    shorten_timeouts,
)
from stalwart.parallel.nccl import summarise_flight_record, take_flight_record
from tests.dist.launcher import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120)]


def _wait_for(path: Path) -> None:
    deadline = time.monotonic() + 60
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


def _rank(rank: int, world_size: int, signals: str, private_abort: bool) -> dict:
    if not private_abort:  # a torch without its private abort of every group
        delattr(dist.distributed_c10d, "_abort_process_group")
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))
    writer = dist.new_group(backend="gloo")  # as the checkpoint writer makes its own
    tier = dist.new_group(backend="gloo")  # and the memory tier its replication group
    del mesh
    names = sorted(str(dist.distributed_c10d._world.pg_names[g]) for g in registered_groups())
    dist.all_reduce(torch.ones(4), group=writer)
    recorded = Path(signals, "recorded")
    if rank == 0:  # waits in the tier's collective, which rank 1 joins only later
        work = dist.all_reduce(torch.ones(4), group=tier, async_op=True)
        time.sleep(0.3)
        summary = summarise_flight_record(take_flight_record(), rank, time.time_ns())
        recorded.touch()
        work.wait()
    else:
        _wait_for(recorded)
        summary = summarise_flight_record(take_flight_record(), rank, time.time_ns())
        dist.all_reduce(torch.ones(4), group=tier)  # now it comes: rank 0's work ends
    shorten_timeouts(5.0)
    aborted = sorted(abort_process_groups())
    left = registered_groups()
    # The next world forms afresh through its own store: new groups, nothing of the last.
    dist.init_process_group("gloo", init_method=f"file://{signals}/next-store", rank=rank,
                            world_size=world_size)
    total = torch.ones(1)
    dist.all_reduce(total)
    return {"names": names, "summary": summary, "aborted": aborted, "left": len(left),
            "next": total.item(), "next_groups": len(registered_groups())}


@pytest.mark.parametrize("private_abort", [True, False], ids=["torch's abort", "each group"])
def test_the_abort_covers_every_group_and_the_record_names_the_stall(tmp_path, private_abort):
    first, second = run_ranks(_rank, 2, str(tmp_path), private_abort)
    # The default group, the mesh's dimension of size 1, the writer's and the tier's.
    assert len(first["names"]) == 4
    for rank in (first, second):
        assert rank["aborted"] == rank["names"]
        assert rank["left"] == 0
        assert rank["next"] == 2.0 and rank["next_groups"] == 1
    tier = first["names"][-1]
    assert first["summary"].startswith(
        f"rank 0: gloo:all_reduce #1 of group {tier} (undefined) never completed")
    assert second["summary"].startswith(
        "rank 1: in no collective; the last it completed is gloo:all_reduce #1 of group")
