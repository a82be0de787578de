"""The controller driven step by step by a fake worker group.

The fake worker group returns scripted WorkerStatus lists from `poll` and raises a scripted
error carrying `.failure` (the controller's `group_error`); the event log and the metrics file
are the real ones, written under tmp_path.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from stalwart.checkpointing.catalog import CheckpointInfo
from stalwart.checkpointing.layout import join, step_dir_name
from stalwart.config import JobConfig, load_config
from stalwart.orchestrator import controller as controller_module
from stalwart.orchestrator.controller import Controller
from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.orchestrator.states import (
    Failed,
    Finished,
    State,
    Stopped,
)
from stalwart.run_dir import EventLog, JsonlWriter, read_jsonl
from stalwart.workers.reports import CommitReport, StepReport, WorkerStatus

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


# ---------------------------------------------------------------------------- fakes


class FakeGroupError(Exception):
    def __init__(self, failure: WorkerFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def failure(kind: FailureKind = FailureKind.WORKER_DIED, *, rank: int | None = 1,
            message: str = "worker rank 1 died: the actor died unexpectedly") -> FakeGroupError:
    return FakeGroupError(WorkerFailure(kind=kind, rank=rank, message=message,
                                        detected_at=time.time()))


CORE_EVENTS = {"started", "checkpoint_committed", "checkpoint_skipped", "failure", "recovered",
               "finished", "stopped"}
T0 = time.time() + 1000.0  # report times: step n ends at T0 + n (after any real time here)
WORLD = 2
TOKENS = 1000


def report(step: int, rank: int = 0, val_loss: float | None = None) -> StepReport:
    return StepReport(rank=rank, step=step, loss=10.0 / step, lr=1e-3 * step, tokens=TOKENS,
                      step_time_s=0.1, time=T0 + step, val_loss=val_loss)


def statuses(steps: range | list[int], *, commits: list[int] = (), done: bool = False,
             stopped_early: bool = False, storage: str = "/ckpt") -> list[WorkerStatus]:
    """Every rank's status; rank 0 carries the commits (it commits for everyone)."""
    return [WorkerStatus(rank=r, steps=[report(s, r) for s in steps],
                         commits=[CommitReport(step=c, path=join(storage, step_dir_name(c)),
                                               save_s=0.25) for c in commits] if r == 0 else [],
                         done=done, stopped_early=stopped_early and done)
            for r in range(WORLD)]


@dataclass
class Plan:
    """What one generation of the fake group does."""

    polls: list[Any] = field(default_factory=list)
    """Each poll returns the next item; an exception item is raised instead."""
    raise_in: dict[str, Exception] = field(default_factory=dict)
    """Method name -> exception raised when it is called."""
    restore_step: int = 0


class FakeGroup:
    def __init__(self, generation: int, plan: Plan, world: FakeWorld) -> None:
        self.generation = generation
        self.plan = plan
        self.world = world
        self.polls = list(plan.polls)

    def _call(self, name: str, *args: Any) -> None:
        state = self.world.controller.state.name if self.world.controller else None
        self.world.calls.append((self.generation, name, state, *args))
        exc = self.plan.raise_in.get(name)
        if exc is not None:
            raise exc

    def start(self) -> None:
        self._call("start")

    def rendezvous(self) -> None:
        self._call("rendezvous")

    def restore(self, path: str) -> int:
        self._call("restore", path)
        return self.plan.restore_step

    def launch(self) -> None:
        self._call("launch")

    def describe(self) -> list[dict[str, Any]]:
        return [{"rank": r, "pid": 1000 + r, "node_ip": "127.0.0.1"} for r in range(WORLD)]

    def poll(self, timeout: float) -> list[WorkerStatus]:
        self._call("poll")
        if not self.polls:
            raise AssertionError(f"generation {self.generation} polled past its script")
        item = self.polls.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def request_stop(self) -> None:
        self._call("request_stop")

    def shutdown(self, *, graceful: bool) -> None:
        self._call("shutdown", graceful)


class FakeDisplay:
    def __init__(self) -> None:
        self.updates: list[tuple[int, float | None]] = []
        self.logs: list[str] = []

    def update(self, report: StepReport, tokens_per_s: float | None) -> None:
        self.updates.append((report.step, tokens_per_s))

    def log(self, message: str) -> None:
        self.logs.append(message)


