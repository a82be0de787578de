"""Weights & Biases: a run's metrics, its resolved config and its failures, recoveries and
resizes, as one W&B run (`run.loggers = ["wandb"]`).

W&B's own settings apply: `WANDB_PROJECT` (else `run.name`), `WANDB_ENTITY`, `WANDB_API_KEY`,
and `WANDB_MODE=offline` to write without an account (`wandb sync` uploads later). Its files
go under `<run dir>/wandb/`. Written on the driver from the rows and events the run writes.

- config: the resolved config, nested as in config.toml;
- history: the names of stalwart/integrations/run_log.py, against a `step` metric (a restore
  trains steps again, and W&B's own step may only grow, so the training step is a column);
- summary: `stalwart/events`, the text of each failure, recovery, resize and injected fault,
  and `stalwart/state` at the end.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.core.errors import ConfigError
from stalwart.core.events import Event, MetricsRow
from stalwart.integrations.loggers import Tracker
from stalwart.integrations.run_log import EventScalars, describe, event_step, row_scalars

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig


def check_available() -> None:
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("run.loggers = [\"wandb\"] needs the wandb package: "
                          "pip install 'stalwart[wandb]'")


class WandbLogger(Tracker):
    name = "wandb"

    def __init__(self, config: JobConfig, run_dir: Path) -> None:
        check_available()
        self.config = config
        self.run_dir = Path(run_dir)
        self.run: Any = None
        self._events = EventScalars()
        self._texts: list[str] = []
        self._lock = threading.Lock()

    def _open(self) -> Any:
        """The W&B run, started at the first row or event (so a run refused before it starts
        leaves nothing in the tracker)."""
        if self.run is None:
            import wandb

            self.run_dir.mkdir(parents=True, exist_ok=True)
            run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or self.config.run.name,
                name=self.run_dir.name, dir=str(self.run_dir), config=self.config.to_dict(),
                reinit="create_new",  # one W&B run per stalwart run, even in one process
                settings=wandb.Settings(console="off", silent=True))
            run.define_metric("step")
            run.define_metric("*", step_metric="step")
            self.run = run
            atexit.register(self._end, "FAILED")  # an exception never reaches on_end
        return self.run

    def on_metrics(self, row: MetricsRow) -> None:
        with self._lock:
            self._open().log({"step": row.step, **row_scalars(row)})

    def on_event(self, event: Event) -> None:
        text = describe(event)
        if text is None:
            return
        with self._lock:
            run = self._open()
            scalars = self._events.of(event)
            if scalars:
                run.log({"step": event_step(event), **scalars})
            self._texts.append(text)
            run.summary["stalwart/events"] = list(self._texts)

    def on_end(self, result: Any) -> None:
        self._end(getattr(result, "state", "FAILED"))

    def _end(self, state: str) -> None:
        with self._lock:
            if self.run is None:
                return
            atexit.unregister(self._end)
            self.run.summary["stalwart/state"] = state
            self.run.finish(exit_code=0 if state in ("FINISHED", "STOPPED") else 1)
            self.run = None

    def abandon(self) -> None:
        with self._lock:  # wandb's own exit hook finishes whatever it holds
            atexit.unregister(self._end)
            self.run = None
