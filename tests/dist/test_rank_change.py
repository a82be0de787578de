"""A survivor keeps its process across worlds, but its rank may change (rank 1 of the last
world is rank 0 of this one): the shard it trains and checkpoints must be its new rank's.

DTensor caches sharding decisions by input spec, and a DeviceMesh compares equal to any mesh
of the same shape, so without care the new world's parameters come back with the last
world's mesh (its coordinate): both ranks then train and save the same half of the model.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from stalwart.parallel.distributed import (
    RendezvousHost,
    abort_process_groups,
    forget_dtensor_caches,
    init_process_group,
)
from tests.dist.launcher import run_ranks
from tests.dist.test_checkpoint_reshard import make_engine
from tests.dist.test_data_parallel import cache_dir  # noqa: F401 (fixture)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def offsets_in_two_worlds(rank, world, cache):
    """Shard offsets of the first parameter: in the launcher's world, then with ranks swapped."""
    out = []
    for generation in range(2):
        if generation == 1:  # leave as a survivor does, join the next world as the other rank
            rank = world - 1 - rank
            # The next rank 0 hosts the next rendezvous; its address goes round the old world.
            host = RendezvousHost("127.0.0.1", timeout_s=60) if rank == 0 else None
            rdzv = [host.address if host else None]
            dist.broadcast_object_list(rdzv, src=world - 1)
            abort_process_groups()
            init_process_group(rdzv[0], rank=rank, world_size=world,
                               device=torch.device("cpu"), timeout_s=60, host=host)
        forget_dtensor_caches()
        engine = make_engine(rank, world, cache, ["parallel.dp_shard=2"])
        param = next(engine.model.parameters())
        _, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                          param.placements)
        out.append((dist.get_rank(), tuple(offset), param.device_mesh.get_coordinate()))
    return out


def test_a_process_that_changes_rank_shards_by_its_new_rank(cache_dir):  # noqa: F811
    results = run_ranks(offsets_in_two_worlds, 2, cache_dir)
    rows = sorted(r for worlds in results for r in worlds)
    # Every world has rank 0 at offset 0 and rank 1 at the other half, whichever process.
    assert [(rank, offset[0] > 0, coord) for rank, offset, coord in rows] == [
        (0, False, (0,)), (0, False, (0,)), (1, True, (1,)), (1, True, (1,))]
