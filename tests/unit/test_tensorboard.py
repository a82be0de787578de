"""The TensorBoard callback: event files that TensorBoard's own reader reads back, with the
metrics as scalars against the step and the run's events as step-aligned scalars and text."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from stalwart.core.config import load_config
from stalwart.core.errors import ConfigError
from stalwart.core.events import MetricsRow, parse_event
from stalwart.integrations.loggers import TrackerGuard
from stalwart.integrations.tensorboard import TensorBoardLogger
from stalwart.trainer import Trainer

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

T0 = 1_700_000_000.0


def row(step: int, loss: float, **extra: Any) -> MetricsRow:
    return MetricsRow(step=step, loss=loss, lr=1e-3 * step, tokens_per_s=100.0 * step,
                      world_size=2, samples_seen=8 * step, time=T0 + step, **extra)


def read(log_dir: Path) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return acc


def points(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, pytest.approx(e.value)) for e in acc.Scalars(tag)]


def texts(acc: EventAccumulator, tag: str) -> list[tuple[int, str]]:
    """A text tag's entries (tensorboardX stores text under TAG/text_summary)."""
    return [(e.step, e.tensor_proto.string_val[0].decode())
            for e in acc.Tensors(f"{tag}/text_summary")]


def test_metrics_rows_become_scalars_against_the_step(tmp_path: Path) -> None:
    log_dir = tmp_path / "tensorboard"
    tb = TensorBoardLogger(log_dir)
    assert not log_dir.exists(), "nothing is written before the first row"
    tb.on_metrics(row(10, 2.5))
    tb.on_metrics(row(20, 2.0, val_loss=2.2))
    tb.on_metrics(row(30, 1.5))
    tb.on_end(None)

    acc = read(log_dir)
    assert set(acc.Tags()["scalars"]) == {"loss", "val_loss", "lr", "tokens_per_s",
                                          "world_size"}
    assert points(acc, "loss") == [(10, 2.5), (20, 2.0), (30, 1.5)]
    assert points(acc, "val_loss") == [(20, 2.2)]  # only the validation step has one
    assert points(acc, "lr") == [(10, 0.01), (20, 0.02), (30, 0.03)]
    assert points(acc, "tokens_per_s") == [(10, 1000.0), (20, 2000.0), (30, 3000.0)]
    assert points(acc, "world_size") == [(10, 2), (20, 2), (30, 2)]
    # wall time is when the step ended on the workers, not when the driver wrote it
    assert [e.wall_time for e in acc.Scalars("loss")] == [T0 + 10, T0 + 20, T0 + 30]


def test_the_tasks_own_metrics_are_scalars_too(tmp_path: Path) -> None:
    tb = TensorBoardLogger(tmp_path)
    tb.on_metrics(row(10, 2.5, task_metrics={"accuracy": 0.5}))
    tb.on_metrics(row(20, 2.0, val_loss=2.2, task_metrics={"accuracy": 0.6,
                                                           "val_accuracy": 0.55}))
    tb.on_end(None)
    acc = read(tmp_path)
    assert points(acc, "accuracy") == [(10, 0.5), (20, 0.6)]
    assert points(acc, "val_accuracy") == [(20, 0.55)]


def test_failures_recoveries_and_resizes_line_up_with_the_loss(tmp_path: Path) -> None:
    tb = TensorBoardLogger(tmp_path)
    tb.on_metrics(row(10, 2.5))
    tb.on_event(parse_event({"time": T0 + 11, "kind": "checkpoint_committed", "step": 10, "path": "x",
                 "save_s": 0.1}))  # not one of the events shown
    tb.on_event(parse_event({"time": T0 + 12, "kind": "failure", "failure_kind": "worker_died", "rank": 1,
                 "ranks": [1], "nodes": ["10.0.0.2"], "step": 12, "retry": True,
                 "attempt": 1, "detection_s": 0.2,
                 "message": "Traceback ...\nworker rank 1 died: SIGKILL"}))
    tb.on_event(parse_event({"time": T0 + 14, "kind": "recovered", "from_step": 12, "source": "memory",
                 "peer_fetches": 0, "world_size": 2, "lost_steps": 0, "recovery_s": 0.8,
                 "phases": {}, "generation": 1}))
    tb.on_event(parse_event({"time": T0 + 30, "kind": "resized", "old_world_size": 2, "new_world_size": 1,
                 "old_layout": {}, "new_layout": {}, "reason": "shrink", "step": 25,
                 "generation": 2}))
    tb.on_event(parse_event({"time": T0 + 40, "kind": "failure", "failure_kind": "hang", "rank": None,
                 "ranks": [], "nodes": [], "step": 31, "retry": False, "attempt": 2,
                 "detection_s": 5.0, "message": "hang: no rank completed a step"}))
    tb.on_event(parse_event({"time": T0 + 41, "kind": "failed", "reason": "too many failures",
                 "step": 31}))
    tb.on_end(None)

    acc = read(tmp_path)
    assert points(acc, "events/failures") == [(12, 1), (31, 2)]  # a staircase
    assert points(acc, "events/resizes") == [(25, 1)]
    assert points(acc, "events/lost_steps") == [(12, 0)]
    assert points(acc, "events/recovery_s") == [(12, 0.8)]
    assert texts(acc, "events/failure") == [
        (12, "worker_died at step 12 (ranks [1], attempt 1, recovering): worker rank 1 died: "
             "SIGKILL"),
        (31, "hang at step 31 (ranks [], attempt 2, not retried): hang: no rank completed "
             "a step")]
    assert texts(acc, "events/recovered") == [
        (12, "recovered from step 12 (memory) in 0.8 s, 0 steps lost, world size 2")]
    assert texts(acc, "events/resized") == [(25, "world 2 -> 1 (shrink) at step 25")]
    assert texts(acc, "events/failed") == [(31, "failed at step 31: too many failures")]
    assert {t.split("/")[1] for t in acc.Tags()["tensors"]} == {"failure", "recovered",
                                                                "resized", "failed"}


def trackers(trainer: Trainer) -> list[Any]:
    """The trackers among a Trainer's callbacks (each behind its guard)."""
    return [cb.tracker for cb in trainer.callbacks if isinstance(cb, TrackerGuard)]


def test_off_by_default_and_on_with_the_config_key(tmp_path: Path) -> None:
    assert trackers(Trainer(load_config(None), run_dir=tmp_path / "a")) == []
    config = load_config(None, ["run.tensorboard=true"])
    (tb,) = trackers(Trainer(config, run_dir=tmp_path / "b"))
    assert isinstance(tb, TensorBoardLogger)
    assert tb.log_dir == tmp_path / "b" / "tensorboard"
    assert not (tmp_path / "b").exists(), "a Trainer that has not started writes nothing"


def test_a_missing_writer_package_is_one_clear_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if it were not installed
    config = load_config(None, ["run.tensorboard=true"])
    with pytest.raises(ConfigError, match=r"run.tensorboard = true needs the tensorboardX "
                                          r"package: pip install 'stalwart\[tensorboard\]'"):
        Trainer(config, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    Trainer(load_config(None), run_dir=tmp_path / "run")  # off: the package is not needed
