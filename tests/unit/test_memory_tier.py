"""The in-memory checkpoint tier on a real engine, in one process: staging its state,
reading it back through DCP (from memory and from a storage checkpoint written from the
snapshot), and the memory limit checked before buffers exist. Where replicas go, the store
and the driver's choice of step are in test_memory_holdings.py.

No process group: the replication exchange itself is covered by tests/dist/test_memory_tier.py.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from stalwart.checkpointing.errors import SnapshotCorrupt
from stalwart.checkpointing.memory.direct_restore import restore_directly
from stalwart.checkpointing.memory.reader import MemoryReader, build_metadata
from stalwart.checkpointing.memory.tier import MemoryTier, fetched_bytes
from stalwart.checkpointing.snapshot import Shard, ShardLayout, SnapshotStager, build_layout
from stalwart.checkpointing.snapshot_planner import SnapshotSavePlanner
from stalwart.core.config import JobConfig, load_config
from stalwart.core.task import TrainTask, build_task
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
    shard.seal()  # its CRC32, as the replication thread records it
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
                     values=dict(run.shard.values), crc=run.shard.crc)

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


# ---------------------------------------------------------------------------- the memory limit


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


# ---------------------------------------------------------------------------- hooks


class RecordingHooks:
    """The moments a snapshot marks, as the worker's fault injector is told them."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def mid_copy(self, step: int) -> None:
        self.seen.append(("mid_copy", step))

    def before_payload(self, step: int) -> None:
        self.seen.append(("before_payload", step))

    def sending(self, step: int, nbytes: int) -> None:
        self.seen.append(("sending", step))


def test_the_tier_tells_its_hooks_the_snapshots_step(gpt) -> None:
    engine = _engine(gpt, STAGED_AT)
    tier = MemoryTier()
    tier.join(engine.tier_view(), rank=0, generation=0, nodes=["a"], replicas=0, limit_gb=1.0)
    hooks = RecordingHooks()
    try:
        tier.snapshot(engine.step, hooks=hooks)
        tier.snapshot(engine.step)  # no hooks: nobody is told
    finally:
        tier.leave()
    # no process group here, so no exchange: only the staging's moment comes
    assert hooks.seen == [("mid_copy", STAGED_AT)]


# ---------------------------------------------------------------------------- CRC32 at restore


def _flipped(shard: Shard) -> torch.Tensor:
    """A copy of the shard's buffer with one bit of its first tensor flipped."""
    bad = shard.buffer.clone()
    bad[next(iter(shard.layout.slots.values())).offset] ^= 1
    return bad


def test_a_flipped_byte_in_a_held_replica_is_caught_before_it_is_used(gpt) -> None:
    run = _staged_run(gpt)
    tier, bad = MemoryTier(), _flipped(run.shard)
    tier.store.put(0, 1, Shard(step=STAGED_AT, layout=run.shard.layout, buffer=bad,
                               values=dict(run.shard.values), crc=run.shard.crc))
    fresh = _engine(gpt)
    before = _tensors(fresh)
    with pytest.raises(SnapshotCorrupt, match=f"rank 1's snapshot of step {STAGED_AT} is "
                                              f"damaged: its bytes have CRC32"):
        tier.restore(fresh.tier_view(), generation=0, step=STAGED_AT,
                     layouts={1: run.shard.layout},
                     fetch=lambda src: (bad.numpy().copy(), dict(run.shard.values),
                                        run.shard.crc))
    _assert_equal_tensors(_tensors(fresh), before)  # nothing of it was loaded
    assert fresh.step == 0


def test_a_damaged_copy_held_here_is_fetched_from_its_holder_instead(gpt) -> None:
    run = _staged_run(gpt)
    tier = MemoryTier()
    tier.store.put(0, 1, Shard(step=STAGED_AT, layout=run.shard.layout,
                               buffer=_flipped(run.shard), values=dict(run.shard.values),
                               crc=run.shard.crc))
    fresh = _engine(gpt)
    fetched = tier.restore(fresh.tier_view(), generation=0, step=STAGED_AT,
                           layouts={1: run.shard.layout},
                           fetch=lambda src: (run.shard.buffer.numpy().copy(),
                                              dict(run.shard.values), run.shard.crc))
    assert fetched == [1]
    _assert_equal_tensors(_tensors(fresh), run.tensors)


def test_an_unsealed_snapshot_is_not_served() -> None:
    store = MemoryTier().store
    layout, _ = build_layout({"w": torch.zeros(2)})
    store.put(0, 0, Shard(step=1, layout=layout, buffer=torch.zeros(layout.nbytes,
                                                                    dtype=torch.uint8)))
    assert store.inventory().holdings == ()  # its CRC32 is not known yet


