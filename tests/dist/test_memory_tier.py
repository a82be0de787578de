"""The memory tier on real gloo ranks: snapshots replicated across (pretend) nodes survive the
loss of a node and load, resharded, into a smaller world with the same weights, optimizer
state and data position; losing a shard and its only replica is detected, never loaded."""

from __future__ import annotations

import pytest
import torch

from stalwart.checkpointing.memory.catalog import newest_complete
from stalwart.checkpointing.memory.store import Inventory
from stalwart.checkpointing.memory.tier import MemoryTier
from stalwart.checkpointing.snapshot import Shard
from tests.dist.launcher import run_ranks
from tests.dist.test_checkpoint_reshard import full_weights, make_engine
from tests.dist.test_data_parallel import cache_dir  # noqa: F401 (fixture)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

SNAP_AT, CONTINUE = 4, 3


def train_with_snapshots(rank, world, cache, layout, nodes):
    """Train SNAP_AT steps with a snapshot after each, then continue without: what a run
    that never failed would do. Returns the weights at SNAP_AT, the losses after it, and
    what this rank's tier holds (inventory, and each held shard as a peer would fetch it)."""
    engine = make_engine(rank, world, cache, layout)
    tier = MemoryTier()
    tier.join(engine.tier_view(), rank=rank, generation=0, nodes=nodes, replicas=1,
              limit_gb=1.0)
    for _ in range(SNAP_AT):
        engine.train_step(before_update=tier.wait_copy_done, before_summary=tier.wait_replicated)
        tier.snapshot(engine.step)
    tier.wait_replicated()
    tier.replicator.barrier()  # every exchange complete before anyone reads its store
    weights = full_weights(engine)
    inventory = tier.inventory()
    exported = {(h.source, h.step): tier.export(h.generation, h.source, h.step)
                for h in inventory.holdings}
    losses = [engine.train_step()[0].loss for _ in range(CONTINUE)]
    tier.leave()
    return weights, losses, inventory, exported


def restore_in_new_world(rank, world, cache, layout, choice, held, all_exported):
    """A rank of the next world: its tier holds what survivor `rank` held (`held`); it loads
    the chosen step, fetching what it lacks from the survivors' exports."""
    engine = make_engine(rank, world, cache, layout)
    tier = MemoryTier()
    for (src, step), (array, values, crc) in held.items():
        tier.store.put(0, src, Shard(step=step, layout=choice.layouts[src],
                                     buffer=torch.from_numpy(array), values=values, crc=crc))
    tier.join(engine.tier_view(), rank=rank, generation=1, nodes=[f"n{r}" for r in range(world)],
              replicas=1, limit_gb=1.0)
    fetched = tier.restore(engine.tier_view(), generation=0, step=choice.step,
                           layouts=choice.layouts,
                           fetch=lambda src: all_exported[(src, choice.step)])
    assert engine.step == SNAP_AT and engine.samples_seen == SNAP_AT * 8
    tier.stage_restored(engine.step)  # replicated while the first step runs
    weights = full_weights(engine)
    staged = {h.generation for h in tier.inventory().holdings}
    losses = [engine.train_step(before_update=tier.wait_copy_done,
                                before_summary=tier.wait_replicated)[0].loss]
    tier.drop_older()  # past the first step's all-reduce: every exchange is complete
    generations = staged, {h.generation for h in tier.inventory().holdings}
    losses += [engine.train_step()[0].loss for _ in range(CONTINUE - 1)]
    tier.leave()
    return weights, losses, fetched, generations


def test_a_lost_node_is_restored_from_replicas_into_a_smaller_world(cache_dir):  # noqa: F811
    # 4 ranks, FSDP2 over all of them (every shard distinct), 2 ranks per pretend node.
    nodes = ["n0", "n0", "n1", "n1"]
    saved = run_ranks(train_with_snapshots, 4, cache_dir, ["parallel.dp_shard=4"], nodes)
    # Node n1 (ranks 2 and 3) is lost: only ranks 0 and 1's memory survives.
    survivors = {f"w{r}": saved[r][2] for r in (0, 1)}
    choice, _ = newest_complete(survivors)
    assert choice is not None and choice.step == SNAP_AT
    # Ranks 2 and 3's shards come from their replicas on node n0.
    assert choice.holders == {0: ["w0"], 1: ["w1"], 2: ["w0"], 3: ["w1"]}

    held = [{k: v for k, v in saved[r][3].items()} for r in (0, 1)]
    exported = {k: v for r in (0, 1) for k, v in saved[r][3].items()}
    loaded = run_ranks(_restore_survivor, 2, cache_dir, ["parallel.dp_shard=2"], choice, held,
                       exported)
    expect_weights, expect_losses = saved[0][0], saved[0][1]
    for rank, (weights, losses, fetched, generations) in enumerate(loaded):
        assert weights.keys() == expect_weights.keys()
        for key, value in expect_weights.items():
            assert torch.equal(value, weights[key]), f"{key} differs after the restore"
        # Optimizer state, LR schedule and data position came along too.
        assert losses == pytest.approx(expect_losses, rel=1e-5)
        # New rank 0 needs old shards 0 and 1 and holds 0 (its own) and 2 (a replica): it
        # fetches only 1; new rank 1 needs 2 and 3, holds 1 and 3, fetches only 2.
        assert fetched == [[1], [2]][rank]
        # The restored step is held anew; the old world stays until the first step is done.
        assert generations == ({0, 1}, {1})


def _restore_survivor(rank, world, cache, layout, choice, held, exported):
    return restore_in_new_world(rank, world, cache, layout, choice, held[rank], exported)


def test_losing_a_shard_and_its_only_replica_is_never_loaded(cache_dir):  # noqa: F811
    # One rank per pretend node: rank r's replica is on rank r+1 (a ring over nodes).
    nodes = ["n0", "n1", "n2", "n3"]
    saved = run_ranks(train_with_snapshots, 4, cache_dir, ["parallel.dp_shard=4"], nodes)
    inventories: dict[str, Inventory] = {f"w{r}": saved[r][2] for r in range(4)}
    assert newest_complete(inventories)[0].step == SNAP_AT
    # Every rank learnt the names in every rank's shard when its world formed.
    every_name = {it.index.fqn for inv in inventories.values() for lay in inv.layouts.values()
                  for it in lay.items}
    assert all(inv.names == {0: every_name} for inv in inventories.values())
    # Nodes n1 and n2 are lost at once: rank 1's shard was on n1, its replica on n2.
    choice, reason = newest_complete({k: inventories[k] for k in ("w0", "w3")})
    assert choice is None
    assert reason.startswith(f"step {SNAP_AT} is not complete in memory (held for source "
                             f"ranks [0, 2, 3]; no live copy of ")
