"""The in-memory checkpoint tier, piece by piece, in one process: where replicas go, what a
worker's store keeps, staging a real engine's state, reading it back through DCP (from
memory and from a storage checkpoint written from the snapshot), and which step the
driver picks from the workers' inventories.

No process group: the replication exchange itself is covered by tests/dist/test_memory_tier.py.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from stalwart.checkpointing.memory.catalog import MemoryChoice, newest_complete
from stalwart.checkpointing.memory.reader import MemoryReader, build_metadata
from stalwart.checkpointing.memory.replication import exchanges, holders_for
from stalwart.checkpointing.memory.store import KEEP, Holding, Inventory, MemoryStore
from stalwart.checkpointing.snapshot import Shard, ShardLayout, SnapshotStager, build_layout
from stalwart.checkpointing.snapshot_planner import SnapshotSavePlanner
from stalwart.config import JobConfig, load_config
from stalwart.parallel.dims import ParallelDims
from stalwart.task import TrainTask, build_task
from stalwart.workers.engine import TrainEngine
from stalwart.workers.reports import StepReport

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

REFERENCE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "config.toml"

# A one-layer GPT: a step takes milliseconds on one thread.
TINY = [
    "task.args.seq_len=32", "task.args.d_model=32", "task.args.n_layers=1",
    "task.args.n_heads=2", "train.global_batch_size=4", "train.micro_batch_size=2",
    "train.warmup_steps=2", "train.steps=20", "data.val_batches=1",
]
# Snapshots are staged after this many steps: the optimizer has created its state by then,
# so the layout no longer changes, and the warmup is over, so the LR differs between steps.
STAGED_AT = 2


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
    return Shard(step=step, layout=layout, buffer=torch.zeros(nbytes, dtype=torch.uint8))


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
    reused = Shard(step=3, layout=SHARD0, buffer=first.buffer)
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


# ---------------------------------------------------------------------------- a real engine


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # One intra-op thread: much faster for matrices this small on a busy 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cache = tmp_path_factory.mktemp("data")
    config = load_config(REFERENCE_CONFIG, [*TINY, f"data.cache_dir={cache}"])
    task = build_task(config.task.path, config.task.args)
    task.prepare_data(config)  # tokenizes once for the module
    yield config, task
    torch.set_num_threads(threads)


def _engine(gpt: tuple[JobConfig, TrainTask], steps: int = 0) -> TrainEngine:
    config, task = gpt
    engine = TrainEngine(config, task, rank=0, world_size=1, device=torch.device("cpu"))
    for _ in range(steps):
        engine.train_step()
    return engine


def _stager(engine: TrainEngine) -> SnapshotStager:
    return SnapshotStager(state_dict=engine.state_dict, scalar_state=engine.scalar_state,
                          signature=engine.state_signature, device=engine.device)


def _tensors(engine: TrainEngine) -> dict[str, torch.Tensor]:
    """Every tensor of the engine's DCP state (weights and optimizer state), copied."""
    flat, _ = flatten_state_dict(engine.state_dict())
    return {k: v.detach().clone() for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _values(state: dict[str, Any]) -> dict[str, Any]:
    flat, _ = flatten_state_dict(state)
    return {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}


def _weights(engine: TrainEngine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in engine.model.state_dict().items()}


def _assert_equal_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{key} differs"


def _load(engine: TrainEngine, **kwargs: Any) -> None:
    """Restore the engine the way the memory tier does: dcp.load into its own state dict."""
    state = engine.state_dict()
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, no_dist=True, **kwargs)
    engine.load_state_dict(state)


def _no_fetch(src: int) -> Shard:
    raise AssertionError(f"source {src} was fetched although it is held here")


@dataclass
class StagedRun:
    """An engine trained STAGED_AT steps, staged, then trained one step more."""

    engine: TrainEngine
    shard: Shard
    tensors: dict[str, torch.Tensor]
    """The engine's tensors at the staged step (weights and optimizer state)."""
    values: dict[str, Any]
    """The non-tensor leaves of its DCP state dict at the staged step."""
    next_report: StepReport
    """The step after the staged one, as the original run took it."""
    next_tensors: dict[str, torch.Tensor]


