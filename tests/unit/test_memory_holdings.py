"""The in-memory checkpoint tier's bookkeeping, in one process and with hand-made layouts:
where replicas go (holders_for, exchanges), what a worker's store keeps, how the shards'
chunks merge into DCP metadata, and which step the driver picks from the workers'
inventories (newest_complete). The staging of a real engine is in test_memory_tier.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from stalwart.checkpointing.memory.catalog import MemoryChoice, newest_complete
from stalwart.checkpointing.memory.reader import build_metadata
from stalwart.checkpointing.memory.replication import exchanges, holders_for
from stalwart.checkpointing.memory.store import KEEP, Holding, Inventory, MemoryStore
from stalwart.checkpointing.snapshot import Shard, ShardLayout
from stalwart.parallel.dims import ParallelDims

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# ---------------------------------------------------------------------------- holders_for


def _node_of(nodes: list[str]) -> Callable[[int], str]:
    return lambda rank: nodes[rank]


def test_holders_on_one_node_form_a_ring_over_processes() -> None:
    assert holders_for(["a"] * 4, 1) == {0: [1], 1: [2], 2: [3], 3: [0]}


def test_holders_on_two_nodes_are_on_the_other_node() -> None:
    nodes = ["a", "a", "b", "b"]
    holders = holders_for(nodes, 1)
    assert holders == {0: [2], 1: [3], 2: [0], 3: [1]}
    node = _node_of(nodes)
    assert all(node(h) != node(r) for r, hs in holders.items() for h in hs)
    # Each rank holds exactly one peer's shard: the replicas are spread evenly.
    held = sorted(h for hs in holders.values() for h in hs)
    assert held == [0, 1, 2, 3]


def test_holders_on_uneven_nodes_are_on_other_nodes() -> None:
    nodes = ["a", "a", "b", "c"]
    holders = holders_for(nodes, 1)
    # a -> b -> c -> a; both ranks on a land on b's only rank.
    assert holders == {0: [2], 1: [2], 2: [3], 3: [0]}
    node = _node_of(nodes)
    assert all(node(h) != node(r) for r, hs in holders.items() for h in hs)


def test_two_replicas_over_three_nodes_go_to_two_distinct_other_nodes() -> None:
    nodes = ["a", "a", "b", "b", "c", "c"]
    holders = holders_for(nodes, 2)
    assert holders == {0: [2, 4], 1: [3, 5], 2: [4, 0], 3: [5, 1], 4: [0, 2], 5: [1, 3]}
    node = _node_of(nodes)
    for rank, hs in holders.items():
        # Losing any two nodes leaves a copy: the rank's own node and its two holders' are
        # the three nodes.
        assert sorted({node(rank), *map(node, hs)}) == ["a", "b", "c"]


@pytest.mark.parametrize(("nodes", "replicas", "expected"), [
    # Two nodes, three replicas: the other node first, then the next ranks on the ring.
    (["a", "a", "b", "b"], 3, {0: [2, 1, 3], 1: [3, 2, 0], 2: [0, 3, 1], 3: [1, 0, 2]}),
    # One node: only other processes, never the rank itself.
    (["a", "a", "a"], 2, {0: [1, 2], 1: [2, 0], 2: [0, 1]}),
    # More replicas than other ranks: every other rank once, and no more.
    (["a", "b", "c"], 5, {0: [1, 2], 1: [2, 0], 2: [0, 1]}),
    (["a"], 1, {0: []}),
])
def test_more_replicas_than_other_nodes_fall_back_to_other_processes(
        nodes: list[str], replicas: int, expected: dict[int, list[int]]) -> None:
    holders = holders_for(nodes, replicas)
    assert holders == expected
    for rank, hs in holders.items():
        assert rank not in hs and len(set(hs)) == len(hs)


def test_zero_replicas_means_no_holders() -> None:
    assert holders_for(["a", "a", "b", "b"], 0) == {0: [], 1: [], 2: [], 3: []}


# ---------------------------------------------------------------------------- hand-made layouts


def _chunk(fqn: str, offset: int, size: int, total: int) -> WriteItem:
    """A WriteItem for elements [offset, offset + size) of a 1-D float tensor of `total`."""
    return WriteItem(
        index=MetadataIndex(fqn, [offset]), type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size([offset]), sizes=torch.Size([size])),
            properties=TensorProperties(dtype=torch.float32), size=torch.Size([total])))


def _value(fqn: str) -> WriteItem:
    return WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO)


def _layout(key: str, *items: WriteItem) -> ShardLayout:
    # Only the items matter to the catalog and to build_metadata; the store only reads key.
    return ShardLayout(items=items, slots={}, planner_data={}, nbytes=0, key=key)


# "w" of 4 elements split over two source ranks (FSDP-style), plus one value on each.
SHARD0 = _layout("shard0", _chunk("w", 0, 2, 4), _value("train.step"))
SHARD1 = _layout("shard1", _chunk("w", 2, 2, 4), _value("train.step"))
# Data parallelism: every source holds all of "w".
REPLICA = _layout("replica", _chunk("w", 0, 4, 4), _value("train.step"))


# ---------------------------------------------------------------------------- MemoryStore


def _shard(step: int, nbytes: int = 8, layout: ShardLayout = SHARD0) -> Shard:
    return Shard(step=step, layout=layout, buffer=torch.zeros(nbytes, dtype=torch.uint8), crc=0)


def _steps(store: MemoryStore, generation: int, source: int) -> list[int]:
    return [h.step for h in store.inventory().holdings
            if (h.generation, h.source) == (generation, source)]


def test_store_keeps_the_two_newest_steps_per_generation_and_source() -> None:
    assert KEEP == 2
    store = MemoryStore()
    for step in (1, 2, 3):
        store.put(0, 0, _shard(step))
    store.put(0, 1, _shard(1))
    store.put(1, 0, _shard(7))
    assert _steps(store, 0, 0) == [2, 3]
    assert store.get(0, 0, 1) is None and store.get(0, 0, 3).step == 3
    # Other sources and generations are kept apart.
    assert _steps(store, 0, 1) == [1] and _steps(store, 1, 0) == [7]
    # Out of order: the two newest win whatever the order of arrival.
    store.put(0, 0, _shard(5))
    store.put(0, 0, _shard(4))
    assert _steps(store, 0, 0) == [4, 5]
    store.put(0, 0, _shard(1))
    assert _steps(store, 0, 0) == [4, 5]


def test_store_replaces_a_step_put_again_and_a_reused_buffer() -> None:
    store = MemoryStore()
    first, second = _shard(1), _shard(2)
    store.put(0, 0, first)
    store.put(0, 0, second)
    again = _shard(2)
    store.put(0, 0, again)
    assert _steps(store, 0, 0) == [1, 2] and store.get(0, 0, 2) is again
    # A new step written into step 1's buffer: step 1 is gone, not listed twice.
    reused = Shard(step=3, layout=SHARD0, buffer=first.buffer, crc=0)
    store.put(0, 0, reused)
    assert _steps(store, 0, 0) == [2, 3] and store.get(0, 0, 3) is reused


def test_forget_buffer_drops_the_shard_in_that_buffer() -> None:
    store = MemoryStore()
    old, new = _shard(1), _shard(2)
    store.put(0, 0, old)
    store.put(0, 0, new)
    other = _shard(1)
    store.put(0, 1, other)
    store.forget_buffer(old.buffer)
    assert _steps(store, 0, 0) == [2] and _steps(store, 0, 1) == [1]
    # An equal but distinct tensor is not the buffer: identity, not value.
    store.forget_buffer(torch.zeros(8, dtype=torch.uint8))
    assert _steps(store, 0, 0) == [2] and _steps(store, 0, 1) == [1]


def test_reusable_buffer_is_the_oldest_of_two_with_the_same_size() -> None:
    store = MemoryStore()
    oldest = _shard(1, nbytes=16)
    store.put(0, 0, oldest)
    # One held: it is the newest complete snapshot, never handed out.
    assert store.reusable_buffer(0, 0, 16) is None
    store.put(0, 0, _shard(2, nbytes=16))
    # A different size (the layout changed): a new buffer is needed, nothing is forgotten.
    assert store.reusable_buffer(0, 0, 32) is None
    assert _steps(store, 0, 0) == [1, 2]
    assert store.reusable_buffer(1, 0, 16) is None  # nothing held for that generation
    assert store.reusable_buffer(0, 0, 16) is oldest.buffer
    # It is forgotten before it is written to: the store never lists a half-received step.
    assert _steps(store, 0, 0) == [2] and store.get(0, 0, 1) is None


def test_drop_before_drops_older_generations() -> None:
    store = MemoryStore()
    for gen in (0, 1, 2):
        store.put(gen, 0, _shard(gen + 10))
    store.drop_before(1)
    assert [(h.generation, h.step) for h in store.inventory().holdings] == [(1, 11), (2, 12)]
    store.clear()
    assert store.inventory().holdings == () and store.nbytes() == 0


def test_inventory_lists_holdings_and_layouts() -> None:
    store = MemoryStore()
    store.put(1, 0, _shard(5, nbytes=8, layout=SHARD0))
    store.put(0, 1, _shard(3, nbytes=16, layout=SHARD1))
    store.put(0, 1, _shard(4, nbytes=16, layout=SHARD1))
    inv = store.inventory()
    # Sorted by (generation, source), then step.
    assert inv.holdings == (Holding(0, 1, 3, "shard1"), Holding(0, 1, 4, "shard1"),
                            Holding(1, 0, 5, "shard0"))
    assert inv.layouts == {"shard0": SHARD0, "shard1": SHARD1}
    assert inv.nbytes == 8 + 16 + 16


def test_nbytes_counts_a_shared_buffer_once() -> None:
    store = MemoryStore()
    staged, held = _shard(1, nbytes=100), _shard(1, nbytes=30)
    store.put(0, 0, staged)  # this rank's own snapshot, in the stager's buffer
    store.put(0, 1, held)  # a peer's replica
    spare = torch.zeros(100, dtype=torch.uint8)  # the stager's other buffer, empty so far
    assert store.nbytes() == 130
    assert store.nbytes([staged.buffer, spare]) == 230
    assert store.nbytes([staged.buffer, staged.buffer]) == 130


# ---------------------------------------------------------------------------- MemoryReader metadata


def test_build_metadata_merges_chunks_and_lists_their_sources() -> None:
    sharded = build_metadata({1: SHARD1, 0: SHARD0})
    w = sharded.state_dict_metadata["w"]
    assert isinstance(w, TensorStorageMetadata) and w.size == torch.Size([4])
    assert [(tuple(c.offsets), tuple(c.sizes)) for c in w.chunks] == [((0,), (2,)), ((2,), (2,))]
    assert sharded.storage_data == {MetadataIndex("w", [0]): [0], MetadataIndex("w", [2]): [1],
                                    MetadataIndex("train.step"): [0, 1]}
    replicated = build_metadata({0: REPLICA, 1: REPLICA, 2: REPLICA})
    assert len(replicated.state_dict_metadata["w"].chunks) == 1
    assert replicated.storage_data == {MetadataIndex("w", [0]): [0, 1, 2],
                                       MetadataIndex("train.step"): [0, 1, 2]}


# ---------------------------------------------------------------------------- newest_complete


def _inventory(*held: tuple[int, int, int, ShardLayout]) -> Inventory:
    """A worker's inventory from (generation, source, step, layout) tuples."""
    return Inventory(holdings=tuple(Holding(g, src, step, lay.key) for g, src, step, lay in held),
                     layouts={lay.key: lay for *_, lay in held}, nbytes=0)


