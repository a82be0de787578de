"""The controller driven step by step by a fake elastic worker group.

One FakeGroup lives across every generation of the world, as ElasticGroup does. A scripted
cluster hands out fake actors (pid, node_ip, node_id) as `top_up` asks for them; `refresh`
warms them; `form` makes a world of survivors first, then idle actors. Each generation has a
Plan: `poll` returns its next scripted (answered, dead) pair or raises a scripted
FakeGroupError (the controller's `group_error`), and any method can be told to raise.

The controller's clock (`time` in its module) is a FakeClock that moves only when the fake
group waits (a poll: POLL_S, or up to the end of the newest step it reports; a refresh:
REFRESH_S) or the controller sleeps, so every duration below is exact. The event log, the
metrics file and the checkpoint catalog are the real ones, under tmp_path.
"""

from __future__ import annotations

import dataclasses
import itertools
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from stalwart.checkpointing.memory.catalog import MemoryChoice
from stalwart.checkpointing.memory.store import Holding, Inventory
from stalwart.checkpointing.snapshot import ShardLayout
from stalwart.checkpointing.storage.catalog import CheckpointInfo
from stalwart.checkpointing.storage.layout import join, step_dir_name
from stalwart.config import FaultSpec, JobConfig, load_config, parse_fault
from stalwart.errors import ConfigError
from stalwart.events import WorkerPlace
from stalwart.orchestrator import controller as controller_module
from stalwart.orchestrator.controller import Controller
from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.orchestrator.states import Failed, Finished, State, Stopped
from stalwart.run_dir import EventLog, MetricsLog, read_jsonl
from stalwart.workers.faults import FaultFired
from stalwart.workers.reports import CommitReport, StepReport, WorkerStatus

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

T0 = 1_700_000_000.0  # the fake clock starts here; step n of generation 0 ends at T0 + n
T1 = T0 + 100.0  # ... and step n of a later generation at T1 + n (T2, T3 likewise)
T2 = T0 + 200.0
T3 = T0 + 300.0
POLL_S = 0.5  # a poll takes this long on the fake clock (longer if its reports end later)
REFRESH_S = 0.25  # and so does looking for warm actors
WORLD = 2
TOKENS = 1000
DRIVER_NODE = "node-driver"
COLLECTIVE_ERROR = ("Traceback (most recent call last):\n  ...\n"
                    "torch.distributed.DistBackendError: Connection closed by peer")
USER_ERROR = "Traceback (most recent call last):\n  ...\nValueError: bad batch"


# ---------------------------------------------------------------------------- scripts


def report(step: int, rank: int = 0, val_loss: float | None = None, t0: float = T0
           ) -> StepReport:
    return StepReport(rank=rank, step=step, loss=10.0 / step, lr=1e-3 * step, tokens=TOKENS,
                      step_time_s=0.1, time=t0 + step, val_loss=val_loss)


def status(rank: int, steps: range | list[int] = (), *, t0: float = T0,
           commits: list[int] = (), done: bool = False, stopped_early: bool = False,
           error: str | None = None, error_kind: str | None = None,
           faults: list[FaultFired] = (), preempted: bool = False) -> WorkerStatus:
    """One rank's answer to a poll (the fake group stamps the generation)."""
    return WorkerStatus(rank=rank, generation=-1, steps=[report(s, rank, t0=t0) for s in steps],
                        commits=[CommitReport(step=c, path=join("/ckpt", step_dir_name(c)),
                                              save_s=0.25) for c in commits],
                        done=done, stopped_early=stopped_early and done, error=error,
                        error_kind=error_kind, faults=list(faults), preempted=preempted)


def statuses(steps: range | list[int], *, world: int = WORLD, commits: list[int] = (),
             done: bool = False, stopped_early: bool = False, t0: float = T0,
             preempted: tuple[int, ...] = ()) -> list[WorkerStatus]:
    """Every rank's status; rank 0 carries the commits (it commits for everyone)."""
    return [status(r, steps, t0=t0, commits=commits if r == 0 else [], done=done,
                   stopped_early=stopped_early, preempted=r in preempted)
            for r in range(world)]


def died(rank: int, message: str | None = None) -> WorkerFailure:
    """A rank found dead by a poll, as ElasticGroup reports it."""
    return WorkerFailure(kind=FailureKind.WORKER_DIED, rank=rank, ranks=(rank,),
                         message=message or f"worker rank {rank} died: the actor died "
                                            f"unexpectedly", detected_at=0.0)


