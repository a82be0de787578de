"""What the user watches on the driver: a live bar on a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

if TYPE_CHECKING:
    from stalwart.workers.reports import StepReport


class ProgressDisplay:
    def __init__(self, *, total_steps: int, start_step: int, log_every: int,
                 live: bool | None = None) -> None:
        self.console = Console(stderr=True)
        self.total = total_steps
        self.log_every = log_every
        self.live = self.console.is_terminal if live is None else live
        self._tokens_per_s: float | None = None
        self._progress: Progress | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
                TextColumn("eta"), TimeRemainingColumn(), TimeElapsedColumn(),
                console=self.console, transient=False)
            self._task = self._progress.add_task("train", total=total_steps,
                                                 completed=start_step, loss="-", tps="-")
            self._progress.start()

    def update(self, report: StepReport, tokens_per_s: float | None) -> None:
        if tokens_per_s is not None:
            self._tokens_per_s = tokens_per_s
        tps = f"{self._tokens_per_s:,.0f}" if self._tokens_per_s else "-"
        if self._progress is not None:
            self._progress.update(self._task, completed=report.step, loss=f"{report.loss:.4f}",
                                  tps=tps)
        elif tokens_per_s is not None:
            val = f"  val_loss {report.val_loss:.4f}" if report.val_loss is not None else ""
            print(f"step {report.step}/{self.total}  loss {report.loss:.4f}{val}  "
                  f"lr {report.lr:.2e}  {tps} tok/s", file=sys.stderr, flush=True)

    def log(self, message: str) -> None:
        self.console.print(message)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