def test_newest_complete_step_across_two_workers() -> None:
    choice, reason = newest_complete({
        "A": _inventory((0, 0, 4, SHARD0), (0, 0, 5, SHARD0)),
        "B": _inventory((0, 1, 4, SHARD1)),
    })
    assert choice == MemoryChoice(generation=0, step=4, layouts={0: SHARD0, 1: SHARD1},
                                  holders={0: ["A"], 1: ["B"]})
    # Why not the newer step 5: source 1's half of "w" is nowhere at that step.
    assert reason == ("step 5 is not complete in memory (held for source ranks [0]; no live "
                      "copy of w)")


def test_a_replica_held_elsewhere_completes_the_step() -> None:
    choice, _ = newest_complete({
        "A": _inventory((0, 0, 4, SHARD0), (0, 0, 5, SHARD0), (0, 1, 4, SHARD1)),
        "B": _inventory(),
    })
    assert choice is not None and (choice.generation, choice.step) == (0, 4)
    assert choice.holders == {0: ["A"], 1: ["A"]}
    # Both holding it: both listed, in order.
    choice, _ = newest_complete({
        "B": _inventory((0, 1, 4, SHARD1)),
        "A": _inventory((0, 0, 4, SHARD0), (0, 1, 4, SHARD1)),
    })
    assert choice is not None and choice.holders == {0: ["A"], 1: ["A", "B"]}