class FakeGroupError(Exception):
    def __init__(self, failure: WorkerFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def group_error(kind: FailureKind = FailureKind.WORKER_DIED, *, rank: int | None = 1,
                message: str = "worker rank 1 died: the actor died unexpectedly"
                ) -> FakeGroupError:
    ranks = () if rank is None else (rank,)
    return FakeGroupError(WorkerFailure(kind=kind, rank=rank, ranks=ranks, message=message,
                                        detected_at=0.0))


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


# ---------------------------------------------------------------------------- fakes

# A state of one value: whoever holds a step holds all of it.
ONE_VALUE = ShardLayout(items=(WriteItem(index=MetadataIndex("train.step"), type=WriteItemType.BYTE_IO),),
                   slots={}, planner_data={}, nbytes=0, key="one-value")


def held_in_memory(steps: list[int]) -> Inventory:
    return Inventory(holdings=tuple(Holding(0, 0, s, ONE_VALUE.key) for s in steps),
                     layouts={ONE_VALUE.key: ONE_VALUE}, nbytes=0)



class FakeClock:
    """Stands in for the `time` module inside orchestrator/controller.py."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class FakeGroup:
    """The WorkerGroup protocol over a scripted cluster of fake actors."""

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

    def top_up(self) -> None:
        self._call("top_up")
        sc = self.w.config.scaling
        have = len(self.members) + len(self.idle) + len(self.starting) + self.unplaced
        self.unplaced += max(0, sc.ceiling + sc.spare_workers - have)
        self._place()

    def _place(self) -> None:
        while self.unplaced and self.cluster:
            self.starting.append(self.cluster.pop(0))
            self.unplaced -= 1

    def nodes_alive(self, node_ids: set[str]) -> bool:
        return not (node_ids & self.dead_nodes)

    def refresh(self, timeout: float = 0.0) -> None:
        self._call("refresh", timeout)
        plan = self._plan()
        if plan is not None and plan.on_refresh is not None:
            plan.on_refresh(self.w)
        self.w.clock.now += timeout + REFRESH_S
        self._place()
        self.idle += self.starting  # placed actors warm up within one refresh here
        self.starting = []

    def placed_starting(self) -> int:
        return len(self.starting)

    def available(self) -> int:
        return len(self.members) + len(self.idle)

    def best_world(self, up_to: int | None = None) -> int:
        n = min(self.w.config.scaling.ceiling, self.available() if up_to is None else up_to)
        valid = []
        for size in range(1, n + 1):
            try:
                self.w.config._check_world(size)
            except ConfigError:
                continue
            valid.append(size)
        return valid[-1] if valid else 0

    # -- one generation

    def form(self, world_size: int, generation: int,
             arm: Callable[[list[WorkerPlace]], dict[int, list[FaultSpec]]]
             ) -> list[WorkerPlace]:
        self._record("form", world_size, generation)
        pool = self.members + self.idle
        assert len(pool) >= world_size, f"form({world_size}) with {len(pool)} warm actors"
        self.members, self.idle = pool[:world_size], pool[world_size:]
        self.generation = generation
        self._steps = {a.pid: 0 for a in self.members}
        workers = [WorkerPlace(rank=r, **a.info) for r, a in enumerate(self.members)]
        self.armed[generation] = arm(workers)
        self._maybe_raise("form")
        return workers

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

    def finish_restore(self) -> None:
        self._call("finish_restore")

    def launch(self) -> None:
        self._call("launch")

    def poll(self, wait_s: float) -> tuple[dict[int, WorkerStatus], list[WorkerFailure]]:
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
        dead = [died(d) if isinstance(d, int) else d for d in item.dead]
        return answered, dead

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

    def disband(self) -> tuple[list[int], list]:
        self._call("disband")
        survivors = [a for a in self.members if a.pid not in self.cannot_leave]
        for a in self.members:
            if a.pid in self.cannot_leave:
                self._kill(a)
        steps = [self._steps.get(a.pid, 0) for a in survivors]
        self.members, self.idle = [], survivors + self.idle
        return steps, []

    def describe(self) -> list[WorkerPlace]:
        return [WorkerPlace(rank=r, **a.info) for r, a in enumerate(self.members)]

    def shutdown(self, *, graceful: bool) -> None:
        self._record("shutdown", graceful)

    # -- for the tests

    def unused_polls(self) -> dict[int, int]:
        return {g: len(p.polls) for g, p in enumerate(self.w.plans) if p.polls}


class FakeDisplay:
    def __init__(self) -> None:
        self.updates: list[tuple[int, float | None]] = []
        self.logs: list[str] = []

    def update(self, report: StepReport, tokens_per_s: float | None) -> None:
        self.updates.append((report.step, tokens_per_s))

    def log(self, message: str) -> None:
        self.logs.append(message)


CORE_EVENTS = {"started", "checkpoint_committed", "checkpoint_skipped", "failure", "recovered",
               "finished", "stopped", "resized", "fault_injected", "fault_skipped"}


class FakeWorld:
    """A Controller over one FakeGroup, a fake clock and a real run directory."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plans: list[Plan],
                 overrides: list[str] = (), *, resume_from: CheckpointInfo | None = None,
                 storage: Path | None = None, cluster: list[Actor] | None = None,
                 faults: list[str] = ()) -> None:
        self.plans = plans
        self.calls: list[Call] = []
        self.transitions: list[tuple[str, str]] = []
        self.draining: set[str] = set()
        self.clock = FakeClock(T0)
        monkeypatch.setattr(controller_module, "time", self.clock)
        real = controller_module.check_transition

        def spy(old: State, new: State) -> None:
            self.transitions.append((old.name, new.name))
            real(old, new)

        monkeypatch.setattr(controller_module, "check_transition", spy)
        self.display = FakeDisplay()
        self.events_path = tmp_path / "events.jsonl"
        self.metrics_path = tmp_path / "metrics.jsonl"
        self.storage = storage or tmp_path / "checkpoints"
        self.storage.mkdir(exist_ok=True)
        config: JobConfig = load_config(None, [
            "train.steps=6", "train.warmup_steps=0", "run.log_every=2", *overrides])
        if faults:
            config = dataclasses.replace(config, faults=tuple(parse_fault(f) for f in faults))
        self.config = config
        self.group = FakeGroup(self, actors(8) if cluster is None else cluster)
        self.controller = Controller(
            config, storage_url=str(self.storage), group=self.group,
            group_error=FakeGroupError, events=EventLog(self.events_path),
            metrics=MetricsLog(self.metrics_path), display=self.display,
            resume_from=resume_from, draining_nodes=lambda: set(self.draining))

    def run(self) -> State:
        return self.controller.run()

    # -- what happened

    @property
    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.events_path)

    def kinds(self) -> list[str]:
        """The kinds of event these tests are about, in order (others may be added freely)."""
        return [e["kind"] for e in self.events if e["kind"] in CORE_EVENTS]

    def event(self, kind: str) -> dict[str, Any]:
        (found,) = self.all(kind)
        return found

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    def rows(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def named(self, *names: str) -> list[Call]:
        return [c for c in self.calls if c.name in names]

    def shutdowns(self) -> list[bool]:
        return [c.args[0] for c in self.named("shutdown")]

    def members(self, generation: int) -> list[int]:
        """Pids of the ranks of a generation, in rank order."""
        (started,) = [e for e in self.all("workers_started") if e["generation"] == generation]
        return [w["pid"] for w in started["workers"]]

    def killed(self) -> list[int]:
        return [a.pid for a in self.group.killed]

    def commit(self, step: int) -> None:
        """Write a real, committed checkpoint, as the workers do when they report a commit."""
        _commit_checkpoint(self.storage, step)

    @staticmethod
    def path(*states: str) -> list[tuple[str, str]]:
        return list(itertools.pairwise(states))


def _commit_checkpoint(storage: Path, step: int) -> None:
    from stalwart.checkpointing.storage.writer import write_manifest

    d = storage / step_dir_name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(200)) * (step + 1))
    (d / ".metadata").write_bytes(b"meta")
    write_manifest(str(storage), step, {"world_size": WORLD})


def ctrl_c(w: FakeWorld) -> None:
    """What the first Ctrl-C does (the SIGINT handler sets this flag)."""
    w.controller._stop_requested = True


@pytest.fixture(autouse=True)
def no_poll_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Controller, "POLL_INTERVAL_S", 0)


HAPPY = ["SCHEDULING", "RENDEZVOUS", "RESTORING", "RUNNING", "FINISHED"]
PHASES = {"detect", "teardown", "wait", "join", "restore", "first_step"}
HANG_LIMIT = ["failure.hang_timeout_floor_s=2", "failure.hang_factor=1"]  # limit: 2 s


# ---------------------------------------------------------------------------- normal runs


