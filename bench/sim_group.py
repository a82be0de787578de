"""A simulated worker group of thousands of ranks for bench/scale.py: no torch training, no Ray.

SimGroup subclasses the real group's abstract base (orchestrator/group.py), so the real
Controller drives it as it drives ElasticGroup. Its actors sit `ranks_per_node` to a node. Time
is a SimClock that moves only when a poll waits (the interval the real group's node agents
pace) or the controller sleeps, so a run of many polls takes only the CPU it costs. Each poll
answers as real workers do: every rank a WorkerStatus with the steps it completed since the
last poll (every rank reports its steps; rank 0's carry the loss the controller logs), rank 0
the commits (one every `commit_every` steps). `fail_at` kills a rank at a step: the poll that
covers that step finds it dead, and the survivors answer with no progress (stuck in the step's
collective).

The group counts its own time (`own_cpu_s`, `own_wall_s`) so that a bench can tell the
controller's work from the simulated workers'. It answers with the same views as the real
group (pool_view, poll's PollView) and calls nothing back in the controller.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from stalwart.checkpointing.memory.catalog import MemoryChoice
from stalwart.checkpointing.memory.store import Holding, Inventory
from stalwart.checkpointing.snapshot import ShardLayout
from stalwart.checkpointing.storage.writer import CommitReport
from stalwart.core.config import FaultSpec, JobConfig
from stalwart.core.errors import ConfigError
from stalwart.core.events import WorkerPlace
from stalwart.orchestrator.clock import Clock
from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.orchestrator.group import Disbanded, PollView, PoolView, WorkerGroup
from stalwart.workers.reports import StepReport, WorkerStatus

T0 = 1_700_000_000.0  # the simulated clock starts here

# A data-parallel rank's snapshot, reduced to one value: whoever holds a step holds all of it.
REPLICA = ShardLayout(items=(WriteItem(index=MetadataIndex("train.step"),
                                       type=WriteItemType.BYTE_IO),),
                      slots={}, planner_data={}, nbytes=0, key="replica")


class SimClock(Clock):
    """Moves only when a poll waits or the controller sleeps."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class SimGroupError(Exception):
    """The controller's `group_error` for this group: it carries a WorkerFailure."""

    def __init__(self, failure: WorkerFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@dataclass(frozen=True)
class SimActor:
    pid: int
    node: int

    def place(self, rank: int) -> WorkerPlace:
        return WorkerPlace(rank=rank, pid=self.pid, node_ip=f"10.0.{self.node // 256}."
                           f"{self.node % 256}", node_id=f"node-{self.node:04d}")


@dataclass
class SimStats:
    """What the simulated run did (a bench reads it; the unit test checks it)."""

    polls: int = 0
    failures_reported: list[tuple[float, float]] = field(default_factory=list)
    """(perf_counter, process_time) right after each poll that reported a dead rank returned."""
    generations: int = 0


class SimGroup(WorkerGroup):
    """`ranks_per_node` simulated actors a node; warm at once; spares on their own nodes."""

    def __init__(self, config: JobConfig, clock: SimClock, *, ranks_per_node: int = 8,
                 step_s: float = 0.5, commit_every: int = 50,
                 fail_at: dict[int, int] | None = None) -> None:
        self.config, self.clock = config, clock
        self.ranks_per_node, self.step_s, self.commit_every = ranks_per_node, step_s, commit_every
        self.fail_at = dict(fail_at or {})
        """Step -> the rank that dies at it (each fires once)."""
        self.driver_node_id = "node-driver"
        self.members: list[SimActor] = []
        self.idle: list[SimActor] = []
        self.dead_nodes: set[str] = set()
        self.stats = SimStats()
        self.own_cpu_s = 0.0
        self.own_wall_s = 0.0
        self._next_pid = 10_000
        self._places: list[WorkerPlace] = []
        self._generation = -1
        self._start_step = 0  # the step this world restored
        self._launched_at: float | None = None
        self._reported = 0  # the newest step every rank has reported
        self._broken = False  # a rank died: the survivors make no progress
        # pid -> (generation, rank, step, world size) of the newest snapshot it holds
        self._held: dict[int, tuple[int, int, int, int]] = {}

    @contextmanager
    def _own(self) -> Iterator[None]:
        """Count the time inside as the simulated workers' (not the controller's)."""
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            self.own_cpu_s += time.process_time() - cpu
            self.own_wall_s += time.perf_counter() - wall

    # -- the pool

    def top_up(self, *, spares: bool = True) -> None:
        with self._own():
            sc = self.config.scaling
            want = (sc.ceiling + (sc.spare_workers if spares else 0) - len(self.members)
                    - len(self.idle))
            for _ in range(max(0, want)):
                n = self._next_pid - 10_000
                self.idle.append(SimActor(pid=self._next_pid, node=n // self.ranks_per_node))
                self._next_pid += 1

    def refresh(self, timeout: float = 0.0) -> None:
        """Placed actors are warm at once."""

    def pool_view(self) -> PoolView:
        return PoolView(available=len(self.members) + len(self.idle), placed_starting=0,
                        best_world=self._best_world())

    def draining_nodes(self) -> frozenset[str]:
        return frozenset()

    def _best_world(self) -> int:
        with self._own():
            n = min(self.config.scaling.ceiling, len(self.members) + len(self.idle))
            for size in range(n, 0, -1):  # from the top: the answer is usually n itself
                try:
                    self.config._check_world(size)
                except ConfigError:
                    continue
                return size
            return 0

    def nodes_alive(self, node_ids: set[str]) -> bool:
        return not (node_ids & self.dead_nodes)

    # -- one generation

    def pick(self, world_size: int, generation: int) -> list[WorkerPlace]:
        with self._own():
            pool = self.members + self.idle
            self.members, self.idle = pool[:world_size], pool[world_size:]
            self._generation = generation
            self._places = [a.place(r) for r, a in enumerate(self.members)]
            self.stats.generations += 1
        return list(self._places)

    def form(self, armed: Mapping[int, Sequence[FaultSpec]]) -> None:
        """Simulated ranks fire no injected faults: nothing to set up."""

    def places(self) -> list[WorkerPlace]:
        return list(self._places)

    def restore(self, path: str) -> int:
        step = int(path.rsplit("_", 1)[-1])
        self._start_step = step
        return step

    def memory_inventory(self) -> dict[str, Inventory]:
        """Each member holds its own newest snapshot and its left neighbour's replica."""
        with self._own():
            out = {}
            for a in self.members + self.idle:
                held = self._held.get(a.pid)
                holdings = () if held is None else (
                    Holding(held[0], held[1], held[2], REPLICA.key),
                    Holding(held[0], (held[1] - 1) % held[3], held[2], REPLICA.key))
                out[f"pid-{a.pid}"] = Inventory(holdings=holdings,
                                                layouts={REPLICA.key: REPLICA}, nbytes=0)
            return out

    def restore_memory(self, choice: MemoryChoice) -> tuple[int, list[list[int]]]:
        self._start_step = choice.step
        return choice.step, [[] for _ in self.members]

    def launch(self, *, restored: bool) -> None:
        self._launched_at = self.clock.now
        self._reported = self._start_step
        self._broken = False

    def settle(self) -> None:
        """Older worlds' snapshots would be dropped (none are kept here)."""

    def poll(self, wait_s: float) -> PollView:
        self.clock.sleep(wait_s)  # the real group's node agents answer when the interval ends
        with self._own():
            answered, dead = self._answers()
            self.stats.polls += 1
        if dead:
            self.stats.failures_reported.append((time.perf_counter(), time.process_time()))
        return PollView(answered=answered, dead=tuple(dead))

    def _answers(self) -> tuple[dict[int, WorkerStatus], list[WorkerFailure]]:
        assert self._launched_at is not None, "poll before launch"
        total = self.config.train.steps
        reached = 0 if self._broken else min(total, self._start_step + int(
            (self.clock.now - self._launched_at) / self.step_s))
        new = list(range(self._reported + 1, max(self._reported, reached) + 1))
        dying = next((s for s in new if s in self.fail_at), None)
        victim = None
        if dying is not None:
            victim = self.fail_at.pop(dying)
            new = [s for s in new if s < dying]
            self._broken = True
        gen = self._generation
        ends = {s: self._launched_at + (s - self._start_step) * self.step_s for s in new}
        commits = [CommitReport(step=s, path=f"/sim/checkpoints/step_{s:08d}", save_s=0.1)
                   for s in new if s % self.commit_every == 0]
        done = not self._broken and bool(new) and new[-1] == total or self._reported == total
        answered: dict[int, WorkerStatus] = {}
        for rank, actor in enumerate(self.members):
            if rank == victim:
                continue
            steps = [StepReport(rank=rank, step=s, loss=10.0 / s, lr=1e-3, tokens=4096,
                                step_time_s=self.step_s, time=ends[s], local_s=self.step_s / 2)
                     for s in new]
            answered[rank] = WorkerStatus(rank=rank, generation=gen, steps=steps,
                                          commits=commits if rank == 0 else [], done=done)
            if new:
                self._held[actor.pid] = (gen, rank, new[-1], len(self.members))
        if new:
            self._reported = new[-1]
        dead = [] if victim is None else [WorkerFailure(
            kind=FailureKind.WORKER_DIED, rank=victim, ranks=(victim,), detected_at=0.0,
            message=f"worker rank {victim} died: the actor died unexpectedly")]
        return answered, dead

    def ack_faults(self, rank: int) -> None:
        """Simulated ranks fire no injected faults."""

    def request_stop(self) -> None:
        """Not simulated: a scale run trains to the end."""

    def remove(self, ranks: tuple[int, ...]) -> None:
        with self._own():
            gone = {self.members[r].pid for r in ranks if 0 <= r < len(self.members)}
            self.members = [a for a in self.members if a.pid not in gone]
            for pid in gone:
                self._held.pop(pid, None)
            self._places = [replace(p, rank=r) for r, p in
                            enumerate(p for p in self._places if p.pid not in gone)]

    def disband(self, after_step: int) -> Disbanded:
        with self._own():
            steps = [self._reported] * len(self.members)
            self.members, self.idle = [], self.members + self.idle
            self._places = []
            return Disbanded(survivor_steps=steps, commits=[], steps=[], silent=[])

    def shutdown(self, *, graceful: bool) -> None:
        """Nothing to end."""
