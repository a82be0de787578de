"""What every experiment tracker receives from a run, in one place: the metrics of a row, and
the run's failures, recoveries and resizes as step-aligned scalars plus one line of text.

TensorBoard, MLflow and Weights & Biases (stalwart/integrations/*_logger.py, tensorboard.py)
all log the same names, so a run reads the same in each:

  loss, val_loss, lr, tokens_per_s, world_size   one point per metrics row
  the task's own metrics (accuracy, val_accuracy, ...)   likewise, under their names
  events/failures     failures so far in this invocation, at the step each one hit
  events/resizes      resizes so far, at the step each one happened
  events/lost_steps   steps trained again after a recovery, at the step training resumed from
  events/recovery_s   seconds from a failure to the first step after it, at the same step
  events/numerical_faults   numerical faults so far (NaN, spike, mismatch), at their step
"""

from __future__ import annotations

from typing import Any

from stalwart.core import events as ev
from stalwart.core.config import flatten
from stalwart.core.events import Event, MetricsRow

ROW_SCALARS = ("loss", "val_loss", "lr", "tokens_per_s", "world_size")


def row_scalars(row: MetricsRow) -> dict[str, float]:
    """The numbers of one metrics row a tracker plots, by name (val_loss only when present)."""
    values = {name: getattr(row, name) for name in ROW_SCALARS}
    return {**{k: v for k, v in values.items() if v is not None}, **row.task_metrics}


def describe(event: Event) -> str | None:
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
    if isinstance(e, ev.NumericalFault):
        return f"{e.fault} at step {e.step}: {e.action} ({e.detail})"
    if isinstance(e, ev.FaultInjected):
        return f"injected {e.fault} on rank {e.rank} at step {e.step}"
    if isinstance(e, ev.Finished | ev.Stopped):
        return f"{e.kind} at step {e.step}"
    if isinstance(e, ev.Failed | ev.Interrupted):
        return f"{e.kind} at step {e.step}: {e.reason}" if e.reason else f"{e.kind} at step {e.step}"
    return None


def event_step(event: Event) -> int:
    """The step an event belongs to on the x axis."""
    if isinstance(event, ev.Recovered):
        return event.from_step
    return int(getattr(event, "step", None) or 0)


class EventScalars:
    """Turns events into the `events/...` scalars, counting failures and resizes."""

    def __init__(self) -> None:
        self.failures = 0
        self.resizes = 0
        self.numerical = 0

    def of(self, event: Event) -> dict[str, float]:
        if isinstance(event, ev.Failure):
            self.failures += 1
            return {"events/failures": self.failures}
        if isinstance(event, ev.Resized):
            self.resizes += 1
            return {"events/resizes": self.resizes}
        if isinstance(event, ev.Recovered):
            return {"events/lost_steps": event.lost_steps, "events/recovery_s": event.recovery_s}
        if isinstance(event, ev.NumericalFault):
            self.numerical += 1
            return {"events/numerical_faults": self.numerical}
        return {}


def flat_config(config: Any) -> dict[str, Any]:
    """The resolved config as `section.key` -> value (a tracker's run parameters)."""
    return flatten(config.to_dict())