def test_a_source_held_by_nobody_leaves_no_complete_step() -> None:
    # Source 1 is held nowhere at any step, but source 0's layout says "w" has 4 elements.
    choice, reason = newest_complete({
        "A": _inventory((0, 0, 4, SHARD0), (0, 0, 5, SHARD0)),
        "B": _inventory(),
    })
    assert choice is None
    assert reason == ("step 5 is not complete in memory (held for source ranks [0]; no live "
                      "copy of w)")


def test_the_reason_lists_three_missing_names_and_counts_the_rest() -> None:
    names = ["a", "b", "c", "d", "e"]
    half = _layout("half", *(_chunk(n, 0, 1, 2) for n in names))
    choice, reason = newest_complete({"A": _inventory((0, 0, 9, half))})
    assert choice is None
    assert reason == ("step 9 is not complete in memory (held for source ranks [0]; no live "
                      "copy of a, b, c and 2 more)")


def test_a_pipeline_stage_held_by_nobody_leaves_no_complete_step() -> None:
    # parallel.pp = 3, one stage per rank: each source owns tensors no other source has.
    stages = [_layout(f"stage{i}", _chunk(f"layers.{i}.w", 0, 4, 4), _value("train.step"))
              for i in range(3)]
    # Source 1's node and its holder's node are lost; A holds source 0 and 2's replica.
    held = _inventory((0, 0, 3, stages[0]), (0, 2, 3, stages[2]))
    # Without the names the world shared when it formed, the lost stage cannot be seen...
    assert newest_complete({"A": held})[0] is not None
    # ...with them (what every worker's store has after its first snapshot), it is.
    names = frozenset(["layers.0.w", "layers.1.w", "layers.2.w", "train.step"])
    choice, reason = newest_complete({"A": dataclasses.replace(held, names={0: names})})
    assert choice is None
    assert reason == ("step 3 is not complete in memory (held for source ranks [0, 2]; no "
                      "live copy of layers.1.w)")


