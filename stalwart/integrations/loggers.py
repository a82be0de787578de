"""run.loggers: the experiment trackers a run writes to, as Callbacks on the driver, each behind a
guard so that a tracker never ends a run.

Each one's package and settings are checked when the Trainer is made, so a missing package or a
W&B with neither an API key nor offline mode is a single clear error before Ray or any worker
starts. What each logs is in stalwart/integrations/run_log.py.

At run time a tracker's error (at its start, at a row, an event or the run's end) is a warning:
a `tracker_failed` event, one line on the console, and the run goes on. That tracker gets
nothing more in this invocation: one that failed once (a server that is down, a full disk)
would most likely fail again, and each try may cost the controller's loop its client's timeouts.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from stalwart.callbacks import Callback
from stalwart.core.events import Event, MetricsRow, TrackerFailed

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig
    from stalwart.core.run_logs import EventLog
    from stalwart.run_dir import RunDir

# The console line shows the error's first line, this long at most; the event keeps more.
LINE_CHARS = 200
MESSAGE_CHARS = 4000


class Tracker(Callback):
    """An experiment tracker's callback: the hooks, and a way to let go of its run."""

    name: ClassVar[str]
    """Its name in run.loggers."""

    def abandon(self) -> None:
        """Forget the tracker's run without writing to it again (it failed): nothing of it
        is left to run at the interpreter's exit."""


class TrackerGuard(Callback):
    """Calls one tracker's hooks. Its first error is a warning (a TrackerFailed event in the
    run's log and a console line), after which the tracker is called no more."""

    def __init__(self, tracker: Tracker, events: EventLog) -> None:
        self.tracker = tracker
        self.events = events
        self.failed = False
        self._lock = threading.Lock()

    def on_metrics(self, row: MetricsRow) -> None:
        self._call(self.tracker.on_metrics, row, row.step)

    def on_event(self, event: Event) -> None:
        self._call(self.tracker.on_event, event, getattr(event, "step", None))

    def on_end(self, result: Any) -> None:
        self._call(self.tracker.on_end, result, getattr(result, "step", None))

    def _call(self, hook: Callable[[Any], None], arg: Any, step: int | None) -> None:
        if self.failed:
            return
        try:
            hook(arg)
        except Exception as exc:  # any tracker's own error types: none may end the run
            self._fail(exc, step)

    def _fail(self, exc: Exception, step: int | None) -> None:
        with self._lock:  # hooks may come from two threads: one warning
            if self.failed:
                return
            self.failed = True
        self.tracker.abandon()
        message = f"{type(exc).__name__}: {exc}".strip().rstrip(":")
        line = next((s.strip() for s in message.splitlines() if s.strip()), message)
        if len(line) > LINE_CHARS:
            line = line[:LINE_CHARS - 3] + "..."
        print(f"warning: tracker {self.tracker.name} failed and is off for the rest of this "
              f"run (training goes on): {line}", file=sys.stderr, flush=True)
        self.events.emit(TrackerFailed(tracker=self.tracker.name,
                                       message=message[:MESSAGE_CHARS], step=step))


def make_tracker(name: str, config: JobConfig, run_dir: RunDir) -> Tracker:
    """The tracker `name`, its package and settings checked (ConfigError)."""
    if name == "tensorboard":
        from stalwart.integrations.tensorboard import TensorBoardLogger

        return TensorBoardLogger(run_dir.path / "tensorboard")
    if name == "mlflow":
        from stalwart.integrations.mlflow_logger import MLflowLogger

        return MLflowLogger(config, run_dir.path)
    if name == "wandb":
        from stalwart.integrations.wandb_logger import WandbLogger

        return WandbLogger(config, run_dir.path)
    raise ValueError(f"unknown logger {name!r}")  # run.loggers is checked when it is read


def logger_callbacks(config: JobConfig, run_dir: RunDir) -> list[Callback]:
    """One guarded callback per active logger (run.loggers, and run.tensorboard's
    `tensorboard`); a tracker's failure is recorded in `run_dir`'s events."""
    return [TrackerGuard(make_tracker(name, config, run_dir), run_dir.events)
            for name in config.run.active_loggers]
