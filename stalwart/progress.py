"""What the user watches on the driver: a live bar on a terminal, plain lines elsewhere.

Both show the loss, the last validation's `val_loss`, the task's own metrics (what its loss
returns besides the loss, and their `val_` means) and the throughput, labelled by what the
task's `count_tokens` counts: tokens, or samples when it counts one per sample (see
throughput_unit). A display that can no longer be written (its reader went away: `2>&1 |
head`) goes quiet; the run goes on.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from stalwart.core.events import MetricsRow

if TYPE_CHECKING:
    from stalwart.workers.reports import StepReport


def throughput_unit(tokens_per_step: float | None, samples_per_step: float | None) -> str:
    """"samples" when the task's count_tokens counts one per sample, else "tokens".

    A task declares what it counts by its `count_tokens`: the default counts the targets'
    elements of an (inputs, targets) pair, `labels` (else `input_ids`) of a dict, and the
    samples of anything else. A regression's or a classifier's targets hold one value per
    sample, so it counts samples; a language model's hold one per token. Each step trains
    `train.global_batch_size` samples: a count equal to that is a count of samples."""
    if tokens_per_step is None or not samples_per_step:
        return "tokens"
    return "samples" if round(tokens_per_step) == round(samples_per_step) else "tokens"


def metrics_text(values: Mapping[str, float]) -> str:
    """`name value` pairs, as the progress line and the closing summary print them."""
    return "  ".join(f"{name} {_number(name, value)}" for name, value in values.items())


def _number(name: str, value: float) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:.4f}" if name in ("loss", "val_loss") else f"{value:.4g}"


class ProgressDisplay:
    def __init__(self, *, total_steps: int, start_step: int, log_every: int,
                 live: bool | None = None) -> None:
        self.console = Console(stderr=True)
        self.total = total_steps
        self.log_every = log_every
        self.live = self.console.is_terminal if live is None else live
        self.unit: str | None = None
        """What the throughput counts, from the first step's report (throughput_unit)."""
        self._tokens_per_s: float | None = None
        self._validation: dict[str, float] = {}  # the last validation's val_ values
        self._metrics: dict[str, float] = {}
        self._quiet = False
        self._progress: Progress | None = None
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[metrics]}"),
                TextColumn("{task.fields[tps]}"),
                TextColumn("eta"), TimeRemainingColumn(), TimeElapsedColumn(),
                console=self.console, transient=False)
            self._task = self._progress.add_task("train", total=total_steps,
                                                 completed=start_step, loss="-", metrics="",
                                                 tps="-")
            self._progress.start()

    def update(self, report: StepReport, tokens_per_s: float | None) -> None:
        if self._quiet:
            return
        if self.unit is None and report.step > 0:
            self.unit = throughput_unit(report.tokens, report.samples_seen / report.step)
        if tokens_per_s is not None:
            self._tokens_per_s = tokens_per_s
        tps = f"{self._tokens_per_s:,.0f}" if self._tokens_per_s else "-"
        tps += f" {self.unit or 'tokens'}/s"
        own = {k: v for k, v in report.metrics.items() if not k.startswith("val_")}
        validation = {k: v for k, v in report.metrics.items() if k.startswith("val_")}
        if report.val_loss is not None:
            validation = {"val_loss": report.val_loss, **validation}
        try:
            if self._progress is not None:
                # The bar holds the last validation's values until the next one.
                self._metrics = own or self._metrics
                self._validation = validation or self._validation
                self._progress.update(self._task, completed=report.step,
                                      loss=f"{report.loss:.4f}", tps=tps,
                                      metrics=metrics_text({**self._validation,
                                                            **self._metrics}))
            elif tokens_per_s is not None:
                extra = metrics_text({**validation, **own})
                print(f"step {report.step}/{self.total}  loss {report.loss:.4f}"
                      f"{'  ' + extra if extra else ''}  lr {report.lr:.2e}  {tps}",
                      file=sys.stderr, flush=True)
        except BrokenPipeError:
            self._go_quiet()

    def log(self, message: str) -> None:
        if self._quiet:
            return
        try:
            # One line as written: not wrapped at 80 columns off a terminal (a log file, a
            # pipe), and brackets (`[faults]`, `[1, 3]`) taken as text, not rich markup.
            self.console.print(message, markup=False, highlight=False, soft_wrap=True)
        except BrokenPipeError:
            self._go_quiet()

    def _go_quiet(self) -> None:
        """Nobody reads the display any more: stop writing it, and never stop the run."""
        self._quiet = True
        progress, self._progress = self._progress, None
        if progress is not None:
            try:  # its refresh thread must end; its last render goes nowhere
                progress.stop()
            except OSError:
                pass

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


ROW_COLUMNS = frozenset(f.name for f in dataclasses.fields(MetricsRow)) - {"task_metrics"}
"""Columns of a metrics row (as in metrics.jsonl) that are not the task's own metrics."""


def task_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """The task's own metrics of a metrics row (`val_` ones too), in the row's order."""
    return {k: v for k, v in row.items() if k not in ROW_COLUMNS
            and isinstance(v, int | float) and not isinstance(v, bool)}


def row_throughput_unit(row: Mapping[str, Any]) -> str:
    """throughput_unit of a metrics row: its tokens per step against its samples per step."""
    window, steps, step = row.get("window_s"), row.get("steps_in_window"), row.get("step")
    if not (window and steps and step and row.get("tokens_per_s") is not None):
        return "tokens"
    return throughput_unit(row["tokens_per_s"] * window / steps,
                           row.get("samples_seen", 0) / step)