def test_one_data_parallel_replica_is_complete() -> None:
    choice, reason = newest_complete({
        "A": _inventory((0, 1, 6, REPLICA)),
        "B": _inventory(),
    })
    assert choice == MemoryChoice(generation=0, step=6, layouts={1: REPLICA},
                                  holders={1: ["A"]})
    assert reason == ""


def test_a_missing_value_makes_a_step_incomplete() -> None:
    no_value = _layout("no_value", _chunk("w", 0, 4, 4))
    choice, reason = newest_complete({
        "A": _inventory((0, 0, 6, no_value), (0, 1, 5, REPLICA)),
    })
    assert choice is not None and choice.step == 5
    assert reason == ("step 6 is not complete in memory (held for source ranks [0]; no live "
                      "copy of train.step)")


def test_the_newer_generation_wins_a_tie_on_the_step() -> None:
    choice, _ = newest_complete({
        "A": _inventory((0, 0, 7, REPLICA), (1, 0, 7, REPLICA)),
        "B": _inventory((0, 1, 7, REPLICA)),
    })
    assert choice is not None and (choice.generation, choice.step) == (1, 7)
    assert choice.holders == {0: ["A"]}
    # A newer step of an older generation still wins over the step.
    choice, _ = newest_complete({"A": _inventory((0, 0, 8, REPLICA), (1, 0, 7, REPLICA))})
    assert choice is not None and (choice.generation, choice.step) == (0, 8)


def test_no_inventories_hold_nothing() -> None:
    assert newest_complete({}) == (None, "no snapshot is held in memory")
    assert newest_complete({"A": _inventory(), "B": _inventory()}) == (
        None, "no snapshot is held in memory")


# ---------------------------------------------------------------------------- data-parallel twins


def test_replica_class_names_data_parallel_twins() -> None:
    # pp=2 x dp_replicate=2 x dp_shard=2 x tp=1: ranks 0 and 2 are replicas (same shard, same
    # stage), 4 and 6 are too but of the other stage.
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=1, pp=2)
    classes = [dims.replica_class(r) for r in range(8)]
    assert classes == [(0, 0, 0, 0), (0, 1, 0, 0), (0, 0, 0, 0), (0, 1, 0, 0),
                       (1, 0, 0, 0), (1, 1, 0, 0), (1, 0, 0, 0), (1, 1, 0, 0)]
    tp = ParallelDims(dp_replicate=2, dp_shard=1, tp=2)
    assert [tp.replica_class(r) for r in range(4)] == [(0, 0, 0, 0), (0, 0, 0, 1),
                                                      (0, 0, 0, 0), (0, 0, 0, 1)]
    # Context-parallel peers hold other shards (FSDP2 shards over dp_shard x cp): never twins.
    cp = ParallelDims(dp_replicate=2, dp_shard=1, tp=1, cp=2)
    assert [cp.replica_class(r) for r in range(4)] == [(0, 0, 0, 0), (0, 0, 1, 0),
                                                      (0, 0, 0, 0), (0, 0, 1, 0)]


def test_nothing_is_sent_to_a_data_parallel_twin() -> None:
    # DDP over two nodes: every rank's holder is its twin, which holds the same snapshot.
    holders = holders_for(["a", "b"], 1)
    assert [exchanges(r, holders, [(0, 0, 0)] * 2) for r in range(2)] == [([], []), ([], [])]
    # HSDP 2x2 over two nodes: the ring pairs each shard with its replica on the other node.
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=1)
    holders = holders_for(["a", "a", "b", "b"], 1)
    classes = [dims.replica_class(r) for r in range(4)]
    assert [exchanges(r, holders, classes) for r in range(4)] == [([], [])] * 4
    # FSDP over 4 ranks on one node: every shard is distinct, all are sent.
    holders = holders_for(["a"] * 4, 1)
    fsdp = ParallelDims(dp_replicate=1, dp_shard=4, tp=1)
    assert [exchanges(r, holders, [fsdp.replica_class(q) for q in range(4)])
            for r in range(4)] == [([1], [3]), ([2], [0]), ([3], [1]), ([0], [2])]
    assert exchanges(0, holders) == ([1], [3])  # no classes: everything is sent