def _staged_run(gpt: tuple[JobConfig, TrainTask]) -> StagedRun:
    engine = _engine(gpt, STAGED_AT)
    shard = _stager(engine).stage(engine.step)
    tensors, values = _tensors(engine), _values(engine.state_dict())
    report, _ = engine.train_step()
    run = StagedRun(engine, shard, tensors, values, report, _tensors(engine))
    # Every tensor moves in a step: a snapshot that followed the live state would be caught.
    assert not any(torch.equal(run.tensors[k], run.next_tensors[k]) for k in run.tensors)
    return run


def _memory_reader(shard: Shard) -> MemoryReader:
    return MemoryReader(build_metadata({0: shard.layout}), local=lambda src: shard,
                        fetch=_no_fetch)


def test_layout_places_every_tensor_once_aligned_and_apart(gpt) -> None:
    engine = _engine(gpt, 1)
    layout, sources = build_layout(engine.state_dict())
    flat, _ = flatten_state_dict(engine.state_dict())
    tensors = {k for k, v in flat.items() if isinstance(v, torch.Tensor)}
    assert {index.fqn for index in layout.slots} == tensors
    assert sorted(layout.value_names) == sorted(set(flat) - tensors)
    assert len(layout.items) == len(flat)
    end = 0
    for slot, src in sources:  # in buffer order
        assert slot.offset % 64 == 0 and slot.offset >= end
        assert (slot.nbytes, slot.dtype, slot.shape) == (
            src.numel() * src.element_size(), src.dtype, tuple(src.shape))
        end = slot.offset + slot.nbytes
    assert layout.nbytes == end
    # The key names the layout: the same state gives the same key, a new tensor another.
    assert build_layout(engine.state_dict())[0].key == layout.key
    grown = {**engine.state_dict(), "extra": torch.zeros(3)}
    assert build_layout(grown)[0].key != layout.key


def test_stage_copies_the_live_state_and_its_values(gpt) -> None:
    run = _staged_run(gpt)
    shard = run.shard
    assert shard.step == STAGED_AT
    staged = {index.fqn: shard.tensor(index) for index in shard.layout.slots}
    _assert_equal_tensors(staged, run.tensors)
    # The values are the state dict's own (the scalar state plus the constant param names).
    assert shard.values == run.values
    assert shard.values["train.step"] == STAGED_AT
    assert shard.values["train.samples_seen"] == STAGED_AT * 4


def test_staged_step_restores_bit_exact_into_a_fresh_engine(gpt) -> None:
    run = _staged_run(gpt)
    fresh = _engine(gpt)
    reader = _memory_reader(run.shard)
    _load(fresh, storage_reader=reader)
    assert reader.fetched == []
    _assert_equal_tensors(_weights(fresh), {k.removeprefix("model."): v
                                            for k, v in run.tensors.items()
                                            if k.startswith("model.")})
    _assert_equal_tensors(_tensors(fresh), run.tensors)
    assert (fresh.step, fresh.samples_seen) == (STAGED_AT, STAGED_AT * 4)
    # Same weights, optimizer state, LR schedule and data position: the same next step.
    report, _ = fresh.train_step()
    assert (report.step, report.samples_seen) == (STAGED_AT + 1, (STAGED_AT + 1) * 4)
    assert report.lr == run.next_report.lr
    assert report.loss == run.next_report.loss
    _assert_equal_tensors(_tensors(fresh), run.next_tensors)


def test_rolling_the_engine_back_replays_the_step_after_the_snapshot(gpt) -> None:
    run = _staged_run(gpt)
    engine = run.engine
    _load(engine, storage_reader=_memory_reader(run.shard))
    assert (engine.step, engine.samples_seen) == (STAGED_AT, STAGED_AT * 4)
    _assert_equal_tensors(_tensors(engine), run.tensors)
    report, _ = engine.train_step()
    assert report.loss == run.next_report.loss and report.lr == run.next_report.lr
    _assert_equal_tensors(_tensors(engine), run.next_tensors)