def test_normal_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        statuses([1, 2]),
        statuses([], commits=[]),  # a poll with nothing new
        statuses([3, 4], commits=[4]),
        statuses([5, 6], done=True),
    ])])
    final = w.run()

    assert final == Finished(step=6)
    assert w.transitions == w.path(*HAPPY)
    # each method ran in the state that owns it; no restore without a checkpoint
    assert [(c.name, c.state) for c in w.calls] == [
        ("top_up", "SCHEDULING"), ("refresh", "SCHEDULING"), ("form", "RENDEZVOUS"),
        ("launch", "RESTORING"), ("poll", "RUNNING"), ("poll", "RUNNING"), ("poll", "RUNNING"),
        ("poll", "RUNNING"), ("shutdown", "FINISHED")]
    assert w.named("form")[0].args == (2, 0)
    assert w.shutdowns() == [True]
    assert w.group.unused_polls() == {}

    assert w.kinds() == ["started", "checkpoint_committed", "finished"]
    started = w.event("started")
    assert started["world_size"] == 2 and started["steps"] == 6 and started["start_step"] == 0
    assert started["task"] == "stalwart.examples.gpt.task:GPTTask"
    workers = w.event("workers_started")
    assert workers["generation"] == 0 and workers["world_size"] == 2
    assert workers["workers"] == [
        {"pid": 1000, "node_ip": "10.0.0.1", "node_id": "node-a", "rank": 0},
        {"pid": 1001, "node_ip": "10.0.0.1", "node_id": "node-a", "rank": 1}]
    committed = w.event("checkpoint_committed")
    assert committed["step"] == 4 and committed["save_s"] == 0.25
    assert committed["path"] == join("/ckpt", "step_000000004")
    finished = w.event("finished")
    assert finished["step"] == 6 and finished["loss"] == pytest.approx(10.0 / 6)
    assert finished["val_loss"] is None
    assert all(isinstance(e["time"], float) for e in w.events)

    rows = w.rows()
    assert [r["step"] for r in rows] == [2, 4, 6]  # log_every=2
    for r in rows:
        # (a subset: the row may carry more, e.g. samples_seen, being added as this is written)
        assert {"step", "loss", "lr", "tokens_per_s", "world_size", "time"} <= set(r)
        assert r["loss"] == pytest.approx(10.0 / r["step"])
        assert r["lr"] == pytest.approx(1e-3 * r["step"])
        assert r["world_size"] == 2 and r["time"] == T0 + r["step"]
    # two steps of TOKENS tokens over the two seconds since the last row
    assert rows[1]["tokens_per_s"] == rows[2]["tokens_per_s"] == TOKENS
    # the first window starts where the world's first step started (1.1 s for 2 steps)
    assert rows[0]["tokens_per_s"] == pytest.approx(2 * TOKENS / 1.1, abs=0.1)

    # the display saw every step, with a rate on the logged ones only
    assert [s for s, _ in w.display.updates] == [1, 2, 3, 4, 5, 6]
    assert [s for s, rate in w.display.updates if rate is not None] == [2, 4, 6]
    c = w.controller
    assert c.last_step == 6 and c.last_loss == pytest.approx(10.0 / 6)
    assert c.tokens_total == 6 * TOKENS and c.train_time_s == pytest.approx(5.1)


def test_last_step_and_val_loss_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # steps=5 is not a multiple of log_every=2: the last step is logged anyway; a val loss
    # forces a row too
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        [WorkerStatus(rank=r, generation=0,
                      steps=[report(1, r), report(2, r), report(3, r, val_loss=2.5),
                             report(4, r), report(5, r)],
                      commits=[], done=True) for r in range(WORLD)],
    ])], ["train.steps=5"])
    assert w.run() == Finished(step=5)
    rows = w.rows()
    assert [r["step"] for r in rows] == [2, 3, 4, 5]
    assert rows[1]["val_loss"] == 2.5 and "val_loss" not in rows[0]
    assert w.event("finished")["val_loss"] == 2.5


def test_resume_from_a_checkpoint_restores_before_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resume = CheckpointInfo(step=4, path="/somewhere/step_000000004", manifest={})
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[statuses([5, 6], done=True)])],
                  resume_from=resume)
    assert w.run() == Finished(step=6)
    assert [(c.name, c.state, c.args) for c in w.calls[:6]] == [
        ("top_up", "SCHEDULING", ()), ("refresh", "SCHEDULING", (0.0,)),
        ("form", "RENDEZVOUS", (2, 0)), ("restore", "RESTORING", ("/somewhere/step_000000004",)),
        ("finish_restore", "RESTORING", ()), ("launch", "RESTORING", ())]
    assert w.event("started")["start_step"] == 4


def test_not_done_until_every_rank_is_done(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    half = statuses([5, 6], done=True)
    half[1] = status(1, [5, 6], done=False)
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[statuses([1, 2, 3, 4]), half,
                                                      statuses([], done=True)])])
    assert w.run() == Finished(step=6)
    assert len(w.named("poll")) == 3


def test_an_unexpected_error_still_shuts_the_group_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an exception that is not the group's error is a bug: it propagates, resources are freed
    w = FakeWorld(tmp_path, monkeypatch,
                  [Plan(polls=[statuses([1]), RuntimeError("controller bug")])])
    with pytest.raises(RuntimeError, match="controller bug"):
        w.run()
    assert w.shutdowns() == [False]


# ---------------------------------------------------------------------------- stopping


def test_stopped_early_by_the_first_ctrl_c(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        Poll(statuses([1, 2]), hook=ctrl_c),
        statuses([3], commits=[3], done=True, stopped_early=True),
    ])])
    final = w.run()
    assert final == Stopped(step=3)
    assert w.transitions == w.path("SCHEDULING", "RENDEZVOUS", "RESTORING", "RUNNING", "STOPPED")
    # the stop is asked once, between the two polls
    assert [c.name for c in w.calls if c.state == "RUNNING"] == ["poll", "request_stop", "poll"]
    assert any("stopping after the step in flight" in m for m in w.display.logs)
    assert w.kinds() == ["started", "checkpoint_committed", "stopped"]
    assert w.event("stopped")["step"] == 3
    assert w.shutdowns() == [True]


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="only the main thread may own signal handlers")
def test_sigint_handler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = signal.getsignal(signal.SIGINT)
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        Poll(statuses([1, 2]), hook=lambda w: signal.raise_signal(signal.SIGINT)),
        statuses([3], commits=[3], done=True, stopped_early=True),
    ])])
    assert w.run() == Stopped(step=3)
    assert len(w.named("request_stop")) == 1
    assert signal.getsignal(signal.SIGINT) is before  # put back

    # a second Ctrl-C abandons the checkpoint: KeyboardInterrupt, the actors are killed
    again = tmp_path / "again"
    again.mkdir()
    w = FakeWorld(again, monkeypatch, [Plan(polls=[
        Poll(statuses([1, 2]), hook=lambda w: signal.raise_signal(signal.SIGINT)),
        Poll(statuses([3]), hook=lambda w: signal.raise_signal(signal.SIGINT)),
    ])])
    with pytest.raises(KeyboardInterrupt):
        w.run()
    assert w.shutdowns() == [False]
    assert signal.getsignal(signal.SIGINT) is before


def test_stop_while_waiting_for_workers(tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(on_refresh=ctrl_c)], cluster=[])
    assert w.run() == Stopped(step=0)
    assert w.transitions == [("SCHEDULING", "STOPPED")]
    assert w.kinds() == ["stopped"]
    assert w.named("form") == []
    assert w.shutdowns() == [True]


def test_stop_while_recovering_reports_the_checkpointed_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 4)
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2, 3, 4, 5], commits=[4]), Poll([status(0)], dead=[1])]),
        Plan(on_refresh=ctrl_c),  # no replacement comes; Ctrl-C meanwhile
    ], ["failure.max_failures=1"], storage=storage, cluster=actors(2))
    final = w.run()
    assert w.transitions[-1] == ("SCHEDULING", "STOPPED")
    assert w.event("stopped")["step"] == 4
    assert final == Stopped(step=4)


# ---------------------------------------------------------------------------- recovery


