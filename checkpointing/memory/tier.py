"""One worker's memory tier, across the generations of the world it joins.

Per generation it stages this rank's snapshots (checkpointing/snapshot.py) and replicates
them to holders on other nodes (checkpointing/memory/replication.py); across generations it keeps
the store (checkpointing/memory/store.py) of its own and its peers' snapshots, so that the
next world can restore from survivors. Restoring reads the chosen step through DCP with the
in-memory reader (checkpointing/memory/reader.py), resharding it to the new world.

After any restore, the restored step is staged and replicated once more in the new world,
while its first step runs; older generations are dropped once that step is done. A failure
right after a recovery restores from memory too, and no more than two steps per shard are
ever held.

Which steps are snapshotted, and which step's all-reduce waits for an exchange, is the
world's SnapshotSchedule (checkpointing/snapshot_schedule.py). With `snapshot_every = "auto"`
the tier times what each snapshot costs the training thread and hands each window's figures
to the next exchange, whose all-reduce makes them the same on every rank.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from stalwart.checkpointing.errors import SnapshotCorrupt
from stalwart.checkpointing.memory.direct_restore import restore_directly
from stalwart.checkpointing.memory.limits import GIB, MemoryLimit, memory_limit, ray_node_memory
from stalwart.checkpointing.memory.reader import MemoryReader, build_metadata
from stalwart.checkpointing.memory.replication import Replicator, holders_for
from stalwart.checkpointing.memory.store import Inventory, MemoryStore
from stalwart.checkpointing.optional_keys import drop_keys_it_lacks
from stalwart.checkpointing.safe_load import SafeLoadPlanner
from stalwart.checkpointing.snapshot import Shard, ShardLayout, SnapshotStager, build_layout
from stalwart.checkpointing.snapshot_schedule import (
    UNMEASURED,
    ScheduleReport,
    SnapshotSchedule,
    Window,
)
from stalwart.core.errors import ConfigError


class MemoryLimitError(ConfigError):
    """The memory tier would hold more than checkpoint.memory_limit_gb on a worker."""


@dataclass(frozen=True)
class StateAccess:
    """How the tier reads and writes the training state (the engine gives it: workers/engine.py)."""

    state_dict: Callable[[], dict[str, Any]]
    scalar_state: Callable[[], dict[str, Any]]
    signature: Callable[[], Any]
    load_state_dict: Callable[[dict[str, Any]], None]
    device: torch.device


class SnapshotHooks(Protocol):
    """Moments inside taking one snapshot, for a caller that acts at them (the worker's
    fault injector). Each is told the snapshot's step."""

    def mid_copy(self, step: int) -> None:
        """Half of the snapshot's tensors are staged."""

    def before_payload(self, step: int) -> None:
        """The snapshot's headers are exchanged with its holders; its payload is not."""

    def sending(self, step: int, nbytes: int) -> None:
        """The exchange's thread is about to send `nbytes` of the snapshot to its holders."""


