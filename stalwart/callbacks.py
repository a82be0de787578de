"""Callbacks: code of the user's (or of an integration such as Ray Tune) that sees a run as
it goes, through exactly what the run writes to its run directory.

    class PrintLoss(stalwart.Callback):
        def on_metrics(self, row):
            print(row.step, row.loss)

    Trainer(config, callbacks=[PrintLoss()]).fit()

Both hooks run on the driver, in the controller's loop, right after the row is written: keep
them quick (the controller polls worker health from the same loop). An exception raised in a
hook ends the run as an interrupted driver would: workers are stopped, checkpoints stay (a way
to stop a run from its own metrics). The experiment trackers of `run.loggers` are the
exception: theirs is a warning, and the run goes on without that tracker
(stalwart/integrations/loggers.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.core.events import Event, MetricsRow


class Callback:
    def on_metrics(self, row: MetricsRow) -> None:
        """One row of metrics.jsonl, typed (stalwart/core/events.py: MetricsRow)."""

    def on_event(self, event: Event) -> None:
        """One event of events.jsonl, typed: one dataclass per kind (stalwart/core/events.py)."""

    def on_end(self, result: Any) -> None:
        """The run's RunResult, after the workers have stopped."""
