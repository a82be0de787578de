"""checkpoint.keep_best's metric, checked against the task's first rows on the driver.

keep_best ranks checkpoints by the value of checkpoint.best_metric that each one's manifest
records from its step's row. A metric the task never reports is in no manifest, so without
this check the run would keep no best checkpoint and say nothing. The config cannot know the
task's metrics; its first rows do: the names are fixed by the first step (the engine refuses
a step that changes them), and a `val_` metric can only be in a validation step's row. The
first row that must carry the metric settles it; a missing one fails the run as a ConfigError.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stalwart.core.errors import ConfigError
from stalwart.orchestrator.observers import ControllerObserver

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig
    from stalwart.workers.reports import StepReport


def settles(config: JobConfig, report: StepReport) -> bool:
    """Whether `report`'s row must carry checkpoint.best_metric (with keep_best on): every
    row carries the loss and the task's metrics; only a validation step's row (as the worker
    validates: every data.val_every steps and at the last) carries the `val_` ones."""
    if not config.checkpoint.keep_best:
        return False
    if not config.checkpoint.best_metric.startswith("val_"):
        return True
    val_every = config.data.val_every
    return val_every > 0 and (report.step % val_every == 0 or report.step == config.train.steps)


def reported(report: StepReport) -> list[str]:
    """What a checkpoint of this row's step would record for keep_best to rank by."""
    val = ["val_loss"] if report.val_loss is not None else []
    return ["loss", *val, *sorted(report.metrics)]


def missing_best_metric(config: JobConfig, report: StepReport) -> ConfigError | None:
    """The error when `report`'s row lacks checkpoint.best_metric, naming the metrics it has
    and the fix; None when it has it. Ask only of a row that `settles` the check."""
    ck = config.checkpoint
    names = reported(report)
    if ck.best_metric in names:
        return None
    return ConfigError(
        f"checkpoint.best_metric = {ck.best_metric!r} is never reported by the task, so "
        f"checkpoint.keep_best = {ck.keep_best} would keep no best checkpoint: step "
        f"{report.step} reports {', '.join(names)}. Rank by one of those, "
        f"{_fix(ck.best_metric, has_validation=report.val_loss is not None)}")


def _fix(metric: str, *, has_validation: bool) -> str:
    """The other way out: make the task report `metric`."""
    if metric == "val_loss":
        return "or give the task a held-out set (its val_dataset(config) returns None)"
    name = metric.removeprefix("val_")
    fix = f"or make the task's loss return it: `return loss, {{{name!r}: value}}`"
    if metric.startswith("val_"):
        fix += f" (validation reports it as {metric!r})"
        if not has_validation:
            fix += ", and give the task a held-out set (its val_dataset(config) returns None)"
    return fix


class BestMetricCheck(ControllerObserver):
    """Watches rank 0's rows until one settles the check; `error` is then its verdict, for the
    controller to end the run with (None: keep_best's metric is there, or not settled yet)."""

    def __init__(self, config: JobConfig) -> None:
        self.config = config
        self.settled = not config.checkpoint.keep_best
        self.error: ConfigError | None = None

    def on_step(self, report: StepReport) -> None:
        if self.settled or not settles(self.config, report):
            return
        self.settled = True
        self.error = missing_best_metric(self.config, report)