class WindowClock:
    """What the training thread spent on snapshots since the last one, and each step's own
    time and span, for the schedule (checkpointing/snapshot_schedule.py says what each figure
    is)."""

    # Steps a window keeps (the last ones): an interval may be long.
    STEPS_KEPT = 1024
    # Windows whose measures of the exchange's toll are taken together (the median): one
    # window's is a step or two against the others, as noisy as a step. Fewer than
    # TOLLS_NEEDED measure nothing yet (two hiccups in the first three would be the median).
    TOLLS_KEPT, TOLLS_NEEDED = 16, 5

    def __init__(self, on: bool = False) -> None:
        self.on = on  # only an auto schedule needs the figures
        self.stage_s = 0.0  # the last snapshot's staging
        self.wait_s = 0.0
        self.steps = 0
        # (own time, start, end) of each step since the last snapshot
        self.spans: deque[tuple[float, float, float]] = deque(maxlen=self.STEPS_KEPT)
        self.in_step = 0.0  # waits inside the step not yet reported by `stepped`
        self.tolls: deque[float] = deque(maxlen=self.TOLLS_KEPT)  # kept across windows

    def waited(self, seconds: float) -> None:
        if self.on:
            self.wait_s += seconds
            self.in_step += seconds

    def stepped(self, step_s: float, end: float | None = None) -> None:
        """A step ended (now, by default: time.perf_counter), `step_s` after it began."""
        if not self.on:
            return
        end = time.perf_counter() if end is None else end
        self.spans.append((max(0.0, step_s - self.in_step), end - step_s, end))
        self.steps += 1
        self.in_step = 0.0

    def window(self, interval: int, busy_s: float, exchange_s: float,
               finished_at: float) -> Window:
        own = [s for s, _, _ in self.spans]
        return Window(steps=self.steps, interval=interval,
                      step_s=statistics.median(own) if own else 0.0,
                      stage_s=self.stage_s, wait_s=self.wait_s, busy_s=busy_s,
                      exchange_s=exchange_s, contended_s=self.contended(finished_at))

    def contended(self, finished_at: float) -> float:
        """What an exchange takes from the steps it starts and ends in (the first of the
        window, and the one it ended in) against the median of the others: this window's
        toll joins the last TOLLS_KEPT, and their median is the answer (UNMEASURED before
        TOLLS_NEEDED windows had a step clear of their exchange)."""
        spans = list(self.spans)
        beside = {0} | {i for i, (_, start, end) in enumerate(spans) if start <= finished_at < end}
        clear = [own for i, (own, _, _) in enumerate(spans) if i not in beside]
        if spans and clear and len(spans) == self.steps:
            typical = statistics.median(clear)
            self.tolls.append(sum(spans[i][0] - typical for i in beside))
        if len(self.tolls) < self.TOLLS_NEEDED:
            return UNMEASURED
        return max(0.0, statistics.median(self.tolls))

    def restart(self, stage_s: float) -> None:
        self.stage_s, self.wait_s, self.steps = stage_s, 0.0, 0
        self.spans.clear()