# ---------------------------------------------------------------------------- direct restore


def test_a_shard_laid_out_as_this_rank_is_copied_in_without_dcp(gpt) -> None:
    run = _staged_run(gpt)
    fresh = _engine(gpt)
    state = fresh.state_dict()
    asked = []

    def shard_for(sources: list[int]) -> Shard:
        asked.append(sources)
        return run.shard

    assert restore_directly(state, {0: run.shard.layout, 1: run.shard.layout}, shard_for)
    assert asked == [[0, 1]]  # every source laid out as this rank is a candidate
    fresh.load_state_dict(state)
    _assert_equal_tensors(_tensors(fresh), run.tensors)
    assert _values(fresh.state_dict()) == run.values
    # The values are copies: changing the engine's changes nothing in the snapshot.
    assert state["train"] is not run.shard.values
    # The same next step as the run the snapshot came from, bit for bit.
    report, _ = fresh.train_step()
    assert (report.loss, report.lr) == (run.next_report.loss, run.next_report.lr)
    _assert_equal_tensors(_tensors(fresh), run.next_tensors)


def test_another_layout_is_left_to_dcp_and_the_state_untouched(gpt) -> None:
    run = _staged_run(gpt)
    fresh = _engine(gpt)
    grown = {**fresh.state_dict(), "extra": torch.zeros(3)}
    before = _tensors(fresh)
    assert not restore_directly(grown, {0: run.shard.layout}, _no_fetch_list)
    _assert_equal_tensors(_tensors(fresh), before)


def test_the_tier_restores_its_own_layout_directly_and_a_fetch_is_recorded(gpt) -> None:
    run = _staged_run(gpt)
    fresh = _engine(gpt)
    tier = MemoryTier()
    fetched = tier.restore(fresh.tier_view(), generation=0, step=STAGED_AT,
                           layouts={0: run.shard.layout},
                           fetch=lambda src: (run.shard.buffer.numpy().copy(),
                                              dict(run.shard.values), run.shard.crc))
    assert fetched == [0]  # not held here: fetched from its holder, CRC checked
    _assert_equal_tensors(_tensors(fresh), run.tensors)


def test_a_restore_hands_its_layout_to_the_worlds_next_snapshot(gpt) -> None:
    # The restored step is staged in the world's first step: from the layout the restore
    # built, without the state dict asked for again, and from the live tensors it loaded.
    run = _staged_run(gpt)
    fresh = _engine(gpt)
    asked: list[int] = []

    def state_dict() -> dict[str, Any]:
        asked.append(fresh.step)
        return fresh.state_dict()

    view = dataclasses.replace(fresh.tier_view(), state_dict=state_dict)
    tier = MemoryTier()
    tier.join(view, rank=0, generation=1, nodes=["a"], replicas=0, limit_gb=1.0)
    try:
        tier.restore(view, generation=0, step=STAGED_AT, layouts={0: run.shard.layout},
                     fetch=lambda src: (run.shard.buffer.numpy().copy(),
                                        dict(run.shard.values), run.shard.crc))
        restored = tier.snapshot(fresh.step, restored=True)
        assert asked == [0]  # the restore's own, before it loaded
        _assert_equal_tensors({i.fqn: restored.tensor(i) for i in restored.layout.slots},
                              run.tensors)
        fresh.train_step()
        nxt = tier.snapshot(fresh.step)
        _assert_equal_tensors({i.fqn: nxt.tensor(i) for i in nxt.layout.slots},
                              run.next_tensors)
    finally:
        tier.leave()


def _no_fetch_list(sources: list[int]) -> Shard:
    raise AssertionError(f"{sources} asked for although no layout matches")


def _read_only(array: Any) -> Any:
    """An array as Ray hands one over from its object store: a view that may not be written."""
    array.setflags(write=False)
    return array


def test_a_shard_fetched_read_only_restores_without_a_warning_or_a_copy(gpt) -> None:
    run = _staged_run(gpt)
    fresh = _engine(gpt)
    fetched_array = _read_only(run.shard.buffer.numpy().copy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "not writable" UserWarning would raise
        fetched = MemoryTier().restore(
            fresh.tier_view(), generation=0, step=STAGED_AT, layouts={0: run.shard.layout},
            fetch=lambda src: (fetched_array, dict(run.shard.values), run.shard.crc))
        # The shard's tensor views the fetched memory itself: no copy of it is made.
        assert fetched_bytes(fetched_array).data_ptr() == fetched_array.ctypes.data
    assert fetched == [0]
    _assert_equal_tensors(_tensors(fresh), run.tensors)
