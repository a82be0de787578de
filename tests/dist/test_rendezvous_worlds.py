"""Worlds formed through the rendezvous that their rank 0 hosts, and formed again: each
generation has a new rank 0 (a survivor that changes rank), which hosts a new store; the
last one's store is gone once its world is left, and no process gains descriptors.

The processes are started here, not by the launcher: the launcher forms its world through
torch's own rendezvous, and these tests are about stalwart's. They come from the
launcher's fork server all the same, with torch imported once.
"""

from __future__ import annotations

import json
import os
import pickle
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from stalwart.parallel.distributed import (
    RendezvousAddress,
    RendezvousHost,
    abort_process_groups,
    destroy_process_group,
    init_process_group,
)
from tests.dist.launcher import start_forked
from tests.unit.test_rendezvous import listening_on, open_fds

pytestmark = [pytest.mark.dist, pytest.mark.timeout(180)]

GENERATIONS = 3
TIMEOUT_S = 60.0


def publish(out_dir: str, generation: int, rdzv: RendezvousAddress) -> None:
    """What the controller does between rank 0's actor and the others: pass the address on."""
    tmp = Path(out_dir, f"rdzv-{generation}.tmp")
    tmp.write_text(json.dumps({"host": rdzv.host, "port": rdzv.port}))
    tmp.rename(Path(out_dir, f"rdzv-{generation}.json"))


def published(out_dir: str, generation: int) -> RendezvousAddress:
    path = Path(out_dir, f"rdzv-{generation}.json")
    deadline = time.monotonic() + TIMEOUT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no rendezvous published for generation {generation}")
        time.sleep(0.05)
    return RendezvousAddress(**json.loads(path.read_text()))


def worlds(process: int, world: int, out_dir: str) -> list[dict[str, Any]]:
    """Join GENERATIONS worlds in turn, as rank (process + generation) % world.

    Returns a row per world, and the descriptors open before the first one.
    """
    # The first store a process hosts sets up libuv's process-wide state (a pipe) for good.
    RendezvousHost("127.0.0.1", timeout_s=TIMEOUT_S).close()
    before = open_fds()
    rows = []
    for generation in range(GENERATIONS):
        rank = (process + generation) % world
        host = None
        if rank == 0:
            host = RendezvousHost("127.0.0.1", timeout_s=TIMEOUT_S)
            publish(out_dir, generation, host.address)
        rdzv = published(out_dir, generation)
        init_process_group(rdzv, rank=rank, world_size=world, device=torch.device("cpu"),
                           timeout_s=TIMEOUT_S, host=host)
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        held = listening_on(rdzv.port)  # while in the world
        dist.barrier()
        # Leave as a survivor does: after a failure by aborting first, else by destroying.
        if generation % 2:
            abort_process_groups()
        destroy_process_group()
        rows.append({"generation": generation, "rank": rank, "sum": total.item(),
                     "held": held, "after": listening_on(rdzv.port), "fds": open_fds()})
    return rows, before


def _entry(process: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        result: Any = ("ok", worlds(process, world, out_dir))
    except BaseException:
        result = ("error", traceback.format_exc())
    Path(out_dir, f"{process}.pkl").write_bytes(pickle.dumps(result))


@pytest.mark.parametrize("world", [2, 3])
def test_worlds_form_at_rank_0s_store_and_form_again(world, tmp_path):
    start_forked(_entry, (world, str(tmp_path)), world)
    for process in range(world):
        status, result = pickle.loads(Path(tmp_path, f"{process}.pkl").read_bytes())
        assert status == "ok", f"process {process} failed:\n{result}"
        rows, fds_before = result
        assert [r["sum"] for r in rows] == [world * (world + 1) / 2] * GENERATIONS
        for row in rows:
            port = published(str(tmp_path), row["generation"]).port
            # Rank 0 serves the store on the address it was given, nobody else listens there,
            # and once the world is left the port is free.
            assert row["held"] == ({("127.0.0.1", port)} if row["rank"] == 0 else set()), row
            assert row["after"] == set(), row
        # Forming and leaving worlds, as any rank, leaves no descriptor behind.
        assert [r["fds"] for r in rows] == [fds_before] * GENERATIONS


os.environ.setdefault("OMP_NUM_THREADS", "1")

