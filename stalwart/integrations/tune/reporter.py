"""TuneReporter: a run's metrics and checkpoints, reported to Ray Tune as they are written.

One report per logged step (metrics.jsonl's row), so a scheduler decides on the same numbers
the run directory holds. A checkpoint is committed asynchronously, after the step it saved;
it goes to Tune as a copy Tune persists under the trial:

- by default with the first logged step at or after its own (ASHA and FIFO need no
  checkpoint in any particular report); the run's last row waits for the final checkpoint and
  goes with it, since a scheduler may stop the trial at that report (ASHA at `max_t`);
- `with_checkpoints=True` (Population Based Training, which clones a trial from the checkpoint
  of that trial's latest report): a row at a checkpoint step is held until its checkpoint
  commits and reported together with it, so every such report carries one.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

from stalwart.callbacks import Callback
from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.catalog import read_step_dir
from stalwart.checkpointing.storage.layout import filesystem
from stalwart.checkpointing.storage.transfer import copy_checkpoint
from stalwart.core.errors import TaskError
from stalwart.core.events import CheckpointCommitted, Event, MetricsRow


def stage(path: str, staging: Path) -> Path | None:
    """A copy of a committed step directory that the run's retention (checkpoint.keep_last)
    cannot delete while Tune waits to copy it: hard links on this machine's filesystem (no
    bytes copied), a copy when the storage is on another filesystem or remote. None if it is
    already gone. The manifest's file names are checked before any is joined under `staging`."""
    fs, root = filesystem(path)
    dest = staging / root.rstrip("/").rsplit("/", 1)[-1]
    try:
        info = read_step_dir(path)
        if "file" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
            return Path(copy_checkpoint(info, str(dest), as_step_dir=False).path)
        dest.mkdir(parents=True, exist_ok=True)
        try:
            for name in info.files_in_commit_order():
                os.link(f"{root}/{name}", dest / name)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
            # Storage on another filesystem than the trial (EXDEV), or one without hard
            # links: copy instead, data first and the manifest last, then verify.
            shutil.rmtree(dest, ignore_errors=True)
            return Path(copy_checkpoint(info, str(dest), as_step_dir=False).path)
        return dest
    except (CheckpointError, FileNotFoundError, FileExistsError):
        shutil.rmtree(dest, ignore_errors=True)
        return None  # deleted by retention meanwhile: a newer checkpoint comes with a later row


class TuneReporter(Callback):
    def __init__(self, staging: Path, metric: str | None = None, *,
                 with_checkpoints: bool = False, final_step: int | None = None) -> None:
        self.staging = Path(staging)
        """Where committed checkpoints wait for Tune (see `stage`); emptied as they go."""
        self.metric = metric
        self.with_checkpoints = with_checkpoints
        self.final_step = final_step
        self._carried: dict[str, Any] = {}
        self._last: dict[str, Any] | None = None
        self._commits: dict[int, Path] = {}  # step -> staged copy of a commit not reported
        self._held: list[dict[str, Any]] = []  # rows waiting for their checkpoint
        self._columns: set[str] = set()  # every column the run's rows had

    def on_event(self, event: Event) -> None:
        if not isinstance(event, CheckpointCommitted):
            return
        staged = stage(event.path, self.staging)
        if staged is None:
            return
        self._commits[event.step] = staged
        if any(m["step"] == event.step for m in self._held):
            self._flush_held(up_to=event.step)

    def on_metrics(self, metrics_row: MetricsRow) -> None:
        row = metrics_row.to_row()
        self._columns.update(row)
        # Validation's columns (val_loss, val_<task metric>) hold their last value between
        # the steps that produce them.
        self._carried.update({k: v for k, v in row.items() if k.startswith("val_")})
        metrics = {**self._carried, **row}
        if self.metric is not None and self.metric not in metrics:
            self._check_coming(row)
            return  # e.g. val_loss before the first validation: Tune needs it in every report
        self._last = metrics
        if self.with_checkpoints or row["step"] == self.final_step:
            self._held.append(metrics)
            if row["step"] in self._commits:  # its commit was written first
                self._flush_held(up_to=row["step"])
            return
        self._report(metrics)

    def _check_coming(self, row: dict[str, Any]) -> None:
        """A trial whose metric will never come fails at once, naming the run's columns: a
        task's metric is on every row, and its `val_` mean on every validation row."""
        validation = "val_loss" in row
        if self.metric == "val_loss" or (self.metric.startswith("val_") and not validation):
            return
        raise TaskError(f"the sweep's metric {self.metric!r} is not reported: the run's "
                        f"{'validation ' if validation else ''}metrics rows have "
                        f"{', '.join(sorted(row))}")

    def on_end(self, result: Any) -> None:
        """Rows still held, and a checkpoint committed after the last logged step (the final
        one), still reach Tune. A run that never reported the sweep's metric (a task
        metric its loss does not return) is an error that names the columns it had."""
        if self.metric is not None and self._last is None and self._columns \
                and getattr(result, "state", None) == "FINISHED":
            raise TaskError(f"the sweep's metric {self.metric!r} was never reported; the "
                            f"run's metrics.jsonl has {', '.join(sorted(self._columns))}")
        if self._held:
            self._flush_held(up_to=self._held[-1]["step"])
        elif self._commits and self._last is not None:
            self._report(dict(self._last))

    def _flush_held(self, up_to: int) -> None:
        """Held rows up to step `up_to`, in order; the checkpoint goes with the last."""
        ready = [m for m in self._held if m["step"] <= up_to]
        self._held = [m for m in self._held if m["step"] > up_to]
        for metrics in ready[:-1]:
            self._report(metrics, checkpoint=False)
        self._report(ready[-1])

    def _report(self, metrics: dict[str, Any], *, checkpoint: bool = True) -> None:
        """Report `metrics` with the newest commit of their step or before, if any (never
        with a newer one): older unreported commits are superseded by it."""
        from ray import tune

        steps = [s for s in self._commits if s <= metrics["step"]] if checkpoint else []
        if not steps:
            tune.report(metrics)
            return
        step = max(steps)
        path = self._commits[step]
        for older in [s for s in self._commits if s < step]:  # superseded: never reported
            shutil.rmtree(self._commits.pop(older), ignore_errors=True)
        del self._commits[step]
        metrics["checkpoint_step"] = step
        try:
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(str(path)))
        finally:  # Tune has its own copy now
            shutil.rmtree(path, ignore_errors=True)