class FakeWorld:
    """Builds a Controller over fake groups (one Plan per generation) and records everything."""

    def __init__(self, tmp_path: Path, plans: list[Plan], overrides: list[str] = (),
                 resume_from: CheckpointInfo | None = None, storage: Path | None = None) -> None:
        self.plans = plans
        self.calls: list[tuple] = []
        self.generations: list[int] = []
        self.transitions: list[tuple[str, str]] = []
        self.display = FakeDisplay()
        self.events_path = tmp_path / "events.jsonl"
        self.metrics_path = tmp_path / "metrics.jsonl"
        self.storage = storage or tmp_path / "checkpoints"
        self.storage.mkdir(exist_ok=True)
        self.config: JobConfig = load_config(None, [
            "train.steps=6", "train.warmup_steps=0", "run.log_every=2", *overrides])
        self.controller: Controller | None = None
        self.controller = Controller(
            self.config, storage_url=str(self.storage), group_factory=self._factory,
            group_error=FakeGroupError, events=EventLog(self.events_path),
            metrics=JsonlWriter(self.metrics_path), display=self.display,
            resume_from=resume_from)

    def _factory(self, generation: int) -> FakeGroup:
        self.generations.append(generation)
        return FakeGroup(generation, self.plans[generation], self)

    def run(self, monkeypatch: pytest.MonkeyPatch) -> State:
        real = controller_module.check_transition

        def spy(old: State, new: State) -> None:
            self.transitions.append((old.name, new.name))
            real(old, new)

        monkeypatch.setattr(controller_module, "check_transition", spy)
        return self.controller.run()

    @property
    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.events_path)

    def kinds(self) -> list[str]:
        """The kinds of event these tests are about, in order (others may be added freely)."""
        return [e["kind"] for e in self.events if e["kind"] in CORE_EVENTS]

    def event(self, kind: str) -> dict[str, Any]:
        (found,) = [e for e in self.events if e["kind"] == kind]
        return found

    def shutdowns(self) -> list[tuple[int, bool]]:
        return [(c[0], c[3]) for c in self.calls if c[1] == "shutdown"]

    def path(self, *states: str) -> list[tuple[str, str]]:
        return list(itertools.pairwise(states))


@pytest.fixture(autouse=True)
def no_poll_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Controller, "POLL_INTERVAL_S", 0)


def _commit_checkpoint(storage: Path, step: int) -> None:
    from stalwart.checkpointing.storage import write_manifest

    d = storage / step_dir_name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(200)) * (step + 1))
    (d / ".metadata").write_bytes(b"meta")
    write_manifest(str(storage), step, {"world_size": WORLD})


# ---------------------------------------------------------------------------- controller runs

HAPPY = ["SCHEDULING", "RENDEZVOUS", "RESTORING", "RUNNING", "FINISHED"]


def test_normal_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, [Plan(polls=[
        statuses([1, 2]),
        statuses([], commits=[]),  # a poll with nothing new
        statuses([3, 4], commits=[4]),
        statuses([5, 6], done=True),
    ])])
    final = w.run(monkeypatch)

    assert final == Finished(step=6)
    assert w.transitions == w.path(*HAPPY)
    assert w.generations == [0]
    # each method ran in the state that owns it; no restore without a checkpoint
    assert [(c[1], c[2]) for c in w.calls] == [
        ("start", "SCHEDULING"), ("rendezvous", "RENDEZVOUS"), ("launch", "RESTORING"),
        ("poll", "RUNNING"), ("poll", "RUNNING"), ("poll", "RUNNING"), ("poll", "RUNNING"),
        ("shutdown", "FINISHED")]
    assert w.shutdowns() == [(0, True)]

    assert w.kinds() == ["started", "checkpoint_committed", "finished"]
    started = w.event("started")
    assert started["world_size"] == 2 and started["steps"] == 6 and started["start_step"] == 0
    assert started["task"] == "stalwart.examples.gpt.task:GPTTask"
    committed = w.event("checkpoint_committed")
    assert committed["step"] == 4 and committed["save_s"] == 0.25
    assert committed["path"] == join("/ckpt", "step_000000004")
    finished = w.event("finished")
    assert finished["step"] == 6 and finished["loss"] == pytest.approx(10.0 / 6)
    assert finished["val_loss"] is None
    assert all(isinstance(e["time"], float) for e in w.events)

    rows = read_jsonl(w.metrics_path)
    assert [r["step"] for r in rows] == [2, 4, 6]  # log_every=2
    for r in rows:
        assert set(r) == {"step", "loss", "lr", "tokens_per_s", "world_size", "time"}
        assert r["loss"] == pytest.approx(10.0 / r["step"])
        assert r["lr"] == pytest.approx(1e-3 * r["step"])
        assert r["world_size"] == 2 and r["time"] == T0 + r["step"]
    # two steps of TOKENS tokens over the two seconds since the last row
    assert rows[1]["tokens_per_s"] == rows[2]["tokens_per_s"] == TOKENS
    assert rows[0]["tokens_per_s"] > 0

    # the display saw every step, with a rate on the logged ones only
    assert [s for s, _ in w.display.updates] == [1, 2, 3, 4, 5, 6]
    assert [s for s, rate in w.display.updates if rate is not None] == [2, 4, 6]
    assert w.controller.last_step == 6 and w.controller.last_loss == pytest.approx(10.0 / 6)