@pytest.mark.parametrize("where", ["refresh", "form", "launch", "poll"])
def test_worker_died_recovers_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       where: str) -> None:
    first = Plan(polls=[statuses([1, 2, 3]), Poll([status(0)], dead=[1])]) \
        if where == "poll" else Plan(raise_in={where: group_error()})
    second = Plan(polls=[
        statuses([], t0=T1),                      # nothing yet: not recovered yet
        statuses([1, 2], t0=T1),
        statuses([3, 4, 5, 6], done=True, t0=T1),
    ])
    w = FakeWorld(tmp_path, monkeypatch, [first, second], ["failure.max_failures=1"])
    final = w.run()

    assert final == Finished(step=6)
    failed_in = {"refresh": "SCHEDULING", "form": "RENDEZVOUS", "launch": "RESTORING",
                 "poll": "RUNNING"}[where]
    before = HAPPY[:HAPPY.index(failed_in) + 1]
    assert w.transitions == w.path(*before, "RECOVERING", *HAPPY)
    # in place: the failed rank is killed, the survivors leave their world and stay; the
    # group lives on and is shut down once, at the end
    assert [(c.name, c.state, c.args) for c in w.named("remove", "disband")] == [
        ("remove", "RECOVERING", ((1,),)), ("disband", "RECOVERING", ())]
    assert w.named("form")[-1].args == (2, 1) and w.named("form")[-1].state == "RENDEZVOUS"
    assert w.shutdowns() == [True]
    assert w.group.unused_polls() == {}
    if where == "refresh":  # no world had formed: the same two actors make the first one
        assert w.killed() == [] and w.members(1) == [1000, 1001]
    else:  # rank 0 survives in its process; rank 1 is a new actor
        assert w.killed() == [1001] and w.members(1) == [1000, 1002]

    lost = 3 if where == "poll" else 0
    assert [k for k in w.kinds() if k != "started"] == ["failure", "recovered", "finished"]
    fail = w.event("failure")
    assert fail["failure_kind"] == "worker_died" and fail["rank"] == 1 and fail["ranks"] == [1]
    assert fail["retry"] is True and fail["step"] == lost and fail["attempt"] == 1
    assert fail["message"] == "worker rank 1 died: the actor died unexpectedly"
    assert fail["nodes"] == ([] if where in ("refresh", "form") else ["10.0.0.1"])
    rec = w.event("recovered")
    assert rec["from_step"] == 0 and rec["source"] == "none" and rec["lost_steps"] == lost
    assert rec["world_size"] == 2 and rec["generation"] == 1
    # from the last sign of life (a poll's death: the end of step 3; a group error: when it
    # was raised) to the end of the new world's first step
    since = {"refresh": T0, "form": T0 + REFRESH_S, "launch": T0 + REFRESH_S,
             "poll": T0 + 3}[where]
    assert rec["recovery_s"] == pytest.approx(T1 + 1 - since)
    assert set(rec["phases"]) == PHASES
    assert sum(rec["phases"].values()) == pytest.approx(rec["recovery_s"], abs=0.01)
    if where == "poll":
        assert fail["detection_s"] == POLL_S  # found at the next poll
        assert rec["phases"] == {"detect": 0.5, "teardown": 0.0, "wait": 0.25, "join": 0.0,
                                 "restore": 0.0, "first_step": T1 + 1 - (T0 + 3.75)}
    else:
        assert fail["detection_s"] is None  # no heartbeat to measure from
    assert any("recovering from: worker rank 1 died" in m for m in w.display.logs)
    # once: the first world that launched
    assert w.kinds().count("started") == 1
    assert w.kinds()[0] == ("started" if where == "poll" else "failure")


@pytest.mark.parametrize("where", ["refresh", "launch"])
def test_started_is_logged_once_even_when_the_first_world_fails_to_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(raise_in={where: group_error()}),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T1)])], ["failure.max_failures=1"])
    assert w.run() == Finished(step=6)
    assert w.kinds().count("started") == 1
    assert w.event("started")["world_size"] == 2
    assert [e["generation"] for e in w.all("workers_started")] == [1]


def test_recovery_restores_the_newest_valid_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 2)
    _commit_checkpoint(storage, 4)
    (storage / "step_000000004" / "__0_0.distcp").write_bytes(b"damaged")
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2, 3, 4, 5], commits=[2, 4]), Poll([status(0)], dead=[1])]),
        Plan(polls=[statuses([3, 4, 5, 6], done=True, t0=T1)]),
    ], ["failure.max_failures=1"], storage=storage)
    assert w.run() == Finished(step=6)

    assert [(c.state, c.generation, c.args) for c in w.named("restore")] == [
        ("RESTORING", 1, (join(str(storage), "step_000000002"),))]
    assert w.kinds() == ["started", "checkpoint_committed", "checkpoint_committed", "failure",
                         "checkpoint_skipped", "recovered", "finished"]
    skipped = w.event("checkpoint_skipped")
    assert skipped["step"] == 4 and "file __0_0.distcp is damaged" in skipped["message"]
    assert any("skipping damaged checkpoint" in m for m in w.display.logs)
    rec = w.event("recovered")
    assert rec["from_step"] == 2 and rec["lost_steps"] == 3 and rec["source"] == "storage"


