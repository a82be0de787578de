"""The one fake worker group of the unit tests: a WorkerGroup over a scripted cluster.

One FakeGroup lives across every generation of the world, as ElasticGroup does. A scripted
cluster hands out fake actors (pid, node_ip, node_id) as `top_up` asks for them; `refresh`
warms them; `form` makes a world of survivors first, then idle actors. Each generation has a
Plan: `poll` returns its next scripted (answered, dead) pair or raises a scripted
FakeGroupError (the controller's `group_error`), and any method can be told to raise.
Like the real group it answers with views (pool_view, poll's PollView, memory_inventory) and
carries out commands; it never calls back into the controller.

It subclasses the real group's abstract base (orchestrator/group.py), so a method that
changes there breaks it here. Time is a FakeClock that moves only when the fake group waits
(a poll: POLL_S, or up to the end of the newest step it reports; a refresh: REFRESH_S) or
the controller sleeps, so every duration in the tests is exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from stalwart.checkpointing.memory.catalog import MemoryChoice
from stalwart.checkpointing.memory.store import Holding, Inventory
from stalwart.checkpointing.snapshot import ShardLayout
from stalwart.core.config import FaultSpec
from stalwart.core.errors import ConfigError
from stalwart.core.events import WorkerPlace
from stalwart.orchestrator import classify
from stalwart.orchestrator.clock import Clock
from stalwart.orchestrator.failures import WorkerFailure
from stalwart.orchestrator.group import Disbanded, PollView, PoolView, WorkerGroup
from stalwart.workers.reports import StepReport, WorkerStatus

if TYPE_CHECKING:
    from tests.unit.controller_world import FakeWorld

POLL_S = 0.5  # a poll takes this long on the fake clock (longer if its reports end later)
REFRESH_S = 0.25  # and so does looking for warm actors
DRIVER_NODE = "node-driver"

def died(rank: int, message: str | None = None) -> WorkerFailure:
    """A rank found dead by a poll, as ElasticGroup reports it."""
    return classify.poll_failed(rank, message or f"worker rank {rank} died: the actor died "
                                                 f"unexpectedly", now=0.0)


class FakeGroupError(Exception):
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
    """What one generation of the world does."""

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

    @property
    def info(self) -> dict[str, Any]:
        return {"pid": self.pid, "node_ip": self.node_ip, "node_id": self.node_id}


def actors(n: int, *, first_pid: int = 1000, node: str = "node-a", ip: str = "10.0.0.1"
           ) -> list[Actor]:
    return [Actor(pid=first_pid + i, node_id=node, node_ip=ip) for i in range(n)]


@dataclass(frozen=True)
class Call:
    name: str
    state: str
    """The controller's state when the group was asked."""
    generation: int | None
    args: tuple = ()



# A state of one value: whoever holds a step holds all of it.
ONE_VALUE = ShardLayout(items=(WriteItem(index=MetadataIndex("train.step"), type=WriteItemType.BYTE_IO),),
                   slots={}, planner_data={}, nbytes=0, key="one-value")


def held_in_memory(steps: list[int]) -> Inventory:
    return Inventory(holdings=tuple(Holding(0, 0, s, ONE_VALUE.key) for s in steps),
                     layouts={ONE_VALUE.key: ONE_VALUE}, nbytes=0)



