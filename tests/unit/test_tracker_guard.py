"""A tracker's error at run time is a warning, never the end of the run: the guard around each
tracker (stalwart/integrations/loggers.py) records one `tracker_failed` event, prints one line,
and calls that tracker no more, while the run's rows and events still reach every other
callback. Wired as the Trainer wires callbacks: listeners of a real run directory's logs."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stalwart.callbacks import Callback
from stalwart.core import events as ev
from stalwart.core.config import load_config
from stalwart.integrations.loggers import Tracker, TrackerGuard, logger_callbacks
from stalwart.run_dir import RunDir

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class Recorder(Callback):
    """Another callback of the run (the user's, or another tracker)."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.kinds: list[str] = []
        self.ended = False

    def on_metrics(self, row: ev.MetricsRow) -> None:
        self.steps.append(row.step)

    def on_event(self, event: ev.Event) -> None:
        self.kinds.append(event.kind)

    def on_end(self, result: Any) -> None:
        self.ended = True


class ServerDown(Tracker):
    """A tracker whose server stops answering at its second row."""

    name = "downed"

    def __init__(self, fail_in: str = "on_metrics") -> None:
        self.fail_in = fail_in
        self.rows: list[int] = []
        self.events: list[str] = []
        self.abandoned = False

    def on_metrics(self, row: ev.MetricsRow) -> None:
        if self.fail_in == "on_metrics" and self.rows:
            raise ConnectionError("tracking server at http://mlflow.internal:5000 refused the "
                                  "connection\n(a second line of detail)")
        self.rows.append(row.step)

    def on_event(self, event: ev.Event) -> None:
        if self.fail_in == "on_event":
            raise ValueError("bad tag")
        self.events.append(event.kind)

    def on_end(self, result: Any) -> None:
        if self.fail_in == "on_end":
            raise TimeoutError("finish timed out")

    def abandon(self) -> None:
        self.abandoned = True


def _row(step: int) -> ev.MetricsRow:
    return ev.MetricsRow(step=step, loss=1.0 / step, lr=1e-3, tokens_per_s=10.0, world_size=1,
                         samples_seen=8 * step, time=time.time())


def _wire(run_dir: RunDir, callbacks: list[Callback]) -> None:
    """As Trainer.fit does: every callback listens to both logs."""
    run_dir.path.mkdir(parents=True, exist_ok=True)
    for cb in callbacks:
        run_dir.metrics.listeners.append(cb.on_metrics)
        run_dir.events.listeners.append(cb.on_event)


def _failures(run_dir: RunDir) -> list[ev.TrackerFailed]:
    return [e for e in ev.read_events(run_dir.events.path) if isinstance(e, ev.TrackerFailed)]


def test_a_tracker_failing_at_a_row_is_one_warning_and_the_run_goes_on(tmp_path: Path,
                                                                       capsys) -> None:
    rd = RunDir(tmp_path / "run")
    tracker, other = ServerDown(), Recorder()
    guard = TrackerGuard(tracker, rd.events)
    _wire(rd, [guard, other])  # the failing tracker first: the others still get each row

    rd.events.emit(ev.Started(world_size=1, steps=5, start_step=0, task="t:T"))
    for step in range(1, 6):
        rd.metrics.write(_row(step))
    rd.events.emit(ev.Finished(step=5, loss=0.2, val_loss=None))
    for cb in (guard, other):
        cb.on_end(SimpleNamespace(state="FINISHED", step=5))

    assert other.steps == [1, 2, 3, 4, 5] and other.ended
    assert other.kinds == ["started", "tracker_failed", "finished"]
    assert tracker.rows == [1] and tracker.events == ["started"], "not called after it failed"
    assert guard.failed and tracker.abandoned
    (failed,) = _failures(rd)
    assert (failed.tracker, failed.step) == ("downed", 2)
    assert failed.message == ("ConnectionError: tracking server at http://mlflow.internal:5000 "
                              "refused the connection\n(a second line of detail)")
    err = capsys.readouterr().err.splitlines()
    assert err == ["warning: tracker downed failed and is off for the rest of this run "
                   "(training goes on): ConnectionError: tracking server at "
                   "http://mlflow.internal:5000 refused the connection"]


@pytest.mark.parametrize(("fail_in", "message", "step"), [
    ("on_event", "ValueError: bad tag", None),
    ("on_end", "TimeoutError: finish timed out", 3),
])
def test_a_failure_at_an_event_or_at_the_end_is_a_warning_too(tmp_path: Path, capsys,
                                                              fail_in: str, message: str,
                                                              step: int | None) -> None:
    rd = RunDir(tmp_path / "run")
    guard = TrackerGuard(ServerDown(fail_in), rd.events)
    _wire(rd, [guard])
    rd.events.emit(ev.Started(world_size=1, steps=3, start_step=0, task="t:T"))
    rd.metrics.write(_row(3))
    guard.on_end(SimpleNamespace(state="FINISHED", step=3))
    (failed,) = _failures(rd)
    assert (failed.tracker, failed.message, failed.step) == ("downed", message, step)
    assert len(capsys.readouterr().err.splitlines()) == 1


def test_an_interrupt_is_not_a_tracker_failure(tmp_path: Path) -> None:
    """Ctrl-C while a tracker writes still stops the run."""
    class Interrupted(Tracker):
        name = "slow"

        def on_metrics(self, row: ev.MetricsRow) -> None:
            raise KeyboardInterrupt

    rd = RunDir(tmp_path / "run")
    _wire(rd, [TrackerGuard(Interrupted(), rd.events)])
    with pytest.raises(KeyboardInterrupt):
        rd.metrics.write(_row(1))


def test_a_real_tracker_that_cannot_start_is_a_warning(tmp_path: Path, monkeypatch,
                                                       capsys) -> None:
    """MLflow pointed at a store it cannot create (its directory's parent is a file) fails at
    its first row, in MLflow's own code: the run's rows still reach the others."""
    pytest.importorskip("mlflow")
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (blocker / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    rd = RunDir(tmp_path / "run")
    (guard,) = logger_callbacks(load_config(None, ['run.loggers=["mlflow"]']), rd)
    other = Recorder()
    _wire(rd, [guard, other])
    for step in (1, 2, 3):
        rd.metrics.write(_row(step))

    assert other.steps == [1, 2, 3] and guard.failed
    (failed,) = _failures(rd)
    assert failed.tracker == "mlflow" and failed.step == 1
    warnings = [line for line in capsys.readouterr().err.splitlines()
                if line.startswith("warning: tracker")]  # MLflow may log lines of its own
    assert len(warnings) == 1
    assert warnings[0].startswith("warning: tracker mlflow failed and is off for the rest of "
                                  "this run (training goes on): ")
