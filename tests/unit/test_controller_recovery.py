"""Recovery in place: a worker dies, the world re-forms and restores; the failure budget; the controller driven by the fake worker group
(tests/unit/controller_world.py, tests/fake_group.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.checkpointing.storage.catalog import CheckpointInfo
from stalwart.checkpointing.storage.layout import join
from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.orchestrator.observers import ControllerObserver, Restored
from stalwart.orchestrator.states import Failed, Finished, Running
from stalwart.workers.reports import StepReport, WorkerStatus
from tests.fake_group import POLL_S, REFRESH_S, Actor, Plan, Poll, died
from tests.unit.controller_world import (
    HAPPY,
    PHASES,
    T0,
    T1,
    T2,
    USER_ERROR,
    FakeWorld,
    _commit_checkpoint,
    group_error,
    report,
    status,
    statuses,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


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
    assert w.named("pick")[-1].args == (2, 1) and w.named("pick")[-1].state == "RENDEZVOUS"
    assert w.named("form")[-1].state == "RENDEZVOUS"
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
    # a world that fails while forming is named too: its members were picked before setup
    assert fail["nodes"] == ([] if where == "refresh" else ["10.0.0.1"])
    assert fail["pids"] == ([] if where == "refresh" else [1001])
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


def test_steps_no_poll_reported_are_logged_as_the_world_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 completed steps 3 to 5 after the poll that brought step 2 (3 again: a dropped
    # poll's answer); its leave report brings them, once each, before the next world.
    first = Plan(polls=[statuses([1, 2]), Poll([status(0)], dead=[1])],
                 left_with=[report(2), report(3), report(4), report(5)])
    second = Plan(polls=[statuses([1, 2, 3, 4, 5, 6], done=True, t0=T1)])
    w = FakeWorld(tmp_path, monkeypatch, [first, second], ["failure.max_failures=1"])
    assert w.run() == Finished(step=6)
    assert [r["step"] for r in w.rows()] == [2, 4, 2, 4, 6]  # a row every 2 steps
    assert w.event("failure")["step"] == 2  # as known when it was detected
    assert w.event("recovered")["lost_steps"] == 5  # no checkpoint: all five are redone


def test_a_survivor_silent_at_the_teardown_is_a_failure_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Found by bench/chaos.py: rank 0 SIGSTOPped, then rank 1 SIGKILLed before the hang was
    # due. The death was detected; rank 0 did not answer at the teardown and was killed and
    # replaced, with no event naming it.
    def stop_rank_0(w: FakeWorld) -> None:
        w.group.silent.add(1000)

    first = Plan(polls=[statuses([1, 2, 3]), Poll([], dead=[1], hook=stop_rank_0)])
    second = Plan(polls=[statuses([1, 2, 3, 4, 5, 6], done=True, t0=T1)])
    w = FakeWorld(tmp_path, monkeypatch, [first, second], ["failure.max_failures=2"])
    assert w.run() == Finished(step=6)
    assert w.killed() == [1001, 1000] and w.members(1) == [1002, 1003]
    died_, silent = w.all("failure")
    assert died_["ranks"] == [1] and died_["attempt"] == 1 and died_["pids"] == [1001]
    assert silent["failure_kind"] == "hang" and silent["rank"] == 0 and silent["ranks"] == [0]
    assert silent["pids"] == [1000] and silent["nodes"] == ["10.0.0.1"]
    assert silent["retry"] is True and silent["attempt"] == 2 and "pid 1000" in silent["message"]
    assert w.kinds().count("recovered") == 1


def test_a_silent_survivor_counts_against_the_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def stop_rank_0(w: FakeWorld) -> None:
        w.group.silent.add(1000)

    first = Plan(polls=[statuses([1, 2, 3]), Poll([], dead=[1], hook=stop_rank_0)])
    w = FakeWorld(tmp_path, monkeypatch, [first], ["failure.max_failures=1"])
    assert isinstance(w.run(), Failed)
    assert [f["retry"] for f in w.all("failure")] == [True, False]


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
    # Step 4 is passed over on the driver, before any rank loads it.
    assert [m for m in w.display.logs if m.startswith("restoring")] == [
        "restoring step 2 from storage"]
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


def test_a_commit_rank_0_did_not_live_to_report_is_logged_when_the_run_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No restore follows a failure past the budget, so the end of the run looks on storage:
    the log's newest commit is the step a resume will start from."""
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 2)
    _commit_checkpoint(storage, 4)
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2, 3], commits=[2]), Poll([status(1, [4, 5])], dead=[0])]),
    ], ["failure.max_failures=0"], storage=storage)
    assert isinstance(w.run(), Failed)

    assert w.kinds() == ["started", "checkpoint_committed", "failure", "checkpoint_committed"]
    assert [(c["step"], c["found_on_restore"]) for c in w.all("checkpoint_committed")] == [
        (2, False), (4, True)]


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
    # The resume's restore and the recovery's, each named as it starts.
    assert [m for m in w.display.logs if m.startswith("restoring")] == [
        "restoring step 4 from storage"] * 2