def test_a_commit_rank_0_did_not_live_to_report_is_logged_when_a_restore_finds_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 wrote step 4's manifest and died before the poll that would have reported it:
    the restore uses step 4, and the log names it, so every restored step was committed."""
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 2)
    _commit_checkpoint(storage, 4)
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2, 3], commits=[2]), Poll([status(1, [4, 5])], dead=[0])]),
        Plan(polls=[statuses([5, 6], done=True, t0=T1)]),
    ], ["failure.max_failures=1"], storage=storage)
    assert w.run() == Finished(step=6)

    assert w.kinds() == ["started", "checkpoint_committed", "failure", "checkpoint_committed",
                         "recovered", "finished"]
    reported, found = w.all("checkpoint_committed")
    assert reported["step"] == 2 and reported["save_s"] == 0.25
    assert reported["found_on_restore"] is False
    assert found == {**found, "step": 4, "path": join(str(storage), "step_000000004"),
                     "save_s": None, "found_on_restore": True}
    assert w.event("recovered")["from_step"] == 4


def test_a_resumed_runs_own_checkpoint_is_not_logged_again_when_a_restore_finds_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 4)
    resume = CheckpointInfo(step=4, path=join(str(storage), "step_000000004"), manifest={})
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[Poll([status(0, [5])], dead=[1])]),
        Plan(polls=[statuses([5, 6], done=True, t0=T1)]),
    ], ["failure.max_failures=1"], storage=storage, resume_from=resume)
    assert w.run() == Finished(step=6)
    assert w.all("checkpoint_committed") == []
    assert w.event("recovered")["from_step"] == 4


def _kill_at_5(storage: Path, memory: list[int], extra: list[str] = (),
               raise_in: dict[str, BaseException] | None = None,
               tmp_path: Path = Path(), monkeypatch: Any = None) -> FakeWorld:
    """Rank 1 dies after step 5; the survivor (pid 1000) holds `memory` in its tier."""
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2, 3, 4, 5]), Poll([status(0)], dead=[1])]),
        Plan(polls=[statuses([6], done=True, t0=T1)], raise_in=raise_in or {}),
    ], ["failure.max_failures=1", "train.steps=6", *extra], storage=storage)
    w.group.memory[1000] = memory
    return w


def test_recovery_restores_memory_when_it_is_newest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 2)
    w = _kill_at_5(storage, [4, 5], tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    assert [(c.state, c.args) for c in w.named("restore_memory", "restore", "finish_restore")
            ] == [("RESTORING", (5,)), ("RESTORING", ())]
    chosen = w.event("checkpoint_chosen")
    assert chosen["source"] == "memory" and chosen["step"] == 5
    assert chosen["memory_step"] == 5 and chosen["storage_step"] == 2
    rec = w.event("recovered")
    assert rec["source"] == "memory" and rec["from_step"] == 5 and rec["lost_steps"] == 0


def test_rows_time_their_window_and_a_restore_reports_the_unlogged_steps_it_keeps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # log_every=2: rows at 2 and 4; step 5 gets no row before rank 1 dies; memory keeps it
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 2)
    w = _kill_at_5(storage, [4, 5], tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    rows = w.rows()
    assert [(r["step"], r["steps_in_window"]) for r in rows] == [(2, 2), (4, 2), (6, 1)]
    # the first window starts at the world's first step's start (0.1 s before its end)
    assert [r["window_s"] for r in rows] == pytest.approx([1.1, 2.0, 0.1])
    first, second = w.all("workers_started")
    assert first["kept_unlogged"] is None
    assert second["kept_unlogged"] == {"first_step": 5, "last_step": 5, "window_s": 1.0}
    # every second of step time is in a row or in kept_unlogged
    assert sum(r["window_s"] for r in rows) + 1.0 == pytest.approx(w.controller.train_time_s)


def test_unlogged_steps_a_restore_rolls_back_are_not_reported_as_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 4)
    w = _kill_at_5(storage, [2, 3], tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    assert w.event("recovered")["from_step"] == 4
    assert w.all("workers_started")[1]["kept_unlogged"] is None


def test_a_stop_reports_the_unlogged_steps_it_checkpointed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        Poll(statuses([1, 2]), hook=ctrl_c),
        statuses([3], commits=[3], done=True, stopped_early=True),
    ])])
    assert w.run() == Stopped(step=3)
    assert w.event("stopped")["kept_unlogged"] == {
        "first_step": 3, "last_step": 3, "window_s": 1.0}


def test_recovery_restores_storage_when_it_is_newer_than_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 4)
    w = _kill_at_5(storage, [2, 3], tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    assert w.named("restore_memory") == []
    chosen = w.event("checkpoint_chosen")
    assert chosen["source"] == "storage" and chosen["step"] == 4
    assert "newer than memory's step 3" in chosen["reason"]
    assert w.event("recovered")["source"] == "storage"


def test_recovery_with_nothing_in_memory_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 4)
    w = _kill_at_5(storage, [], tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    chosen = w.event("checkpoint_chosen")
    assert chosen["source"] == "storage" and chosen["memory_step"] is None
    assert chosen["reason"] == "nothing complete in memory: no snapshot is held in memory"


def test_a_memory_restore_that_fails_falls_back_to_storage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 4)
    w = _kill_at_5(storage, [5], raise_in={"restore_memory": group_error(
        FailureKind.START_ERROR, rank=0, message="worker rank 0: LookupError: gone")},
        tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    assert [c.name for c in w.named("restore_memory", "restore")] == ["restore_memory",
                                                                      "restore"]
    first, fallback = w.all("checkpoint_chosen")
    assert first["source"] == "memory"
    assert fallback["source"] == "storage" and fallback["step"] == 4
    assert "restoring from memory failed: worker rank 0: LookupError: gone" in fallback["reason"]
    assert w.event("recovered")["source"] == "storage"
    assert w.event("recovered")["lost_steps"] == 1


def test_memory_tier_off_never_asks_for_an_inventory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 4)
    w = _kill_at_5(storage, [5], ["checkpoint.snapshot_every=0"], tmp_path=tmp_path,
                   monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    assert w.named("memory_inventory", "restore_memory") == []
    assert w.event("recovered")["source"] == "storage"


def test_the_memory_tier_size_is_reported_once_per_world(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    polls = [[dataclasses.replace(st, snapshot_bytes=1000 * (st.rank + 1)) for st in
              statuses([1, 2])], [dataclasses.replace(st, snapshot_bytes=5000) for st in
                                  statuses([3, 4], done=True)]]
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=polls)], ["train.steps=4"])
    assert w.run() == Finished(step=4)
    # Not after the first two steps (a peer's copy may still be on its way): after the third.
    (tier,) = w.all("memory_tier")
    assert tier["bytes_per_worker"] == 5000 and tier["bytes_total"] == 10000
    assert tier["generation"] == 0 and tier["replicas"] == 1


def test_a_warm_spare_replaces_a_dead_worker(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2]), Poll([status(0)], dead=[1])]),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=1", "scaling.spare_workers=1"])
    assert w.run() == Finished(step=6)
    assert w.members(0) == [1000, 1001]
    assert w.members(1) == [1000, 1002]  # the spare, warm since the start
    assert w.group.idle == [Actor(1003)]  # and a new spare behind it


def test_second_failure_past_the_budget_fails(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2]),
                    Poll([status(0)], dead=[died(1, "worker rank 1 died: first")])]),
        Plan(polls=[Poll([status(0)], dead=[died(1, "worker rank 1 died: second")])]),
    ], ["failure.max_failures=1"])
    final = w.run()

    assert isinstance(final, Failed)
    assert final.reason == ("failure budget exhausted (failure.max_failures=1; failures: "
                            "worker_died, worker_died): worker rank 1 died: second")
    assert [c.args for c in w.named("form")] == [(2, 0), (2, 1)]
    assert w.transitions[-2:] == [("RESTORING", "RUNNING"), ("RUNNING", "FAILED")]
    assert w.shutdowns() == [False]
    assert w.kinds() == ["started", "failure", "failure"]
    fails = w.all("failure")
    assert [e["retry"] for e in fails] == [True, False]
    assert [e["attempt"] for e in fails] == [1, 2]


def test_no_budget_fails_at_the_first_failure(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    # max_failures defaults to 0
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[Poll([status(0)], dead=[1])])])
    final = w.run()
    assert isinstance(final, Failed) and "failure.max_failures=0" in final.reason
    assert w.named("remove", "disband") == []
    assert len(w.named("form")) == 1
    assert w.shutdowns() == [False]


def test_user_error_fails_at_once_even_with_budget_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        statuses([1]),
        [status(0, error=USER_ERROR, error_kind="user"), status(1)],
    ])], ["failure.max_failures=3"])
    final = w.run()

    assert isinstance(final, Failed)
    assert final.reason == ("an exception in the training code is not retried "
                            f"(failure.retry_user_errors=false): {USER_ERROR}")
    assert w.transitions == w.path("SCHEDULING", "RENDEZVOUS", "RESTORING", "RUNNING", "FAILED")
    assert w.named("remove", "disband") == []
    assert w.shutdowns() == [False]
    fail = w.event("failure")
    assert fail["failure_kind"] == "user_error" and fail["rank"] == 0 and fail["ranks"] == [0]
    assert fail["retry"] is False and fail["step"] == 1 and fail["message"] == USER_ERROR


def test_user_error_is_recovered_when_configured(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2]), [status(0), status(1, error=USER_ERROR,
                                                          error_kind="user")]]),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=1", "failure.retry_user_errors=true"])
    assert w.run() == Finished(step=6)
    # the rank that raised is replaced: its peers wait for it in the next collective
    assert w.named("remove")[0].args == ((1,),)
    assert w.killed() == [1001] and w.members(1) == [1000, 1002]
    fail = w.event("failure")
    assert fail["failure_kind"] == "user_error" and fail["rank"] == 1 and fail["retry"] is True
    assert w.event("recovered")["lost_steps"] == 2


def test_start_error_is_retried_within_the_budget(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    message = "a worker could not load the task: ModuleNotFoundError: No module named 'mytask'"
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(raise_in={"refresh": group_error(FailureKind.START_ERROR, rank=None,
                                              message=message)}),
        Plan(raise_in={"refresh": group_error(FailureKind.START_ERROR, rank=None,
                                              message=message)}),
    ], ["failure.max_failures=1"])
    final = w.run()
    assert isinstance(final, Failed)
    assert final.reason == ("failure budget exhausted (failure.max_failures=1; failures: "
                            f"start_error, start_error): {message}")
    assert w.transitions == [("SCHEDULING", "RECOVERING"), ("RECOVERING", "SCHEDULING"),
                             ("SCHEDULING", "FAILED")]
    assert [c.args for c in w.named("remove")] == [((),)]  # nobody to blame
    assert w.shutdowns() == [False]
    fail = w.all("failure")[0]
    assert fail["rank"] is None and fail["ranks"] == [] and fail["nodes"] == []


def test_backoff_between_consecutive_failures(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[Poll([status(0)], dead=[1])]),
        Plan(polls=[Poll([status(0)], dead=[1])]),
        Plan(polls=[Poll([status(0)], dead=[1])]),
        Plan(polls=[statuses([1, 2], t0=T1), Poll([status(0)], dead=[1])]),  # progress first
        Plan(polls=[statuses(range(1, 7), done=True, t0=T2)]),
    ], ["failure.max_failures=-1", "failure.backoff_s=1"])
    assert w.run() == Finished(step=6)
    # 1 x 2^(n-1) for the n-th failure in a row; a completed step starts a new streak
    assert [s for s in w.clock.sleeps if s] == [1.0, 2.0, 4.0, 1.0]  # 0: poll pacing
    assert [m for m in w.display.logs if m.startswith("backing off")] == [
        "backing off 1.0s before recovering", "backing off 2.0s before recovering",
        "backing off 4.0s before recovering", "backing off 1.0s before recovering"]
    fails = w.all("failure")
    assert [e["attempt"] for e in fails] == [1, 2, 3, 4] and all(e["retry"] for e in fails)
    assert w.members(4) == [1000, 1005]


def test_no_backoff_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[Poll([status(0)], dead=[1])]),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=1"])
    assert w.run() == Finished(step=6)
    assert [s for s in w.clock.sleeps if s] == []  # 0: poll pacing


# ---------------------------------------------------------------------------- what failed


def test_a_rank_that_stops_answering_is_a_hang(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    silent = Poll([status(0)])  # rank 1's polls never return; rank 0 waits in a collective
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2]), *[silent] * 5]),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=1", *HANG_LIMIT])
    assert w.run() == Finished(step=6)
    # rank 1 last answered at T0+2; at T0+4.5 it has been silent 2.5 s > the 2 s limit
    assert w.group.unused_polls() == {}
    fail = w.event("failure")
    assert fail["failure_kind"] == "hang" and fail["rank"] == 1 and fail["ranks"] == [1]
    assert fail["message"] == (
        "hang: worker rank(s) [1] stopped answering for 2.5s (limit 2.0s = "
        "max(failure.hang_timeout_floor_s, failure.hang_factor x median step time))")
    assert fail["detection_s"] == 2.5  # from its last answer
    assert w.named("remove")[0].args == ((1,),) and w.killed() == [1001]


def test_everyone_answering_but_nobody_progressing_is_a_hang_with_no_rank_blamed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stalled = statuses([])
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2]), *[stalled] * 5]),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=1", *HANG_LIMIT])
    assert w.run() == Finished(step=6)
    assert w.group.unused_polls() == {}
    fail = w.event("failure")
    assert fail["failure_kind"] == "hang" and fail["rank"] is None and fail["ranks"] == []
    assert fail["message"] == (
        "hang: no rank completed a step for 2.5s (limit 2.0s = "
        "max(failure.hang_timeout_floor_s, failure.hang_factor x median step time))")
    assert fail["detection_s"] == 2.5
    # the stuck rank cannot be told from the ranks it holds up: nobody is killed up front;
    # the survivors leave (the group kills those that cannot)
    assert w.named("remove")[0].args == ((),) and w.killed() == []
    assert w.event("recovered")["lost_steps"] == 2


def test_no_hang_before_the_first_step_within_the_start_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 10 s without a step is far past the 2 s limit, but the first step may compile
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        *[statuses([])] * 20, statuses(range(1, 7), done=True, t0=T0 + 20)])],
        [*HANG_LIMIT, "scaling.start_timeout_s=30"])
    assert w.run() == Finished(step=6)
    assert w.all("failure") == []


def test_a_done_rank_does_not_hide_a_stuck_peer(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    stuck = [status(0, done=True), status(1)]
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        statuses([1, 2, 3, 4, 5]),
        [status(0, [6], done=True), status(1, [6])],
        *[stuck] * 10,                   # 5 s: rank 1 answers, never finishes
        statuses([], done=True),         # (only there so the run ends at all)
    ])], HANG_LIMIT)
    final = w.run()
    assert [e["failure_kind"] for e in w.all("failure")] == ["hang"]
    assert isinstance(final, Failed)


@pytest.mark.parametrize(("answered", "dead", "kind", "rank"), [
    # a dead rank outranks the failed collectives it causes on its peers...
    ([status(0, error=COLLECTIVE_ERROR, error_kind="collective")], [1], "worker_died", 1),
    # ...and an exception elsewhere in the same poll
    ([status(0, error=USER_ERROR, error_kind="user")], [1], "worker_died", 1),
    # the rank that raised is blamed, not the peer whose collective failed because of it
    ([status(0, error=COLLECTIVE_ERROR, error_kind="collective"),
      status(1, error=USER_ERROR, error_kind="user")], [], "user_error", 1),
    ([status(0, error=USER_ERROR, error_kind="user"),
      status(1, error=USER_ERROR, error_kind="user")], [], "user_error", 0),
])
def test_what_is_blamed_when_several_things_go_wrong(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answered: list[WorkerStatus],
        dead: list[int], kind: str, rank: int) -> None:
    monkeypatch.setattr(Controller, "COLLECTIVE_GRACE_S", 0.0)
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[statuses([1, 2]),
                                                      Poll(answered, dead=dead)])])
    assert isinstance(w.run(), Failed)
    fail = w.event("failure")
    assert (fail["failure_kind"], fail["rank"], fail["ranks"]) == (kind, rank, [rank])


def test_ranks_on_a_lost_node_are_a_node_death(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def lose_node_b(w: FakeWorld) -> None:
        w.group.dead_nodes.add("node-b")

    cluster = [*actors(2), *actors(2, first_pid=2000, node="node-b", ip="10.0.0.2")]
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        statuses([1, 2], world=4),
        Poll([status(0), status(1)], dead=[2, 3], hook=lose_node_b),
    ])], ["scaling.num_workers=4"], cluster=cluster)
    assert isinstance(w.run(), Failed)
    fail = w.event("failure")
    assert fail["failure_kind"] == "node_died"
    assert fail["rank"] == 2 and fail["ranks"] == [2, 3] and fail["nodes"] == ["10.0.0.2"]
    assert fail["message"] == ("worker ranks [2, 3] died (node(s) ['node-b']): worker rank 2 "
                               "died: the actor died unexpectedly")


def test_a_collective_error_alone_waits_for_the_grace_period(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Controller, "COLLECTIVE_GRACE_S", 1.0)
    failed = [status(0, error=COLLECTIVE_ERROR, error_kind="collective"),
              status(1, error=COLLECTIVE_ERROR, error_kind="collective")]
    w = FakeWorld(tmp_path, monkeypatch, [
        # seen at T0+2.5, still alone at T0+3.0, acted on at T0+3.5 (1 s later)
        Plan(polls=[statuses([1, 2]), failed, failed, failed]),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=1"])
    assert w.run() == Finished(step=6)
    assert w.group.unused_polls() == {}
    fail = w.event("failure")
    assert fail["failure_kind"] == "collective_error"
    assert fail["rank"] is None and fail["ranks"] == []
    assert fail["message"] == ("worker rank 0: a collective failed with no rank to blame:\n"
                               f"{COLLECTIVE_ERROR}")
    assert w.named("remove")[0].args == ((),)


def test_a_death_within_the_grace_period_is_what_is_blamed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Controller, "COLLECTIVE_GRACE_S", 1.0)
    peer_failed = [status(0, error=COLLECTIVE_ERROR, error_kind="collective")]
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        statuses([1, 2]), peer_failed, Poll(peer_failed, dead=[1])])])
    assert isinstance(w.run(), Failed)
    fail = w.event("failure")
    assert fail["failure_kind"] == "worker_died" and fail["rank"] == 1


# ---------------------------------------------------------------------------- elasticity


def test_shrink_when_only_a_smaller_world_can_form(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def lose_node_b(w: FakeWorld) -> None:
        w.group.dead_nodes.add("node-b")

    # ranks 0, 1 on the driver's node (node 0), ranks 2, 3 on node-b (node 1)
    cluster = [*actors(2, node=DRIVER_NODE, ip="10.0.0.1"),
               *actors(2, first_pid=2000, node="node-b", ip="10.0.0.2")]
    fired = FaultFired(fault=parse_fault("kill-node:node=1,step=3"), rank=2, time=T0 + 2.2)
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[
            Poll(statuses([1, 2], world=4, commits=[2]), hook=lambda w: w.commit(2)),
            [status(0), status(1), status(2, faults=[fired]), status(3)],
            Poll([status(0), status(1)], dead=[2, 3], hook=lose_node_b),
        ]),
        Plan(polls=[statuses([3, 4, 5, 6], world=2, done=True, t0=T1)]),
    ], ["scaling.num_workers=4", "scaling.min_workers=2", "failure.max_failures=1"],
        cluster=cluster, faults=["kill-node:node=1,step=3", "kill:rank=3,step=5"])
    assert w.run() == Finished(step=6)

    # the node fault went to the lowest rank on node 1, and is not armed again
    assert w.group.armed == {0: {2: [parse_fault("kill-node:node=1,step=3")],
                                 3: [parse_fault("kill:rank=3,step=5")]},
                             1: {}}
    assert [c.args for c in w.named("form")] == [(4, 0), (2, 1)]
    assert w.killed() == [2000, 2001] and w.members(1) == [1000, 1001]
    assert w.kinds() == ["started", "checkpoint_committed", "fault_injected", "failure",
                         "fault_skipped", "resized", "recovered", "finished"]
    assert w.event("failure")["failure_kind"] == "node_died"
    assert w.event("fault_skipped")["message"] == (
        "fault kill:rank=3,step=5 has no target now: the world has 2 ranks")
    resized = w.event("resized")
    assert resized["old_world_size"] == 4 and resized["new_world_size"] == 2
    assert resized["old_layout"] == {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "pp": 1}
    assert resized["new_layout"] == {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1}
    assert resized["reason"] == "shrink" and resized["generation"] == 1
    assert any(m == "world resized 4 -> 2 (shrink)" for m in w.display.logs)
    rec = w.event("recovered")
    assert rec["world_size"] == 2 and rec["from_step"] == 2 and rec["lost_steps"] == 0
    assert [(r["step"], r["world_size"]) for r in w.rows()] == [(2, 4), (4, 2), (6, 2)]
    assert w.event("finished")["step"] == 6


@pytest.mark.parametrize("when", ["start", "recovery"])
def test_below_min_workers_fails_after_waiting(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               when: str) -> None:
    if when == "start":  # the cluster can only ever place one of the two workers
        w = FakeWorld(tmp_path, monkeypatch, [Plan()], ["scaling.start_timeout_s=2"],
                      cluster=actors(1))
        setting, floor = "scaling.start_timeout_s", \
            "scaling.num_workers=2 (no scaling.min_workers set)"
    else:  # three of four workers die and nothing replaces them
        w = FakeWorld(tmp_path, monkeypatch, [
            Plan(polls=[statuses([1, 2], world=4), Poll([status(0)], dead=[1, 2, 3])]),
            Plan(),
        ], ["scaling.num_workers=4", "scaling.min_workers=2", "failure.max_failures=1",
            "scaling.wait_for_workers_s=2"], cluster=actors(4))
        setting, floor = "scaling.wait_for_workers_s", "scaling.min_workers=2"
    final = w.run()
    assert isinstance(final, Failed)
    assert final.reason.startswith(f"only 1 workers could be started, {floor} are needed; "
                                   f"waited ")
    assert final.reason.endswith(f"s ({setting}=2); checkpoints are intact under {w.storage}")
    assert w.transitions[-1] == ("SCHEDULING", "FAILED")
    assert w.shutdowns() == [False]
    # it waited out the limit, looking for workers meanwhile
    waits = [c for c in w.named("refresh") if c.generation == (0 if when == "start" else 1)]
    assert len(waits) * REFRESH_S > 2.0


def test_grow_when_the_cluster_has_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def two_more(w: FakeWorld) -> None:
        w.group.cluster += actors(2, first_pid=2000, node="node-b", ip="10.0.0.2")

    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[
            statuses([1, 2]),
            Poll(statuses([3]), hook=two_more),  # the resize check after it sees 4 workers
            Poll(statuses([4], commits=[4], done=True, stopped_early=True),
                 hook=lambda w: w.commit(4)),
        ]),
        Plan(polls=[statuses([5, 6], world=4, done=True, t0=T1)]),
    ], ["scaling.max_workers=4", "scaling.resize_check_s=0.5"], cluster=actors(2))
    final = w.run()

    assert final == Finished(step=6)  # the planned stop is not the user's: not STOPPED
    assert w.transitions == w.path(*HAPPY[:4], "RESIZING", *HAPPY)
    assert [(c.name, c.state) for c in w.named("request_stop", "remove", "disband")] == [
        ("request_stop", "RUNNING"), ("remove", "RESIZING"), ("disband", "RESIZING")]
    assert w.named("remove")[0].args == ((),)
    assert any(m == "planned resize (grow, room for more workers): checkpointing the next step"
               for m in w.display.logs)
    assert [c.args for c in w.named("form")] == [(2, 0), (4, 1)]
    assert w.members(1) == [1000, 1001, 2000, 2001]  # the old ranks keep their places
    assert [(c.state, c.args) for c in w.named("restore")] == [
        ("RESTORING", (join(str(w.storage), "step_000000004"),))]
    assert w.kinds() == ["started", "checkpoint_committed", "resized", "finished"]
    resized = w.event("resized")
    assert (resized["old_world_size"], resized["new_world_size"]) == (2, 4)
    assert resized["reason"] == "grow" and resized["step"] == 4
    assert resized["new_layout"] == {"dp_replicate": 1, "dp_shard": 4, "tp": 1, "pp": 1}
    assert [(r["step"], r["world_size"]) for r in w.rows()] == [(2, 2), (4, 2), (6, 4)]
    assert w.controller.policy.failures == 0


def test_no_grow_before_the_resize_check(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def two_more(w: FakeWorld) -> None:
        w.group.cluster += actors(2, first_pid=2000)

    # resize_check_s is 10 s by default; the run takes 6
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        Poll(statuses([1, 2]), hook=two_more), statuses([3, 4, 5, 6], done=True)])],
        ["scaling.max_workers=4"], cluster=actors(2))
    assert w.run() == Finished(step=6)
    assert w.named("request_stop") == [] and "resized" not in w.kinds()


def test_a_preempted_rank_leaves_at_a_planned_resize(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[
            statuses([1, 2]),
            [status(0, [3]), status(1, [3], preempted=True)],  # SIGTERM on rank 1's machine
            Poll(statuses([4], commits=[4], done=True, stopped_early=True, preempted=(1,)),
                 hook=lambda w: w.commit(4)),
        ]),
        Plan(polls=[statuses([5, 6], world=1, done=True, t0=T1)]),
    ], ["scaling.min_workers=1"], cluster=actors(2))
    assert w.run() == Finished(step=6)
    assert w.transitions == w.path(*HAPPY[:4], "RESIZING", *HAPPY)
    assert [(c.name, c.state, c.args) for c in w.named("request_stop", "remove")] == [
        ("request_stop", "RUNNING", ()), ("remove", "RESIZING", ((1,),))]
    assert any("planned resize (preempted, rank(s) [1] leaving)" in m for m in w.display.logs)
    assert w.killed() == [1001] and w.members(1) == [1000]
    resized = w.event("resized")
    assert (resized["old_world_size"], resized["new_world_size"]) == (2, 1)
    assert resized["reason"] == "preempted"
    assert "failure" not in w.kinds() and "recovered" not in w.kinds()


def test_every_preempted_rank_leaves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[
            statuses([1, 2], world=4),
            [status(0, [3]), status(1, [3], preempted=True), status(2, [3]), status(3, [3])],
            [status(0), status(1, preempted=True), status(2, preempted=True), status(3)],
            Poll(statuses([4], world=4, commits=[4], done=True, stopped_early=True,
                          preempted=(1, 2)), hook=lambda w: w.commit(4)),
        ]),
        Plan(polls=[statuses([5, 6], world=2, done=True, t0=T1)]),
    ], ["scaling.num_workers=4", "scaling.min_workers=2"], cluster=actors(4))
    assert w.run() == Finished(step=6)
    assert w.named("remove")[0].args == ((1, 2),)
    assert w.members(1) == [1000, 1003]


def test_a_draining_node_is_left_at_a_planned_resize(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def drain_node_b(w: FakeWorld) -> None:
        w.draining.add("node-b")

    cluster = [*actors(2), *actors(2, first_pid=2000, node="node-b", ip="10.0.0.2")]
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[
            statuses([1, 2], world=4),
            Poll(statuses([3], world=4), hook=drain_node_b),
            Poll(statuses([4], world=4, commits=[4], done=True, stopped_early=True),
                 hook=lambda w: w.commit(4)),
        ]),
        Plan(polls=[statuses([5, 6], world=2, done=True, t0=T1)]),
    ], ["scaling.num_workers=4", "scaling.min_workers=2", "scaling.resize_check_s=0.5"],
        cluster=cluster)
    assert w.run() == Finished(step=6)
    assert w.transitions == w.path(*HAPPY[:4], "RESIZING", *HAPPY)
    assert [(c.name, c.state, c.args) for c in w.named("request_stop", "remove")] == [
        ("request_stop", "RUNNING", ()), ("remove", "RESIZING", ((2, 3),))]
    assert any("planned resize (drain, rank(s) [2, 3] leaving)" in m for m in w.display.logs)
    assert w.killed() == [2000, 2001] and w.members(1) == [1000, 1001]
    resized = w.event("resized")
    assert (resized["old_world_size"], resized["new_world_size"]) == (4, 2)
    assert resized["reason"] == "drain"
    assert "failure" not in w.kinds()
    assert [(r["step"], r["world_size"]) for r in w.rows()] == [(2, 4), (4, 4), (6, 2)]


# ---------------------------------------------------------------------------- injected faults


def test_an_injected_fault_is_reported_acknowledged_and_not_armed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fired = FaultFired(fault=parse_fault("kill:rank=1,step=3"), rank=1, time=T0 + 2.1)
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[
            statuses([1, 2]),
            [status(0), status(1, faults=[fired])],   # heard at T0+2.5
            Poll([status(0)], dead=[1]),              # found dead at T0+3.0
        ]),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=1"], faults=["kill:rank=1,step=3"])
    assert w.run() == Finished(step=6)

    assert w.group.armed == {0: {1: [parse_fault("kill:rank=1,step=3")]}, 1: {}}
    assert w.controller.faults.pending == []
    assert [(c.state, c.args) for c in w.named("ack_faults")] == [("RUNNING", (1,))]
    assert w.kinds() == ["started", "fault_injected", "failure", "recovered", "finished"]
    injected = w.event("fault_injected")
    assert (injected["fault"], injected["rank"], injected["step"]) == ("kill:rank=1,step=3", 1, 3)
    # detection is measured from the fault (it happens once acknowledged), not from the end
    # of step 2, the last heartbeat
    assert w.event("failure")["detection_s"] == 0.5
    assert w.event("recovered")["recovery_s"] == T1 + 1 - (T0 + 2.5)


def test_a_fault_with_no_target_is_reported(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # every worker is on the driver's node (node 0): no node 1 to kill
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[statuses(range(1, 7), done=True)])],
                  cluster=actors(2, node=DRIVER_NODE), faults=["kill-node:node=1,step=3"])
    assert w.run() == Finished(step=6)
    assert w.group.armed == {0: {}}
    assert w.event("fault_skipped")["message"] == (
        "fault kill-node:node=1,step=3 has no target now: the workers are on node(s) [0] "
        "(node 0: the driver's)")


def test_an_old_fault_does_not_date_a_later_failure(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fired = FaultFired(fault=parse_fault("kill:rank=1,step=3"), rank=1, time=T0 + 2.1)
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2]), [status(0), status(1, faults=[fired])],
                    Poll([status(0)], dead=[1])]),
        # the new rank 1 dies on its own, 0.5 s after the end of step 3
        Plan(polls=[statuses([1, 2, 3], t0=T1), Poll([status(0)], dead=[1])]),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T2)]),
    ], ["failure.max_failures=2"], faults=["kill:rank=1,step=3"])
    assert w.run() == Finished(step=6)
    assert [e["detection_s"] for e in w.all("failure")] == [0.5, 0.5]
    assert [e["recovery_s"] for e in w.all("recovered")] == [T1 + 1 - (T0 + 2.5),
                                                              T2 + 1 - (T1 + 3)]
