"""Normal runs and stopping them (Ctrl-C); the controller driven by the fake worker group
(tests/unit/controller_world.py, tests/fake_group.py)."""

from __future__ import annotations

import dataclasses
import signal
import threading
from pathlib import Path

import pytest

from stalwart.checkpointing.storage.catalog import CheckpointInfo
from stalwart.checkpointing.storage.layout import join
from stalwart.orchestrator.outcome import Outcome
from stalwart.orchestrator.states import TRANSITIONS, Finished, Stopped
from stalwart.workers.reports import WorkerStatus
from tests.fake_group import Plan, Poll, actors
from tests.unit.controller_world import (
    HAPPY,
    T0,
    TOKENS,
    WORLD,
    FakeWorld,
    _commit_checkpoint,
    ctrl_c,
    report,
    status,
    statuses,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


# ---------------------------------------------------------------------------- normal runs


def test_every_live_state_has_one_handler_found_by_its_type(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan()])
    live = {state for state, after in TRANSITIONS.items() if after}
    assert set(w.controller._handlers) == live  # a terminal state has none
    for state, handler in w.controller._handlers.items():
        assert handler.__name__ == f"_on_{state.__name__.lower()}"


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
        ("top_up", "SCHEDULING"), ("refresh", "SCHEDULING"), ("pick", "RENDEZVOUS"),
        ("form", "RENDEZVOUS"), ("launch", "RESTORING"), ("poll", "RUNNING"),
        ("top_up", "RUNNING"),  # the spares, once the world has trained a step
        ("poll", "RUNNING"), ("poll", "RUNNING"), ("poll", "RUNNING"), ("shutdown", "FINISHED")]
    assert w.named("pick")[0].args == (2, 0)
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
    assert c.throughput.tokens_total == 6 * TOKENS
    assert c.throughput.train_time_s == pytest.approx(5.1)
    # what the trainer reads: a frozen summary, not the controller's accounts
    assert c.outcome() == Outcome(step=6, loss=pytest.approx(10.0 / 6), val_loss=None,
                                  stop_signal=None, tokens_per_s=pytest.approx(6 * TOKENS / 5.1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.outcome().step = 7  # type: ignore[misc]


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
    assert w.controller.outcome().val_loss == 2.5


def test_resume_from_a_checkpoint_restores_before_launch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resume = CheckpointInfo(step=4, path="/somewhere/step_000000004", manifest={})
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[statuses([5, 6], done=True)])],
                  resume_from=resume)
    assert w.run() == Finished(step=6)
    assert [(c.name, c.state, c.args) for c in w.calls[:7]] == [
        ("top_up", "SCHEDULING", (False,)), ("refresh", "SCHEDULING", (0.0,)),
        ("pick", "RENDEZVOUS", (2, 0)), ("form", "RENDEZVOUS", ()),
        ("restore", "RESTORING", ("/somewhere/step_000000004",)),
        ("launch", "RESTORING", (True,)), ("poll", "RUNNING", ())]
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
    assert [c.name for c in w.calls if c.state == "RUNNING"] == [
        "poll", "top_up", "request_stop", "poll"]
    assert any("stopping after the step in flight" in m for m in w.display.logs)
    assert w.kinds() == ["started", "checkpoint_committed", "stopped"]
    assert w.event("stopped")["step"] == 3
    assert w.shutdowns() == [True]
    assert w.controller.outcome().stop_signal is None  # asked in code, by no signal


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
    assert w.controller.outcome().stop_signal == signal.SIGINT

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
    assert w.named("pick", "form") == []
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
