"""The one fake worker group: a WorkerGroup over fake actors and a fake clock, no Ray, no torch
training. The controller's unit tests script it; bench/scale.py simulates thousands of ranks.

One FakeGroup lives across every generation of the world, as ElasticGroup does. Its cluster
hands out actors (pid, node_ip, node_id) as `top_up` asks for them; `pick` and `form` make a
world of survivors first, then idle actors. Time is a FakeClock that moves only when the group
waits (a poll, a refresh) or the controller sleeps, so every duration is exact and a run of
many polls takes only the CPU it costs. Like the real group it answers with views (pool_view,
poll's PollView, memory_inventory), carries out commands and never calls back into the
controller. It subclasses the real group's abstract base (orchestrator/group.py), so a method
that changes there breaks it here.

- Scripted (`world=`, the tests' FakeWorld): each generation has a Plan. `poll` returns its
  next scripted answer or raises; any method can be told to raise; every call is recorded.
  Actors warm up at the next `refresh`.
- Simulated (no world, bench/scale.py): actors are warm at once; ranks complete a step every
  `step_s`, rank 0 commits every `commit_every` steps, `fail_at` kills a rank at a step (the
  survivors then make no progress, stuck in its collective). The group counts its own time
  (`own_cpu_s`, `own_wall_s`) so that a bench can tell the controller's work from its own.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from stalwart.checkpointing.memory.catalog import MemoryChoice
from stalwart.checkpointing.memory.store import Holding, Inventory
from stalwart.checkpointing.snapshot import ShardLayout
from stalwart.checkpointing.storage.writer import CommitReport
from stalwart.core.config import FaultSpec, JobConfig
from stalwart.core.errors import DeviceUnhealthy
from stalwart.core.events import WorkerPlace
from stalwart.orchestrator import classify
from stalwart.orchestrator.clock import Clock
from stalwart.orchestrator.failures import WorkerFailure
from stalwart.orchestrator.group import Disbanded, PollView, PoolView, WorkerGroup
from stalwart.workers.reports import StepReport, WorkerStatus

if TYPE_CHECKING:
    from stalwart.checkpointing.storage.catalog import CheckpointInfo
    from tests.unit.controller_world import FakeWorld

T0 = 1_700_000_000.0  # the fake clock starts here
POLL_S = 0.5  # a scripted poll takes this long (longer if its reports end later)
REFRESH_S = 0.25  # and so does looking for warm actors
DRIVER_NODE = "node-driver"


def died(rank: int, message: str | None = None) -> WorkerFailure:
    """A rank found dead by a poll, as ElasticGroup reports it."""
    why = message or f"worker rank {rank} died: the actor died unexpectedly"
    return classify.poll_failed(rank, why, now=0.0)


class FakeGroupError(Exception):
    """The controller's `group_error` for this group: it carries a WorkerFailure."""

    def __init__(self, failure: WorkerFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@dataclass
class Poll:
    """One scripted poll: who answered, who was found dead, and what happens meanwhile."""

    answered: list[WorkerStatus] | dict[int, WorkerStatus] = field(default_factory=list)
    dead: list[int | WorkerFailure] = field(default_factory=list)
    hook: Callable[[FakeWorld], None] | None = None
    """Runs while the poll is in flight (Ctrl-C, actors arriving, a node dying...)."""
    advance: float = POLL_S


@dataclass
class Plan:
    """What one generation of a scripted world does."""

    polls: list[Poll | list[WorkerStatus] | BaseException] = field(default_factory=list)
    raise_in: dict[str, BaseException] = field(default_factory=dict)
    """Method name -> exception raised (once) when the group is asked to do it."""
    on_refresh: Callable[[FakeWorld], None] | None = None
    left_with: list[StepReport] = field(default_factory=list)
    """Rank 0's steps that no poll reported, which it returns as the world disbands."""


@dataclass(frozen=True)
class Actor:
    pid: int
    node_id: str = "node-a"
    node_ip: str = "10.0.0.1"

    def place(self, rank: int) -> WorkerPlace:
        return WorkerPlace(rank=rank, pid=self.pid, node_ip=self.node_ip, node_id=self.node_id)


def actors(n: int, *, first_pid: int = 1000, node: str = "node-a", ip: str = "10.0.0.1"
           ) -> list[Actor]:
    return [Actor(pid=first_pid + i, node_id=node, node_ip=ip) for i in range(n)]


def nodes(n: int, per_node: int, *, first_pid: int = 10_000) -> list[Actor]:
    """`n` actors, `per_node` to a node: node k is node-000k at 10.0.k/256.k%256."""
    return [Actor(pid=first_pid + i, node_id=f"node-{i // per_node:04d}",
                  node_ip=f"10.0.{i // per_node // 256}.{i // per_node % 256}")
            for i in range(n)]


@dataclass(frozen=True)
class Call:
    name: str
    state: str
    """The controller's state when the group was asked."""
    generation: int | None
    args: tuple = ()


# A state of one value: whoever holds a step holds all of it.
ONE_VALUE = ShardLayout(
    items=(WriteItem(index=MetadataIndex("train.step"), type=WriteItemType.BYTE_IO),),
    slots={}, planner_data={}, nbytes=0, key="one-value")


def held_in_memory(steps: list[int], holdings: Sequence[Holding] = ()) -> Inventory:
    """An inventory of rank 0's `steps` of generation 0, and any other `holdings`."""
    return Inventory(holdings=(*(Holding(0, 0, s, ONE_VALUE.key) for s in steps), *holdings),
                     layouts={ONE_VALUE.key: ONE_VALUE}, nbytes=0)


class FakeClock(Clock):
    """The controller's clock: it moves only when told to."""

    def __init__(self, now: float = T0) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@dataclass
class Stats:
    """What the run did (a bench reads it; the unit tests check it)."""

    polls: int = 0
    failures_reported: list[tuple[float, float]] = field(default_factory=list)
    """(perf_counter, process_time) right after each poll that reported a dead rank returned."""
    generations: int = 0


@contextmanager
def _own(group: FakeGroup) -> Iterator[None]:
    """Count the time inside as the group's (the simulated workers'), not the controller's."""
    cpu, wall = time.process_time(), time.perf_counter()
    try:
        yield
    finally:
        group.own_cpu_s += time.process_time() - cpu
        group.own_wall_s += time.perf_counter() - wall


class FakeGroup(WorkerGroup):
    """The WorkerGroup over a cluster of fake actors: scripted with `world`, else simulated."""

    MAX_CALLS = 20_000  # a controller that spins without end fails the test instead

    def __init__(self, config: JobConfig, clock: FakeClock, cluster: list[Actor], *,
                 world: FakeWorld | None = None, step_s: float = 0.5, commit_every: int = 50,
                 fail_at: dict[int, int] | None = None) -> None:
        self.config, self.clock, self.world = config, clock, world
        self.driver_node_id = DRIVER_NODE
        self.cluster = list(cluster)
        """Actors the cluster can still place, in the order it places them."""
        self.unplaced = 0
        """Actors asked for that wait for room (Ray's queue)."""
        self.starting: list[Actor] = []
        self.idle: list[Actor] = []
        self.members: list[Actor] = []
        self.killed: list[Actor] = []
        self.dead_nodes: set[str] = set()  # a scripted poll reports these nodes gone
        self.cannot_leave: set[int] = set()  # pids that fail to leave at the next disband
        self.silent: set[int] = set()  # pids that do not answer at all at the next disband
        self.bad_devices: dict[int, str] = {}  # pid -> why its device fails the warm-up check
        self.unhealthy: list[WorkerFailure] = []  # dropped for it, until take_unhealthy
        self.armed: dict[int, dict[int, list[FaultSpec]]] = {}  # generation -> rank ->
        self.memory: dict[int, list[int]] = {}  # pid -> steps its memory tier holds (scripted)
        self.generation = -1
        self.stats = Stats()
        self.own_cpu_s = 0.0
        self.own_wall_s = 0.0
        self.step_s, self.commit_every = step_s, commit_every
        self.fail_at = dict(fail_at or {})
        """Step -> the rank that dies at it (each fires once; simulated)."""
        self._steps: dict[int, int] = {}  # pid -> engine step in this generation
        self._start_step = 0  # the step this world restored
        self._launched_at: float | None = None
        self._reported = 0  # the newest step every rank has reported (simulated)
        self._broken = False  # a rank died: the survivors make no progress (simulated)
        # pid -> (generation, rank, step, world size) of the newest snapshot it holds
        self._held: dict[int, tuple[int, int, int, int]] = {}

    # -- a scripted world's bookkeeping

    def _state_generation(self) -> int | None:
        return getattr(self.world.controller.state, "generation", None)

    def _plan(self) -> Plan | None:
        if self.world is None:
            return None
        gen = self._state_generation()
        return self.world.plans[gen] if gen is not None and gen < len(self.world.plans) else None

    def _record(self, name: str, *args: Any) -> None:
        if self.world is None:
            return
        calls = self.world.calls
        calls.append(Call(name, self.world.controller.state.name, self._state_generation(), args))
        if len(calls) > self.MAX_CALLS:
            raise AssertionError("the controller keeps calling the group: an endless loop?")

    def _maybe_raise(self, name: str) -> None:
        plan = self._plan()
        exc = plan.raise_in.pop(name, None) if plan else None
        if isinstance(exc, FakeGroupError):  # the group notices now
            exc = FakeGroupError(dataclasses.replace(exc.failure, detected_at=self.clock.now))
        if exc is not None:
            raise exc

    def _call(self, name: str, *args: Any) -> None:
        self._record(name, *args)
        self._maybe_raise(name)

    # -- the pool

    @property
    def world_size(self) -> int:
        return len(self.members)

    def top_up(self, *, spares: bool = True) -> None:
        self._call("top_up", *(() if spares else (False,)))
        with _own(self):
            sc = self.config.scaling
            have = len(self.members) + len(self.idle) + len(self.starting) + self.unplaced
            self.unplaced += max(0, sc.ceiling + (sc.spare_workers if spares else 0) - have)
            self._place()

    def _place(self) -> None:
        """Place waiting actors while the cluster has room: a simulated one is warm at once."""
        placed, self.cluster = self.cluster[:self.unplaced], self.cluster[self.unplaced:]
        self.unplaced -= len(placed)
        (self.starting if self.world else self.idle).extend(placed)

    def refresh(self, timeout: float = 0.0) -> None:
        """A scripted refresh waits `timeout` + REFRESH_S, and placed actors warm up within
        it; a simulated one has nothing to wait for."""
        self._call("refresh", timeout)
        if self.world is None:
            return
        plan = self._plan()
        if plan is not None and plan.on_refresh is not None:
            plan.on_refresh(self.world)
        self.clock.now += timeout + REFRESH_S
        self._place()
        for a in [a for a in self.starting if a.pid in self.bad_devices]:  # as ElasticGroup
            cause = DeviceUnhealthy("cuda:0", [self.bad_devices[a.pid]], a.node_ip, a.pid)
            self.unhealthy.append(classify.warm_up_failed(cause, self.clock.now))
            self.killed.append(a)
            self.starting.remove(a)
        self.idle += self.starting
        self.starting = []

    def take_unhealthy(self) -> list[WorkerFailure]:
        found, self.unhealthy = self.unhealthy, []
        return found

    def pool_view(self) -> PoolView:
        with _own(self):
            available = len(self.members) + len(self.idle)
        return PoolView(available=available, placed_starting=len(self.starting),
                        best_world=self.best_world())

    def best_world(self) -> int:
        with _own(self):
            available = len(self.members) + len(self.idle)
        return self.config.largest_world(min(self.config.scaling.ceiling, available))

    def draining_nodes(self) -> frozenset[str]:
        return frozenset(self.world.draining if self.world else ())

    # -- one generation

    def pick(self, world_size: int, generation: int) -> list[WorkerPlace]:
        self._record("pick", world_size, generation)
        with _own(self):
            pool = self.members + self.idle
            assert len(pool) >= world_size, f"pick({world_size}) with {len(pool)} warm actors"
            self.members, self.idle = pool[:world_size], pool[world_size:]
            self.generation = generation
            self._steps = {a.pid: 0 for a in self.members}
            self._start_step = 0
            self.stats.generations += 1
            return self.places()

    def form(self, armed: Mapping[int, Sequence[FaultSpec]]) -> None:
        self._record("form")
        self.armed[self.generation] = {r: list(f) for r, f in armed.items()}
        self._maybe_raise("form")

    def places(self) -> list[WorkerPlace]:
        return [a.place(r) for r, a in enumerate(self.members)]

    def _restored(self, step: int) -> int:
        self._steps = {pid: step for pid in self._steps}
        self._start_step = step
        return step

    def restore(self, checkpoint: CheckpointInfo) -> int:
        """As the ranks do: every file checked against the manifest as it is read (a
        checkpoint a test made up, with no manifest, has no files to check)."""
        from stalwart.checkpointing.storage.catalog import verify_files

        self._call("restore", checkpoint.path)
        if checkpoint.manifest:
            verify_files(checkpoint)
        return self._restored(int(checkpoint.path.rsplit("_", 1)[-1]))

    def memory_inventory(self) -> dict[str, Inventory]:
        """A scripted actor holds the steps in `memory` (all of a 1-rank world's state); a
        simulated member its own newest snapshot and its left neighbour's replica."""
        self._call("memory_inventory")
        with _own(self):
            out = {}
            for a in self.members + self.idle:
                held = self._held.get(a.pid)
                replicas = () if held is None else (
                    Holding(held[0], held[1], held[2], ONE_VALUE.key),
                    Holding(held[0], (held[1] - 1) % held[3], held[2], ONE_VALUE.key))
                out[f"pid-{a.pid}"] = held_in_memory(self.memory.get(a.pid, []), replicas)
            return out

    def restore_memory(self, choice: MemoryChoice) -> tuple[int, list[list[int]]]:
        self._call("restore_memory", choice.step)
        return self._restored(choice.step), [[] for _ in self.members]

    def launch(self, *, restored: bool) -> None:
        self._call("launch", *((True,) if restored else ()))
        self._launched_at = self.clock.now
        self._reported = self._start_step
        self._broken = False

    def settle(self) -> None:
        self._call("settle")

    def poll(self, wait_s: float) -> PollView:
        self._call("poll")
        if self.world is None:  # the real group's node agents answer as the interval ends
            self.clock.now += wait_s
        with _own(self):
            answered, dead = self._scripted() if self.world else self._simulated()
            for r, st in answered.items():
                pid = self.members[r].pid
                self._steps[pid] = max([self._steps.get(pid, 0), *(s.step for s in st.steps)])
            # The group's node view: of the nodes under the ranks found, those that are gone.
            lost = {self.members[r].node_id for f in dead for r in f.failed_ranks
                    if r < len(self.members)} & self.dead_nodes
            self.stats.polls += 1
        if dead:
            self.stats.failures_reported.append((time.perf_counter(), time.process_time()))
        return PollView(answered=answered, dead=dead, lost_nodes=frozenset(lost))

    def _scripted(self) -> tuple[dict[int, WorkerStatus], tuple[WorkerFailure, ...]]:
        """The plan's next poll; the clock moves on to its newest step's end."""
        plan = self._plan()
        if plan is None or not plan.polls:
            raise AssertionError(f"generation {self._state_generation()} polled past its script")
        item = plan.polls.pop(0)
        if isinstance(item, BaseException):
            raise item
        if not isinstance(item, Poll):
            item = Poll(answered=item)
        if item.hook is not None:
            item.hook(self.world)
        answered = item.answered if isinstance(item.answered, dict) else {
            st.rank: st for st in item.answered}
        answered = {r: dataclasses.replace(st, generation=self.generation)
                    for r, st in answered.items()}
        self.clock.now += item.advance
        self.clock.now = max([self.clock.now, *(s.time for st in answered.values()
                                                for s in st.steps)])
        return answered, tuple(died(d) if isinstance(d, int) else d for d in item.dead)

    def _simulated(self) -> tuple[dict[int, WorkerStatus], tuple[WorkerFailure, ...]]:
        """Every rank's steps completed since the last poll (rank 0's commits), up to a step
        at which `fail_at` kills a rank."""
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
        gen = self.generation
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
        if victim is None:
            return answered, ()
        why = "the actor died unexpectedly"
        return answered, (classify.actor_died(victim, why, now=self.clock.now),)

    def request_stop(self) -> None:
        self._call("request_stop")

    def ack_faults(self, rank: int) -> None:
        self._call("ack_faults", rank)

    def remove(self, ranks: tuple[int, ...]) -> None:
        self._call("remove", ranks)
        with _own(self):
            gone = [self.members[r] for r in ranks if 0 <= r < len(self.members)]
            self.killed += gone
            for a in gone:
                self._held.pop(a.pid, None)
            self.members = [a for r, a in enumerate(self.members) if r not in ranks]

    def exclude_nodes(self, node_ids: frozenset[str]) -> None:
        self._call("exclude_nodes", node_ids)

    def disband(self, after_step: int) -> Disbanded:
        self._call("disband")
        with _own(self):
            out = self.cannot_leave | self.silent
            survivors = [a for a in self.members if a.pid not in out]
            self.killed += [a for a in self.members if a.pid in out]
            steps = [self._steps.get(a.pid, 0) for a in survivors]
            silent = [a.pid for a in self.members if a.pid in self.silent]
            self.members, self.idle = [], survivors + self.idle
            plan = self._plan()
            late = [r for r in (plan.left_with if plan else []) if r.step > after_step]
            return Disbanded(survivor_steps=steps, commits=[], steps=late, silent=silent)

    def shutdown(self, *, graceful: bool) -> None:
        self._record("shutdown", graceful)

    # -- for the tests

    def unused_polls(self) -> dict[int, int]:
        return {g: len(p.polls) for g, p in enumerate(self.world.plans) if p.polls}