class MemoryTier:
    def __init__(self) -> None:
        self.store = MemoryStore()
        self.stager: SnapshotStager | None = None
        self.replicator: Replicator | None = None
        self.generation = -1
        self.rank = -1
        self.limit: MemoryLimit | None = None
        self.schedule = SnapshotSchedule(1, persist_every=1, last_step=0)
        self.clock = WindowClock()
        self._step = 0  # the last step the training loop reported (`due`)

    # ------------------------------------------------------------------ per generation

    def join(self, engine: StateAccess, *, rank: int, generation: int, nodes: list[str],
             replicas: int, limit_gb: float, replica_class: list[Any] | None = None,
             keep: int = 2, schedule: SnapshotSchedule | None = None) -> None:
        """Set up for a new world. Collective: every rank calls it, in the same order as the
        other process groups it creates. `replica_class` tells data-parallel replicas apart
        (equal values: identical state), so that no snapshot is sent to its own twin. `keep`:
        snapshots kept per shard (more than two keep older steps to roll back to).
        `schedule`: the world's snapshot steps (default: whenever `snapshot` is called, each
        exchange waited for in the step after it)."""
        self.rank, self.generation = rank, generation
        self.schedule = schedule or SnapshotSchedule(1, persist_every=1, last_step=0)
        self.clock, self._step = WindowClock(on=self.schedule.auto), 0
        self.store.keep = keep
        self.limit = memory_limit(limit_gb, nodes.count(nodes[rank]),
                                  ray_memory=ray_node_memory())
        self.replicator = Replicator(rank=rank, generation=generation,
                                     holders=holders_for(nodes, replicas), store=self.store,
                                     replica_class=replica_class, max_bytes=self.limit.bytes)
        # The limit is checked when a layout is known, before its buffers are allocated.
        self.stager = SnapshotStager(state_dict=engine.state_dict,
                                     scalar_state=engine.scalar_state,
                                     signature=engine.signature, device=engine.device,
                                     on_layout=self._check_limit, buffers=keep)

    def due(self, step: int, step_s: float) -> bool:
        """The training loop finished `step` in `step_s` seconds: whether the schedule
        snapshots it (a persist or stop step is snapshotted whatever this says)."""
        self._step = step
        self.clock.stepped(step_s)
        return self.schedule.due(step)

    def snapshot(self, step: int, hooks: SnapshotHooks | None = None, *,
                 restored: bool = False) -> Shard:
        """Stage this rank's state as `step` and start replicating it."""
        assert self.stager is not None and self.replicator is not None
        started, self._step = time.perf_counter(), step
        self.replicator.wait()  # normally done already (see replication.py: ordering)
        if self.schedule.unplanned(step):
            # A stop between planned snapshots: no all-reduce has waited for the exchange in
            # flight, and staging may overwrite the buffer of the step before it.
            self.replicator.barrier()
        figures = self._agree(step)
        mid_copy = before_payload = sending = None
        if hooks is not None:
            mid_copy, before_payload, sending = (partial(hooks.mid_copy, step),
                                                 partial(hooks.before_payload, step),
                                                 partial(hooks.sending, step))
        shard = self.stager.stage(step, mid_copy=mid_copy,
                                  before_overwrite=self.store.forget_buffer)
        self.store.put(self.generation, self.rank, shard)
        self.replicator.replicate(shard, before_payload=before_payload, figures=figures,
                                  sending=sending)
        self.schedule.taken(step, restored=restored)
        self.clock.restart(time.perf_counter() - started)
        return shard

    def _agree(self, step: int) -> list[float] | None:
        """Auto schedule: decide from the window the last exchange agreed on; returns this
        rank's window since the last snapshot, for the exchange about to start (None: fixed
        interval, or no window yet)."""
        schedule, replicator = self.schedule, self.replicator
        assert replicator is not None
        if not schedule.auto:
            return None
        mine = None
        if schedule.anchor is not None:  # the window run with the interval in force till now
            mine = self.clock.window(schedule.interval, replicator.busy_s,
                                     replicator.exchange_s, replicator.finished_at).to_list()
        if replicator.agreed is not None:
            schedule.agreed(Window.from_list(replicator.agreed), step)
            replicator.agreed = None
        return mine

    def schedule_report(self) -> ScheduleReport | None:
        """The auto schedule's decisions since the last call and its reading (None: fixed)."""
        return self.schedule.report()

    def _check_limit(self, layout: ShardLayout) -> None:
        assert self.replicator is not None
        held = len(self.replicator.receives_from)
        # `keep` buffers of our own, as many per shard held for a peer (peers' shards are
        # the same size in data parallelism and about the same when sharded).
        keep = self.store.keep
        need = keep * layout.nbytes * (1 + held)
        assert self.limit is not None
        if need > self.limit.bytes:
            raise MemoryLimitError(
                f"the in-memory checkpoint tier needs about {need / GIB:.2f} GiB on worker "
                f"rank {self.rank} ({keep} snapshots of its {layout.nbytes / GIB:.2f} GiB shard "
                f"and of the {held} shard(s) it holds for peers), more than "
                f"{self.limit.describe()}; raise checkpoint.memory_limit_gb, lower "
                f"checkpoint.replicas, or set checkpoint.snapshot_every = 0 to use storage "
                f"checkpoints only")

    def wait_replicated(self) -> None:
        """Before a step's final all-reduce: the previous snapshot is on its holders (with an
        auto schedule, only before the all-reduce of the next snapshot's step)."""
        if self.replicator is not None and self.schedule.must_wait(self._step + 1):
            started = time.perf_counter()
            self.replicator.wait()
            self.schedule.waited()
            self.clock.waited(time.perf_counter() - started)

    def _exchange_done(self) -> None:
        """Wait for the exchange in flight, whatever the schedule."""
        if self.replicator is not None:
            self.replicator.wait()

    def abandon(self) -> None:
        """The world is being left: stop waiting for an exchange that may never end (a peer
        lost with its node does not close its connections)."""
        if self.replicator is not None:
            self.replicator.abandon()

    def wait_copy_done(self) -> None:
        if self.stager is not None:
            started = time.perf_counter()
            self.stager.wait_copy_done()
            self.clock.waited(time.perf_counter() - started)

    def stage_restored(self, step: int) -> None:
        """Stage the restored step in this world and start replicating it; the first step's
        last all-reduce waits for the exchange (replication.py: ordering), then the caller
        drops older generations (`drop_older`). Until then they stay: a failure during the
        first step restores from them. Step 0 (a fresh start) has nothing to stage."""
        if step > 0:
            self.snapshot(step, restored=True)
        else:
            self.drop_older()

    def drop_older(self) -> None:
        """Forget the snapshots of older generations: this world holds its own now."""
        self.store.drop_before(self.generation)

    def leave(self) -> None:
        """Leave the world; what the store holds stays for the next one."""
        if self.replicator is not None:
            self.replicator.close()
        self.replicator = None
        self.stager = None

    def roll_back(self, engine: StateAccess, step: int) -> bool:
        """Load this rank's own snapshot of `step` (this world's) and forget every newer one,
        its own and those it holds for peers: they may carry the fault rolled back from (see
        forget_after). False when no such snapshot is held."""
        self._exchange_done()
        shard = self.store.get(self.generation, self.rank, step)
        if shard is None:
            return False
        if shard.crc is None:
            shard.seal()

        def no_fetch(src: int) -> tuple[Any, dict[str, Any], int | None]:
            raise LookupError(f"a rollback reads only this rank's own snapshot, not rank {src}'s")

        self.restore(engine, generation=self.generation, step=step,
                     layouts={self.rank: shard.layout}, fetch=no_fetch)
        self.forget_after(step)
        return True

    def forget_after(self, step: int) -> None:
        """Forget this world's snapshots newer than `step`, own and held for peers, once the
        exchange in flight has ended (no suspect replica lands after the cut)."""
        self._exchange_done()
        self.store.drop_after(self.generation, step)

    # ------------------------------------------------------------------ serving

    def nbytes(self) -> int:
        """Memory this worker's tier holds: its staging buffers and every snapshot kept."""
        return self.store.nbytes(self.stager.buffers if self.stager is not None else [])

    def inventory(self) -> Inventory:
        return self.store.inventory()

    def export(self, generation: int, source: int, step: int
               ) -> tuple[Any, dict[str, Any], int | None]:
        """A held snapshot's buffer (as a numpy array, which Ray moves as raw bytes),
        values and CRC32 (its owner's), for a peer that restores from it and checks it.

        The array is a view of the held buffer, not a copy: Ray serializes an actor method's
        return value into its object store as the method returns, so a copy here would only
        add a second full pass over the shard before the one Ray makes. A caller in this
        process must use the array before the tier reuses the buffer. Either way the bytes
        are read without the stager's lock: a snapshot staged into the same buffer meanwhile
        (a holder whose training thread runs on) fails the restorer's CRC32 check."""
        shard = self.store.get(generation, source, step)
        if shard is None:
            raise LookupError(f"no snapshot of rank {source} of generation {generation} at "
                              f"step {step} is held here")
        shard.ready()
        return shard.buffer.numpy(), dict(shard.values), shard.crc

    def restore(self, engine: StateAccess, *, generation: int, step: int,
                layouts: dict[int, ShardLayout],
                fetch: Callable[[int], tuple[Any, dict[str, Any], int | None]]) -> list[int]:
        """Load step `step` of generation `generation` into the engine, resharded to this
        world; returns the source ranks whose shards came from peers. Each shard's bytes are
        checked against its CRC32 before they are used: a mismatch raises SnapshotCorrupt
        (the restore from memory fails, and the world falls back to storage)."""
        def local(src: int) -> Shard | None:
            return self.store.get(generation, src, step)

        def remote(src: int) -> Shard:
            array, values, crc = fetch(src)
            return Shard(step=step, layout=layouts[src], buffer=fetched_bytes(array),
                         values=values, crc=crc)

        state = engine.state_dict()
        signature = engine.signature()
        built = build_layout(state)
        reader = MemoryReader(build_metadata(layouts), local=local, fetch=remote)
        if restore_directly(state, layouts, reader.shard_for, built):
            engine.load_state_dict(state)
            if self.stager is not None:  # the world's next snapshot stages the same state
                self.stager.adopt(state, *built, signature=signature)
            return reader.fetched
        with warnings.catch_warnings():  # "assuming the intent is to load in a single
            warnings.simplefilter("ignore", UserWarning)  # process": yes, no collectives
            try:
                drop_keys_it_lacks(state, reader.read_metadata().state_dict_metadata)
                dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
            except CheckpointException as exc:  # DCP wraps the reader's errors: unwrap ours
                for inner, _trace in exc.failures.values():
                    if isinstance(inner, SnapshotCorrupt):
                        raise inner from exc
                raise
        engine.load_state_dict(state)
        return reader.fetched


def fetched_bytes(array: Any) -> torch.Tensor:
    """A fetched shard's bytes as a tensor over the same memory, without a copy.

    Ray hands a numpy array it fetched over as a read-only view of its object store. A
    restore only reads a fetched shard (its CRC32, then copies out of it), so the view is
    used as it is: torch's warning that it cannot enforce the read-only flag is silenced
    here rather than paid for with a copy of the whole shard."""
    if array.flags.writeable:
        return torch.from_numpy(array)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable",
                                category=UserWarning)
        return torch.from_numpy(array)
