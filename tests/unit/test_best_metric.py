"""checkpoint.keep_best by a metric the task never reports: refused at the first row that must
carry it. The pure check, and the controller ending the run on it (the fake worker group of
tests/unit/controller_world.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.core.config import JobConfig, load_config
from stalwart.core.errors import ConfigError
from stalwart.orchestrator.best_metric import missing_best_metric, settles
from stalwart.orchestrator.states import Failed, Finished
from stalwart.workers.reports import StepReport
from tests.fake_group import Plan
from tests.unit.controller_world import FakeWorld, statuses

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

KEEP_BEST = ["train.steps=6", "train.warmup_steps=0", "checkpoint.keep_best=1",
             "checkpoint.persist_every=1", "data.val_every=3"]


def row(step: int, *, val_loss: float | None = None, **metrics: float) -> StepReport:
    return StepReport(rank=0, step=step, loss=2.0, lr=1e-3, tokens=10, step_time_s=0.1,
                      time=float(step), val_loss=val_loss, metrics=metrics)


def config(metric: str) -> JobConfig:
    return load_config(None, [*KEEP_BEST, f"checkpoint.best_metric={metric}"])


def test_the_first_row_settles_a_training_metric_a_validation_step_a_val_one() -> None:
    assert settles(config("accuracy"), row(1))
    assert not settles(config("val_accuracy"), row(1))
    assert settles(config("val_accuracy"), row(3, val_loss=1.0))
    assert settles(config("val_loss"), row(6))  # the last step validates too
    assert not settles(load_config(None, ["checkpoint.best_metric=accuracy"]), row(1))


def test_a_metric_the_row_has_passes() -> None:
    assert missing_best_metric(config("loss"), row(1)) is None
    assert missing_best_metric(config("accuracy"), row(1, accuracy=0.5)) is None
    assert missing_best_metric(config("val_accuracy"),
                               row(3, val_loss=1.0, accuracy=0.5, val_accuracy=0.4)) is None


def test_a_metric_the_row_lacks_names_the_key_the_value_what_it_has_and_the_fix() -> None:
    error = missing_best_metric(config("accuracy"), row(1, perplexity=7.0))
    assert isinstance(error, ConfigError)
    assert str(error) == (
        "checkpoint.best_metric = 'accuracy' is never reported by the task, so "
        "checkpoint.keep_best = 1 would keep no best checkpoint: step 1 reports loss, "
        "perplexity. Rank by one of those, or make the task's loss return it: "
        "`return loss, {'accuracy': value}`")


def test_a_missing_val_metric_says_how_validation_names_it() -> None:
    error = str(missing_best_metric(config("val_accuracy"), row(3, val_loss=1.0)))
    assert "step 3 reports loss, val_loss." in error
    assert "(validation reports it as 'val_accuracy')" in error
    assert "held-out set" not in error


def test_no_validation_at_a_validation_step_means_the_task_has_no_held_out_set() -> None:
    error = str(missing_best_metric(config("val_loss"), row(3)))
    assert "'val_loss' is never reported" in error and "step 3 reports loss." in error
    assert "or give the task a held-out set (its val_dataset(config) returns None)" in error


def test_the_controller_fails_the_run_at_the_first_row_without_a_retry(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[statuses([1, 2]), statuses([3, 4])])],
                  [*KEEP_BEST, "checkpoint.best_metric=accuracy", "failure.max_failures=3",
                   "failure.retry_user_errors=true"])
    final = w.run()
    assert isinstance(final, Failed)
    assert final.reason.startswith("checkpoint.best_metric = 'accuracy' is never reported")
    assert w.transitions[-1] == ("RUNNING", "FAILED")
    assert w.all("failure") == [] and len(w.all("workers_started")) == 1  # not a fault
    assert w.shutdowns() == [False]
    assert [r["step"] for r in w.rows()] == [2]  # the first poll's row (log_every=2), then it stops


def test_a_val_metric_waits_for_the_first_validation_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        statuses([1, 2]), statuses([3, 4]), statuses([5, 6], done=True)])],
        [*KEEP_BEST, "checkpoint.best_metric=val_loss", "run.log_every=1"])
    final = w.run()
    assert isinstance(final, Failed) and "step 3 reports loss." in final.reason
    assert w.controller.last_step == 4


def test_a_reported_metric_runs_to_the_end(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[statuses(range(1, 7), done=True)])],
                  [*KEEP_BEST, "checkpoint.best_metric=loss"])
    assert w.run() == Finished(step=6)