def test_staging_alternates_between_two_buffers(gpt) -> None:
    engine = _engine(gpt, STAGED_AT)
    stager = _stager(engine)
    overwritten: list[torch.Tensor] = []
    halves: list[int] = []
    shards = []
    for _ in range(3):
        shards.append(stager.stage(engine.step, mid_copy=lambda: halves.append(engine.step),
                                   before_overwrite=overwritten.append))
        engine.train_step()
    ptrs = [s.buffer.data_ptr() for s in shards]
    assert ptrs[2] == ptrs[0] != ptrs[1]
    assert sorted(b.data_ptr() for b in stager.buffers) == sorted(ptrs[:2])
    assert len(overwritten) == 3
    assert all(b is s.buffer for b, s in zip(overwritten, shards, strict=True))
    assert halves == [STAGED_AT, STAGED_AT + 1, STAGED_AT + 2]
    # The layout did not change between the stages: it is the very same object.
    assert shards[0].layout is shards[1].layout is shards[2].layout


def test_stage_tells_before_overwriting_and_mid_copy_runs_midway(gpt) -> None:
    engine = _engine(gpt, STAGED_AT)
    stager = _stager(engine)
    first = stager.stage(engine.step)
    old = first.buffer.clone()
    engine.train_step()
    stager.stage(engine.step)
    engine.train_step()
    # The third stage overwrites the first one's buffer: look at it at both callbacks.
    at_overwrite: list[torch.Tensor] = []
    at_half: list[torch.Tensor] = []
    third = stager.stage(engine.step,
                         before_overwrite=lambda b: at_overwrite.append(b.clone()),
                         mid_copy=lambda: at_half.append(first.buffer.clone()))
    assert third.buffer is first.buffer
    assert len(at_overwrite) == 1 and len(at_half) == 1
    # Told before a byte is written, so the store can forget the old step first.
    assert torch.equal(at_overwrite[0], old)
    slots = sorted(third.layout.slots.values(), key=lambda s: s.offset)
    half = len(slots) // 2

    def region(buffer: torch.Tensor, i: int) -> torch.Tensor:
        return buffer[slots[i].offset:slots[i].offset + slots[i].nbytes]

    # At mid_copy the first half holds the new step and the second half still the old one.
    for i in range(half):
        assert torch.equal(region(at_half[0], i), region(third.buffer, i)), i
    for i in range(half, len(slots)):
        assert torch.equal(region(at_half[0], i), region(old, i)), i
    assert not torch.equal(region(old, len(slots) - 1), region(third.buffer, len(slots) - 1))


# ---------------------------------------------------------------------------- MemoryReader


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


def test_reader_reads_a_local_replica_without_fetching(gpt) -> None:
    run = _staged_run(gpt)
    layout = run.shard.layout
    asked: list[int] = []

    def local(src: int) -> Shard | None:
        asked.append(src)
        return run.shard if src == 1 else None

    # Two data-parallel sources with the same layout; only source 1's copy is here.
    reader = MemoryReader(build_metadata({0: layout, 1: layout}), local=local, fetch=_no_fetch)
    fresh = _engine(gpt)
    _load(fresh, storage_reader=reader)
    assert reader.fetched == []
    assert asked == [0, 1]  # looked up once: later reads use the shard found
    _assert_equal_tensors(_tensors(fresh), run.tensors)
    assert (fresh.step, fresh.samples_seen) == (STAGED_AT, STAGED_AT * 4)


def test_reader_fetches_a_missing_shard_once_from_its_first_source(gpt) -> None:
    run = _staged_run(gpt)
    layout = run.shard.layout
    fetches: list[int] = []

    def fetch(src: int) -> Shard:
        fetches.append(src)
        # What a peer sends: a copy of its buffer, not this worker's own memory.
        return Shard(step=run.shard.step, layout=layout, buffer=run.shard.buffer.clone(),
                     values=dict(run.shard.values))

    reader = MemoryReader(build_metadata({0: layout, 1: layout}), local=lambda src: None,
                          fetch=fetch)
    fresh = _engine(gpt)
    _load(fresh, storage_reader=reader)
    assert fetches == [0] and reader.fetched == [0]
    _assert_equal_tensors(_tensors(fresh), run.tensors)
    assert (fresh.step, fresh.samples_seen) == (STAGED_AT, STAGED_AT * 4)