class FakeClock(Clock):
    """The controller's clock in tests: it moves only when told to."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class FakeGroup(WorkerGroup):
    """The WorkerGroup over a scripted cluster of fake actors."""

    MAX_CALLS = 20_000  # a controller that spins without end fails the test instead

    def __init__(self, world: FakeWorld, cluster: list[Actor]) -> None:
        self.w = world
        self.driver_node_id = DRIVER_NODE
        self.cluster = list(cluster)
        """Actors the cluster can still place, in the order it places them."""
        self.unplaced = 0
        """Actors asked for that wait for room (Ray's queue)."""
        self.starting: list[Actor] = []
        self.idle: list[Actor] = []
        self.members: list[Actor] = []
        self.killed: list[Actor] = []
        self.dead_nodes: set[str] = set()
        self.cannot_leave: set[int] = set()  # pids that fail to leave at the next disband
        self.silent: set[int] = set()  # pids that do not answer at all at the next disband
        self.armed: dict[int, dict[int, list[FaultSpec]]] = {}  # generation ->
        self.generation = -1
        self._steps: dict[int, int] = {}  # pid -> engine step in this generation
        self.memory: dict[int, list[int]] = {}  # pid -> steps its memory tier holds

    # -- bookkeeping

    def _generation(self) -> int | None:
        return getattr(self.w.controller.state, "generation", None)

    def _plan(self) -> Plan | None:
        gen = self._generation()
        return self.w.plans[gen] if gen is not None and gen < len(self.w.plans) else None

    def _record(self, name: str, *args: Any) -> None:
        self.w.calls.append(Call(name, self.w.controller.state.name, self._generation(), args))
        if len(self.w.calls) > self.MAX_CALLS:
            raise AssertionError("the controller keeps calling the group: an endless loop?")

    def _maybe_raise(self, name: str) -> None:
        plan = self._plan()
        exc = plan.raise_in.pop(name, None) if plan else None
        if isinstance(exc, FakeGroupError):  # the group notices now
            exc = FakeGroupError(dataclasses.replace(exc.failure, detected_at=self.w.clock.now))
        if exc is not None:
            raise exc

    def _call(self, name: str, *args: Any) -> None:
        self._record(name, *args)
        self._maybe_raise(name)

    def _kill(self, actor: Actor) -> None:
        self.killed.append(actor)

    # -- the pool

    @property
    def world_size(self) -> int:
        return len(self.members)

    def top_up(self, *, spares: bool = True) -> None:
        self._call("top_up", *(() if spares else (False,)))
        sc = self.w.config.scaling
        have = len(self.members) + len(self.idle) + len(self.starting) + self.unplaced
        self.unplaced += max(0, sc.ceiling + (sc.spare_workers if spares else 0) - have)
        self._place()

    def _place(self) -> None:
        while self.unplaced and self.cluster:
            self.starting.append(self.cluster.pop(0))
            self.unplaced -= 1

    def refresh(self, timeout: float = 0.0) -> None:
        self._call("refresh", timeout)
        plan = self._plan()
        if plan is not None and plan.on_refresh is not None:
            plan.on_refresh(self.w)
        self.w.clock.now += timeout + REFRESH_S
        self._place()
        self.idle += self.starting  # placed actors warm up within one refresh here
        self.starting = []

    def pool_view(self) -> PoolView:
        return PoolView(available=len(self.members) + len(self.idle),
                        placed_starting=len(self.starting), best_world=self._best_world())

    def draining_nodes(self) -> frozenset[str]:
        return frozenset(self.w.draining)

    def _best_world(self) -> int:
        n = min(self.w.config.scaling.ceiling, len(self.members) + len(self.idle))
        valid = []
        for size in range(1, n + 1):
            try:
                self.w.config._check_world(size)
            except ConfigError:
                continue
            valid.append(size)
        return valid[-1] if valid else 0

    # -- one generation

    def pick(self, world_size: int, generation: int) -> list[WorkerPlace]:
        self._record("pick", world_size, generation)
        pool = self.members + self.idle
        assert len(pool) >= world_size, f"pick({world_size}) with {len(pool)} warm actors"
        self.members, self.idle = pool[:world_size], pool[world_size:]
        self.generation = generation
        self._steps = {a.pid: 0 for a in self.members}
        return self.places()

    def form(self, armed: Mapping[int, Sequence[FaultSpec]]) -> None:
        self._record("form")
        self.armed[self.generation] = {r: list(f) for r, f in armed.items()}
        self._maybe_raise("form")

    def places(self) -> list[WorkerPlace]:
        return [WorkerPlace(rank=r, **a.info) for r, a in enumerate(self.members)]

    def restore(self, path: str) -> int:
        self._call("restore", path)
        step = int(path.rsplit("_", 1)[-1])
        self._steps = {pid: step for pid in self._steps}
        return step

    def memory_inventory(self) -> dict[str, Inventory]:
        """Each warm actor holds the steps in `memory` (all of a 1-rank world's state)."""
        self._call("memory_inventory")
        return {f"pid-{a.pid}": held_in_memory(self.memory.get(a.pid, []))
                for a in self.members + self.idle}

    def restore_memory(self, choice: MemoryChoice) -> tuple[int, list[list[int]]]:
        self._call("restore_memory", choice.step)
        self._steps = {pid: choice.step for pid in self._steps}
        return choice.step, [[] for _ in self.members]

    def launch(self, *, restored: bool) -> None:
        self._call("launch", *((True,) if restored else ()))

    def settle(self) -> None:
        self._call("settle")

    def poll(self, wait_s: float) -> PollView:
        self._call("poll")
        plan = self._plan()
        if plan is None or not plan.polls:
            raise AssertionError(f"generation {self._generation()} polled past its script")
        item = plan.polls.pop(0)
        if isinstance(item, BaseException):
            raise item
        if not isinstance(item, Poll):
            item = Poll(answered=item)
        if item.hook is not None:
            item.hook(self.w)
        answered = item.answered if isinstance(item.answered, dict) else {
            st.rank: st for st in item.answered}
        answered = {r: dataclasses.replace(st, generation=self.generation)
                    for r, st in answered.items()}
        self.w.clock.now += item.advance
        ends = [s.time for st in answered.values() for s in st.steps]
        self.w.clock.now = max([self.w.clock.now, *ends])
        for r, st in answered.items():
            pid = self.members[r].pid
            self._steps[pid] = max([self._steps.get(pid, 0), *(s.step for s in st.steps)])
        dead = tuple(died(d) if isinstance(d, int) else d for d in item.dead)
        # The group's node view: of the nodes under the ranks found, those that are gone.
        nodes = {self.members[r].node_id for f in dead for r in f.failed_ranks
                 if r < len(self.members)}
        return PollView(answered=answered, dead=dead,
                        lost_nodes=frozenset(nodes & self.dead_nodes))

    def request_stop(self) -> None:
        self._call("request_stop")

    def ack_faults(self, rank: int) -> None:
        self._call("ack_faults", rank)

    def remove(self, ranks: tuple[int, ...]) -> None:
        self._call("remove", ranks)
        for r in ranks:
            if 0 <= r < len(self.members):
                self._kill(self.members[r])
        self.members = [a for r, a in enumerate(self.members) if r not in ranks]

    def disband(self, after_step: int) -> Disbanded:
        self._call("disband")
        survivors = [a for a in self.members if a.pid not in self.cannot_leave | self.silent]
        for a in self.members:
            if a.pid in self.cannot_leave | self.silent:
                self._kill(a)
        steps = [self._steps.get(a.pid, 0) for a in survivors]
        silent = [a.pid for a in self.members if a.pid in self.silent]
        self.members, self.idle = [], survivors + self.idle
        plan = self._plan()
        late = [r for r in (plan.left_with if plan else []) if r.step > after_step]
        return Disbanded(survivor_steps=steps, commits=[], steps=late, silent=silent)

    def describe(self) -> list[WorkerPlace]:
        return [WorkerPlace(rank=r, **a.info) for r, a in enumerate(self.members)]

    def shutdown(self, *, graceful: bool) -> None:
        self._record("shutdown", graceful)

    # -- for the tests

    def unused_polls(self) -> dict[int, int]:
        return {g: len(p.polls) for g, p in enumerate(self.w.plans) if p.polls}