def test_last_step_and_val_loss_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # steps=5 is not a multiple of log_every=2: the last step is logged anyway; a val loss
    # forces a row too
    w = FakeWorld(tmp_path, [Plan(polls=[
        [WorkerStatus(rank=r, steps=[report(1, r), report(2, r), report(3, r, val_loss=2.5),
                                     report(4, r), report(5, r)],
                      commits=[], done=True) for r in range(WORLD)],
    ])], ["train.steps=5"])
    assert w.run(monkeypatch) == Finished(step=5)
    rows = read_jsonl(w.metrics_path)
    assert [r["step"] for r in rows] == [2, 3, 4, 5]
    assert rows[1]["val_loss"] == 2.5 and "val_loss" not in rows[0]
    assert w.event("finished")["val_loss"] == 2.5


def test_resume_from_a_checkpoint_restores_before_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resume = CheckpointInfo(step=4, path="/somewhere/step_000000004", manifest={})
    w = FakeWorld(tmp_path, [Plan(polls=[statuses([5, 6], done=True)], restore_step=4)],
                  resume_from=resume)
    assert w.run(monkeypatch) == Finished(step=6)
    assert [c[1:] for c in w.calls[:4]] == [
        ("start", "SCHEDULING"), ("rendezvous", "RENDEZVOUS"),
        ("restore", "RESTORING", "/somewhere/step_000000004"), ("launch", "RESTORING")]
    assert w.event("started")["start_step"] == 4


@pytest.mark.parametrize("where", ["start", "rendezvous", "launch", "poll"])
def test_worker_died_recovers_with_the_next_generation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    boom = failure(FailureKind.WORKER_DIED)
    first = Plan(polls=[statuses([1, 2, 3]), boom]) if where == "poll" else \
        Plan(raise_in={where: boom})
    second = Plan(polls=[
        statuses([]),                      # nothing yet: not recovered yet
        statuses([1, 2]),
        statuses([3, 4, 5, 6], done=True),
    ])
    w = FakeWorld(tmp_path, [first, second], ["failure.max_failures=1"])
    final = w.run(monkeypatch)

    assert final == Finished(step=6)
    assert w.generations == [0, 1]
    failed_in = {"start": "SCHEDULING", "rendezvous": "RENDEZVOUS", "launch": "RESTORING",
                 "poll": "RUNNING"}[where]
    before = HAPPY[:HAPPY.index(failed_in) + 1]
    assert w.transitions == w.path(*before, "RECOVERING", *HAPPY)
    # the failed group is shut down (not gracefully) during recovery, the last one at the end
    assert w.shutdowns() == [(0, False), (1, True)]
    assert [c[2] for c in w.calls if c[1] == "shutdown"] == ["RECOVERING", "FINISHED"]

    lost = 3 if where == "poll" else 0
    assert [k for k in w.kinds() if k != "started"] == ["failure", "recovered", "finished"]
    fail = w.event("failure")
    assert fail["failure_kind"] == "worker_died" and fail["rank"] == 1
    assert fail["retry"] is True and fail["step"] == lost
    assert fail["message"] == "worker rank 1 died: the actor died unexpectedly"
    rec = w.event("recovered")
    assert rec["from_step"] == 0 and rec["lost_steps"] == lost
    assert rec["source"] == "storage" and rec["world_size"] == 2
    assert rec["recovery_s"] == pytest.approx(T0 + 1 - boom.failure.detected_at, abs=1e-2)
    assert any("recovering from: worker rank 1 died" in m for m in w.display.logs)
    if where == "poll":
        assert w.kinds()[0] == "started"  # once: the first generation's


@pytest.mark.parametrize("where", ["start", "launch"])
def test_started_is_logged_once_even_when_the_first_group_fails_to_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    w = FakeWorld(tmp_path, [Plan(raise_in={where: failure()}),
                             Plan(polls=[statuses(range(1, 7), done=True)])],
                  ["failure.max_failures=1"])
    assert w.run(monkeypatch) == Finished(step=6)
    assert w.kinds().count("started") == 1