def test_a_warm_spare_replaces_a_dead_worker(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2]), Poll([status(0)], dead=[1])]),
        Plan(polls=[statuses([1, 2], t0=T1), statuses(range(3, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=1", "scaling.spare_workers=1"])
    assert w.run() == Finished(step=6)
    assert w.members(0) == [1000, 1001]
    assert w.members(1) == [1000, 1002]  # the spare
    assert w.group.starting == [Actor(1003)]  # and a new spare behind it
    # The first world asked for its own actors only, and for the spare once it trained. The
    # recovery found the spare still warming up (below the floor without it) and asked for no
    # more than its world (top_up counts the actors starting); the new spare came once the
    # new world trained.
    top_ups = [(c.state, c.args) for c in w.named("top_up")]
    assert top_ups == [("SCHEDULING", (False,)), ("RUNNING", ()), ("SCHEDULING", (False,)),
                       ("RUNNING", ())]
    # Older worlds' snapshots were dropped once, after that first step (not before it).
    assert [(c.name, c.state) for c in w.named("launch", "settle", "poll")][-4:] == [
        ("launch", "RESTORING"), ("poll", "RUNNING"), ("settle", "RUNNING"), ("poll", "RUNNING")]


def test_no_spare_is_asked_for_while_the_new_world_has_not_trained(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2]), Poll([status(0)], dead=[1])]),
        Plan(polls=[Poll([status(0)], dead=[1])]),  # fails again before its first step
        Plan(polls=[statuses([1, 2], t0=T1), statuses(range(3, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=2", "scaling.spare_workers=1"])
    assert w.run() == Finished(step=6)
    # Generation 0 asked for the spare once it trained. Generation 1 formed with it and
    # trained no step: no spare was asked for it. Generation 2 needed one actor for its world
    # (the spare was used), then a spare once it trained.
    top_ups = [(c.state, c.args) for c in w.named("top_up")]
    assert top_ups == [("SCHEDULING", (False,)), ("RUNNING", ()), ("SCHEDULING", (False,)),
                       ("SCHEDULING", (False,)), ("RUNNING", ())]
    assert w.members(1) == [1000, 1002]
    assert w.members(2) == [1000, 1003] and w.group.starting == [Actor(1004)]


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
    assert [c.args for c in w.named("pick")] == [(2, 0), (2, 1)]
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
    # the dead rank is killed, the world leaves once: rank 0 hands over the steps no poll
    # brought
    assert [(c.name, c.state) for c in w.named("remove", "disband")] == [
        ("remove", "RUNNING"), ("disband", "RUNNING")]
    assert len(w.named("pick")) == len(w.named("form")) == 1
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
    assert [(c.name, c.state) for c in w.named("remove", "disband")] == [("disband", "RUNNING")]
    assert w.shutdowns() == [False]
    fail = w.event("failure")
    assert fail["failure_kind"] == "user_error" and fail["rank"] == 0 and fail["ranks"] == [0]
    assert fail["retry"] is False and fail["step"] == 1
    # the message's first line, then the traceback, as the worker reported them
    assert f"{fail['message']}\n{fail['traceback']}" == USER_ERROR


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


class Recorder(ControllerObserver):
    """An observer passed in: records the hooks the controller calls, in order."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def _saw(self, what: str) -> None:
        if not self.seen or self.seen[-1] != what:  # a poll's ranks and steps: once
            self.seen.append(what)

    def before_form(self, generation: int, now: float) -> None:
        self._saw(f"before_form {generation}")

    def after_form(self, generation: int, workers: list, now: float) -> None:
        self._saw(f"after_form {generation} ({len(workers)} workers)")

    def after_restore(self, restored: Restored, now: float) -> None:
        self._saw(f"after_restore {restored.source} step {restored.start_step}")

    def after_launch(self, generation: int, world_size: int, now: float) -> None:
        self._saw(f"after_launch {generation}")

    def on_status(self, rank: int, status: WorkerStatus, now: float) -> None:
        self._saw("on_status")

    def on_step(self, report: StepReport) -> None:
        self._saw("on_step")

    def after_poll(self, state: Running, last_step: int, now: float) -> None:
        self._saw("after_poll")

    def before_recovery(self, failure: WorkerFailure) -> None:
        self._saw(f"before_recovery {failure.kind.value}")

    def after_recovery_teardown(self, survivor_steps: list[int], now: float) -> None:
        self._saw(f"after_recovery_teardown {survivor_steps}")


def test_an_observer_passed_in_sees_the_transitions_and_reports_in_order(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder()
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 2)
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2], commits=[2]), Poll([status(0)], dead=[1])]),
        Plan(polls=[statuses([3, 4, 5, 6], done=True, t0=T1)]),
    ], ["failure.max_failures=1", "checkpoint.snapshot_every=0"], storage=storage,
        observers=[recorder])
    assert w.run() == Finished(step=6)
    assert recorder.seen == [
        "before_form 0", "after_form 0 (2 workers)", "after_restore none step 0",
        "after_launch 0", "on_status", "on_step", "on_status", "after_poll",
        "on_status", "after_poll",  # rank 1 found dead
        "before_recovery worker_died", "after_recovery_teardown [2]",
        "before_form 1", "after_form 1 (2 workers)", "after_restore storage step 2",
        "after_launch 1", "on_status", "on_step", "on_status", "after_poll"]
