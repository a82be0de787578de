"""TensorBoard: a run's metrics, and its failures, recoveries and resizes, as TensorBoard event
files under RUN_DIR/tensorboard/ (`tensorboard --logdir RUN_DIR/tensorboard`).

A tracker (stalwart/integrations/loggers.py): it sees exactly the rows the run writes to
metrics.jsonl and events.jsonl, on the driver, so it adds no work on the workers. The Trainer
adds it when `run.loggers` names it or `run.tensorboard` is true; an error of its own is a
warning, and the run goes on without it. It writes with tensorboardX, which is light (numpy
and protobuf) and comes with Ray's train and tune extras anyway; TensorBoard itself is only
needed to look.

Scalars, against the training step (wall time: when the step ended on the workers): the
names every tracker logs (stalwart/integrations/run_log.py).

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
import secrets
import threading
from pathlib import Path
from typing import Any

from stalwart.core.errors import ConfigError
from stalwart.core.events import Event, MetricsRow
from stalwart.core.safe_files import make_dir_nofollow
from stalwart.integrations.loggers import Tracker
from stalwart.integrations.run_log import EventScalars, describe, event_step, row_scalars

# How often the writer's thread flushes to disk: a TensorBoard that is watching a run shows
# new points within seconds (tensorboardX's default is 2 minutes).
FLUSH_S = 5


def check_available() -> None:
    """One clear error, before anything starts, when the writer's package is missing."""
    if importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError("run.tensorboard = true needs the tensorboardX package: "
                          "pip install 'stalwart[tensorboard]'")


class TensorBoardLogger(Tracker):
    """Writes metrics rows and run events to TensorBoard event files in `log_dir`.

    The directory and its file are created at the first row or event, so a run that is
    refused before it starts leaves nothing behind. Hooks come from the controller's loop;
    the lock covers a close() from the interpreter's exit while a hook runs.
    """

    name = "tensorboard"

    def __init__(self, log_dir: str | Path) -> None:
        check_available()
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        self._lock = threading.Lock()
        self._events = EventScalars()

    def _open(self) -> Any:
        if self._writer is None:
            from tensorboardX import SummaryWriter

            make_dir_nofollow(self.log_dir)
            # tensorboardX names its file by the second and the host and opens it without
            # O_EXCL: a random suffix leaves no name to plant a symbolic link at beforehand.
            self._writer = SummaryWriter(logdir=str(self.log_dir), flush_secs=FLUSH_S,
                                         filename_suffix=f".{secrets.token_hex(8)}")
            # A run that ends by an exception never calls on_end: rows still queued in the
            # writer's thread would be lost at exit without this.
            atexit.register(self.close)
        return self._writer

    def on_metrics(self, row: MetricsRow) -> None:
        with self._lock:
            writer = self._open()
            for name, value in row_scalars(row).items():
                writer.add_scalar(name, value, global_step=row.step, walltime=row.time)

    def on_event(self, event: Event) -> None:
        text = describe(event)
        if text is None:
            return
        kind, step, when = event.kind, event_step(event), event.time
        with self._lock:
            writer = self._open()
            for name, value in self._events.of(event).items():
                writer.add_scalar(name, value, global_step=step, walltime=when)
            writer.add_text(f"events/{kind}", text, global_step=step, walltime=when)

    def on_end(self, result: Any) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            if self._writer is not None:
                self._writer.close()
                self._writer = None
                atexit.unregister(self.close)

    def abandon(self) -> None:
        with self._lock:
            atexit.unregister(self.close)
            self._writer = None  # its thread is a daemon: nothing waits for it at exit