# ---------------------------------------------------------------------------- SnapshotSavePlanner


def _save_snapshot(shard: Shard, path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({}, storage_writer=FileSystemWriter(path), planner=SnapshotSavePlanner(shard),
                 no_dist=True)


def test_snapshot_save_planner_writes_the_staged_step(gpt, tmp_path: Path) -> None:
    run = _staged_run(gpt)  # the live engine is a step past the snapshot when it is saved
    _save_snapshot(run.shard, tmp_path / "snap")
    fresh = _engine(gpt)
    _load(fresh, storage_reader=FileSystemReader(tmp_path / "snap"))
    _assert_equal_tensors(_tensors(fresh), run.tensors)
    assert (fresh.step, fresh.samples_seen) == (STAGED_AT, STAGED_AT * 4)
    report, _ = fresh.train_step()
    assert report.loss == run.next_report.loss


def test_snapshot_save_matches_a_plain_save_of_the_live_state(gpt, tmp_path: Path) -> None:
    engine = _engine(gpt, STAGED_AT)
    shard = _stager(engine).stage(engine.step)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(engine.state_dict(), storage_writer=FileSystemWriter(tmp_path / "plain"),
                 no_dist=True)
    engine.train_step()
    _save_snapshot(shard, tmp_path / "snap")
    plain = FileSystemReader(tmp_path / "plain").read_metadata()
    snap = FileSystemReader(tmp_path / "snap").read_metadata()
    assert snap.state_dict_metadata.keys() == plain.state_dict_metadata.keys()
    assert snap.state_dict_metadata == plain.state_dict_metadata
    assert snap.planner_data == plain.planner_data
    # And the same contents: both checkpoints load to the same state.
    from_plain, from_snap = _engine(gpt), _engine(gpt)
    _load(from_plain, storage_reader=FileSystemReader(tmp_path / "plain"))
    _load(from_snap, storage_reader=FileSystemReader(tmp_path / "snap"))
    _assert_equal_tensors(_tensors(from_snap), _tensors(from_plain))
    assert _values(from_snap.state_dict()) == _values(from_plain.state_dict())


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


def test_replica_class_names_data_parallel_twins() -> None:
    # pp=2 x dp_replicate=2 x dp_shard=2 x tp=1: ranks 0 and 2 are replicas (same shard, same
    # stage), 4 and 6 are too but of the other stage.
    dims = ParallelDims(dp_replicate=2, dp_shard=2, tp=1, pp=2)
    classes = [dims.replica_class(r) for r in range(8)]
    assert classes == [(0, 0, 0), (0, 1, 0), (0, 0, 0), (0, 1, 0),
                       (1, 0, 0), (1, 1, 0), (1, 0, 0), (1, 1, 0)]
    tp = ParallelDims(dp_replicate=2, dp_shard=1, tp=2)
    assert [tp.replica_class(r) for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 0, 0),
                                                      (0, 0, 1)]


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


def test_a_layout_is_checked_before_its_buffers_exist(gpt) -> None:
    engine = _engine(gpt, STAGED_AT)
    seen: list[ShardLayout] = []

    def refuse(layout: ShardLayout) -> None:
        seen.append(layout)
        raise MemoryError("too big")

    stager = SnapshotStager(state_dict=engine.state_dict, scalar_state=engine.scalar_state,
                            signature=engine.state_signature, device=torch.device("cpu"),
                            on_layout=refuse)
    with pytest.raises(MemoryError, match="too big"):
        stager.stage(engine.step)
    assert len(seen) == 1 and seen[0].nbytes > 0
    assert stager.buffers == []  # nothing was allocated
