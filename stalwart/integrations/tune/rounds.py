"""What `stalwart sweep` prints while its trials run: one compact table per round.

A round ends when trials start, finish, are stopped early by the scheduler, or fail; the table
then has a line per trial: its state, its values of the searched keys, the step it reached and
its best value of the sweep's metric so far. Tune's own output (its status tables, each
trial's config and result blocks) is off unless `stalwart sweep --verbose` asks for it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from ray import tune

from stalwart.tables import cell, columns

# Tune's trial states as the sweep's tables name them (TERMINATED is finished or stopped
# early: which one, the step it reached says).
STATES = {"PENDING": "pending", "RUNNING": "running", "PAUSED": "paused", "ERROR": "error"}
ORDER = ["finished", "stopped early", "error", "running", "paused", "pending"]


class RoundTable(tune.Callback):
    """Prints the table of trials at the end of each Tune step that changed a trial's state.

    Picklable plain data only: Tune keeps it in the experiment's state (tuner.pkl)."""

    def __init__(self, *, search: Sequence[str], metric: str, mode: str, steps: int) -> None:
        self.search = list(search)
        self.metric = metric
        self.mode = mode
        self.steps = steps
        self._changed = False

    def on_trial_start(self, iteration: int, trials: list[Any], trial: Any, **info: Any
                       ) -> None:
        self._changed = True

    def on_trial_complete(self, iteration: int, trials: list[Any], trial: Any, **info: Any
                          ) -> None:
        self._changed = True

    def on_trial_error(self, iteration: int, trials: list[Any], trial: Any, **info: Any
                       ) -> None:
        self._changed = True

    def on_step_end(self, iteration: int, trials: list[Any], **info: Any) -> None:
        if self._changed:
            self._changed = False
            print(self.table(trials), file=sys.stdout, flush=True)

    def state(self, trial: Any) -> str:
        if trial.status != "TERMINATED":
            return STATES.get(trial.status, "pending")  # a state Tune added since: not yet run
        step = self._analysis(trial, "step", "last")
        return "finished" if step is not None and step >= self.steps else "stopped early"

    def table(self, trials: Sequence[Any]) -> str:
        """The round's table: a summary line, then a line per trial."""
        states = [self.state(t) for t in trials]
        counts = {s: states.count(s) for s in sorted(set(states), key=ORDER.index)}
        head = "trials: " + ", ".join(f"{n} {s}" for s, n in counts.items())
        rows = [[t.trial_id, state, *(cell(t.config.get(k)) for k in self.search),
                 cell(self._analysis(t, "step", "last")), cell(self._analysis(t, self.metric,
                                                                            self.mode))]
                for t, state in sorted(zip(trials, states, strict=True),
                                       key=lambda pair: pair[0].trial_id)]
        heads = ["trial", "state", *self.search, "step", f"best {self.metric}"]
        return f"{head}\n{columns(heads, rows, indent=2)}"

    @staticmethod
    def _analysis(trial: Any, metric: str, which: str) -> Any:
        """Tune's running summary of a reported metric (last, min, max); None before any."""
        return (trial.metric_analysis.get(metric) or {}).get(which)
