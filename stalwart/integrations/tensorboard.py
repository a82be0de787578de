"""TensorBoard: a run's metrics, and its failures, recoveries and resizes, as TensorBoard event
files under RUN_DIR/tensorboard/ (`tensorboard --logdir RUN_DIR/tensorboard`).

A Callback (stalwart/callbacks.py): it sees exactly the rows the run writes to metrics.jsonl and
events.jsonl, on the driver, so it adds no work on the workers. The Trainer adds it when
`run.tensorboard` is true. It writes with tensorboardX, which is light (numpy and protobuf) and
comes with Ray's train and tune extras anyway; TensorBoard itself is only needed to look.

Scalars, against the training step (wall time: when the step ended on the workers):

  loss, val_loss, lr, tokens_per_s, world_size   one point per metrics row, named as its columns
  the task's own metrics (accuracy, val_accuracy, ...)   likewise, under their names
  events/failures     failures so far in this invocation, at the step each one hit
  events/resizes      resizes so far, at the step each one happened
  events/lost_steps   steps trained again after a recovery, at the step training resumed from
  events/recovery_s   seconds from a failure to the first step after it, at the same step

TensorBoard has no markers on a chart, so the events are step-aligned scalars: the staircase of
events/failures sits under the loss curve at the same x, and a jump in the loss or a dip in
tokens_per_s can be matched to the failure or resize that caused it. What happened is in the
Text tab, one tag per kind (events/failure, events/recovered, ...; tensorboardX appends
/text_summary): TensorBoard drops a tag's points at or after a step that comes again lower (a
restore trains steps again), and a shared tag would lose a failure to the recovery that
restores to an earlier step.
"""

from __future__ import annotations

import atexit
import importlib.util
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart import events as ev
from stalwart.callbacks import Callback
from stalwart.errors import ConfigError
from stalwart.events import Event, MetricsRow

if TYPE_CHECKING:
    from stalwart.config import JobConfig

SCALARS = ("loss", "val_loss", "lr", "tokens_per_s", "world_size")
# How often the writer's thread flushes to disk: a TensorBoard that is watching a run shows
# new points within seconds (tensorboardX's default is 2 minutes).
FLUSH_S = 5


def check_available() -> None:
    """One clear error, before anything starts, when the writer's package is missing."""
    if importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError("run.tensorboard = true needs the tensorboardX package: "
                          "pip install 'stalwart[tensorboard]'")


def tensorboard_callbacks(config: JobConfig, run_dir: Path) -> list[Callback]:
    """[a TensorBoardLogger writing to RUN_DIR/tensorboard] when run.tensorboard is on, else []."""
    if not config.run.tensorboard:
        return []
    check_available()
    return [TensorBoardLogger(run_dir / "tensorboard")]


def _describe(event: Event) -> str | None:
    """One line of text for the events worth reading next to the curves (None: not shown)."""
    e = event
    if isinstance(e, ev.Failure):
        message = e.message.strip().splitlines()
        return (f"{e.failure_kind} at step {e.step} (ranks {e.ranks}, attempt "
                f"{e.attempt}, {'recovering' if e.retry else 'not retried'}): "
                f"{message[-1] if message else ''}")
    if isinstance(e, ev.Recovered):
        return (f"recovered from step {e.from_step} ({e.source}) in {e.recovery_s} s, "
                f"{e.lost_steps} steps lost, world size {e.world_size}")
    if isinstance(e, ev.Resized):
        return f"world {e.old_world_size} -> {e.new_world_size} ({e.reason}) at step {e.step}"
    if isinstance(e, ev.FaultInjected):
        return f"injected {e.fault} on rank {e.rank} at step {e.step}"
    if isinstance(e, ev.Finished | ev.Stopped):
        return f"{e.kind} at step {e.step}"
    if isinstance(e, ev.Failed | ev.Interrupted):
        return f"{e.kind} at step {e.step}: {e.reason}" if e.reason else f"{e.kind} at step {e.step}"
    return None


def _event_step(event: Event) -> int:
    """The step an event belongs to on the x axis."""
    if isinstance(event, ev.Recovered):
        return event.from_step
    return int(getattr(event, "step", None) or 0)


class TensorBoardLogger(Callback):
    """Writes metrics rows and run events to TensorBoard event files in `log_dir`.

    The directory and its file are created at the first row or event, so a run that is
    refused before it starts leaves nothing behind. Hooks come from the controller's loop;
    the lock covers a close() from the interpreter's exit while a hook runs.
    """

    def __init__(self, log_dir: str | Path) -> None:
        check_available()
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        self._lock = threading.Lock()
        self._failures = 0
        self._resizes = 0

    def _open(self) -> Any:
        if self._writer is None:
            from tensorboardX import SummaryWriter

            self.log_dir.mkdir(parents=True, exist_ok=True)
            self._writer = SummaryWriter(logdir=str(self.log_dir), flush_secs=FLUSH_S)
            # A run that ends by an exception never calls on_end: rows still queued in the
            # writer's thread would be lost at exit without this.
            atexit.register(self.close)
        return self._writer

    def on_metrics(self, row: MetricsRow) -> None:
        with self._lock:
            writer = self._open()
            for name in SCALARS:
                value = getattr(row, name)
                if value is not None:
                    writer.add_scalar(name, value, global_step=row.step, walltime=row.time)
            for name, value in row.task_metrics.items():
                writer.add_scalar(name, value, global_step=row.step, walltime=row.time)

    def on_event(self, event: Event) -> None:
        text = _describe(event)
        if text is None:
            return
        kind, step, when = event.kind, _event_step(event), event.time
        with self._lock:
            writer = self._open()
            if kind == "failure":
                self._failures += 1
                writer.add_scalar("events/failures", self._failures, global_step=step,
                                  walltime=when)
            elif kind == "resized":
                self._resizes += 1
                writer.add_scalar("events/resizes", self._resizes, global_step=step,
                                  walltime=when)
            elif isinstance(event, ev.Recovered):
                writer.add_scalar("events/lost_steps", event.lost_steps, global_step=step,
                                  walltime=when)
                writer.add_scalar("events/recovery_s", event.recovery_s, global_step=step,
                                  walltime=when)
            writer.add_text(f"events/{kind}", text, global_step=step, walltime=when)

    def on_end(self, result: Any) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
                atexit.unregister(self.close)