def test_recovery_restores_the_newest_valid_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 2)
    _commit_checkpoint(storage, 4)
    (storage / "step_000000004" / "__0_0.distcp").write_bytes(b"damaged")
    w = FakeWorld(tmp_path, [
        Plan(polls=[statuses([1, 2, 3, 4, 5]), failure()]),
        Plan(polls=[statuses([3, 4, 5, 6], done=True)], restore_step=2),
    ], ["failure.max_failures=1"], storage=storage)
    assert w.run(monkeypatch) == Finished(step=6)

    restores = [c for c in w.calls if c[1] == "restore"]
    assert restores == [(1, "restore", "RESTORING", join(str(storage), "step_000000002"))]
    assert w.kinds() == ["started", "failure", "checkpoint_skipped", "recovered", "finished"]
    skipped = w.event("checkpoint_skipped")
    assert skipped["step"] == 4 and "file __0_0.distcp is damaged" in skipped["message"]
    assert any("skipping damaged checkpoint" in m for m in w.display.logs)
    rec = w.event("recovered")
    assert rec["from_step"] == 2 and rec["lost_steps"] == 3


def test_second_failure_past_the_budget_fails(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, [
        Plan(polls=[statuses([1, 2]), failure(message="worker rank 1 died: first")]),
        Plan(polls=[failure(message="worker rank 1 died: second")]),
    ], ["failure.max_failures=1"])
    final = w.run(monkeypatch)

    assert isinstance(final, Failed)
    assert final.reason == ("failure budget exhausted (failure.max_failures=1): "
                            "worker rank 1 died: second")
    assert w.generations == [0, 1]
    assert w.transitions[-2:] == [("RESTORING", "RUNNING"), ("RUNNING", "FAILED")]
    assert w.shutdowns() == [(0, False), (1, False)]
    assert w.kinds() == ["started", "failure", "failure"]
    assert [e["retry"] for e in w.events if e["kind"] == "failure"] == [True, False]


def test_no_budget_fails_at_the_first_failure(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, [Plan(polls=[failure()])])  # max_failures defaults to 0
    final = w.run(monkeypatch)
    assert isinstance(final, Failed) and "failure.max_failures=0" in final.reason
    assert w.generations == [0]
    assert w.shutdowns() == [(0, False)]


def test_user_error_fails_at_once_even_with_budget_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    traceback = "Traceback (most recent call last):\n  ...\nValueError: bad batch"
    w = FakeWorld(tmp_path, [
        Plan(polls=[statuses([1]), failure(FailureKind.USER_ERROR, rank=0, message=traceback)]),
    ], ["failure.max_failures=3"])
    final = w.run(monkeypatch)

    assert isinstance(final, Failed)
    assert final.reason == f"an exception in the training code is not retried: {traceback}"
    assert w.generations == [0]
    assert w.transitions == w.path("SCHEDULING", "RENDEZVOUS", "RESTORING", "RUNNING", "FAILED")
    assert w.shutdowns() == [(0, False)]
    fail = w.event("failure")
    assert fail["failure_kind"] == "user_error" and fail["rank"] == 0
    assert fail["retry"] is False and fail["step"] == 1 and fail["message"] == traceback


def test_start_error_is_retried_within_the_budget(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, [
        Plan(raise_in={"start": failure(FailureKind.START_ERROR, rank=None,
                                        message="could not place 2 workers")}),
        Plan(raise_in={"start": failure(FailureKind.START_ERROR, rank=None,
                                        message="could not place 2 workers")}),
    ], ["failure.max_failures=1"])
    final = w.run(monkeypatch)
    assert isinstance(final, Failed)
    assert final.reason == "the workers could not be started: could not place 2 workers"
    assert w.generations == [0, 1]
    assert w.shutdowns() == [(0, False), (1, False)]


def test_stopped_early(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, [Plan(polls=[
        statuses([1, 2]),
        statuses([3], commits=[3], done=True, stopped_early=True),
    ])])
    final = w.run(monkeypatch)
    assert final == Stopped(step=3)
    assert w.transitions == w.path("SCHEDULING", "RENDEZVOUS", "RESTORING", "RUNNING", "STOPPED")
    assert w.kinds() == ["started", "checkpoint_committed", "stopped"]
    assert w.event("stopped")["step"] == 3
    assert w.shutdowns() == [(0, True)]


def test_not_done_until_every_rank_is_done(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    half = statuses([5, 6], done=True)
    half[1] = WorkerStatus(rank=1, steps=[report(5, 1), report(6, 1)], commits=[], done=False)
    w = FakeWorld(tmp_path, [Plan(polls=[statuses([1, 2, 3, 4]), half,
                                         statuses([], done=True)])])
    assert w.run(monkeypatch) == Finished(step=6)
    assert sum(1 for c in w.calls if c[1] == "poll") == 3


def test_an_unexpected_error_still_shuts_the_group_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # an exception that is not the group's error is a bug: it propagates, resources are freed
    w = FakeWorld(tmp_path, [Plan(polls=[statuses([1]), RuntimeError("controller bug")])])
    with pytest.raises(RuntimeError, match="controller bug"):
        w.run(monkeypatch)
    assert w.shutdowns() == [(0, False)]
