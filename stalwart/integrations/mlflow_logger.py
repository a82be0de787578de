"""MLflow: a run's metrics, its resolved config and its failures, recoveries and resizes, as one
MLflow run (`run.loggers = ["mlflow"]`).

Where it goes is MLflow's own setting: `MLFLOW_TRACKING_URI` (a tracking server, a database, or
a local directory) or `mlflow.set_tracking_uri` in the driver's process. With neither, a file
store in the run directory, RUN_DIR/mlruns: MLflow 3's own default (sqlite:///mlflow.db in the
working directory) needs the database layer of the full `mlflow` package, which mlflow-skinny
(the `mlflow` extra) lacks, so it would fail at the first row. The experiment is
`MLFLOW_EXPERIMENT_NAME`, else the run's `run.name`.
The MLflow run is named after the run directory and tagged with it. Written on the driver from
the rows and events the run writes (a Callback), through MlflowClient with an explicit run id,
so several runs in one process (Tune trials) never share MLflow's global active run.

- parameters: the resolved config, one per `section.key` (`task.args.width`, ...);
- metrics: the names of stalwart/integrations/run_log.py, at the training step;
- tags: `stalwart.run_dir`, `stalwart.task`, `stalwart.state` at the end, and one
  `stalwart.event.NNN.<kind>` per failure, recovery, resize or injected fault, its text the
  line TensorBoard shows.
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
from stalwart.integrations.run_log import (
    EventScalars,
    describe,
    event_step,
    flat_config,
    row_scalars,
)

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig

# MLflow's limits: a parameter's value, a tag's value, and entries in one log_batch call.
PARAM_CHARS = 6000
TAG_CHARS = 5000
BATCH = 100
STATUS = {"FINISHED": "FINISHED", "FAILED": "FAILED", "STOPPED": "KILLED"}
# The file store a run logs to when MLflow is given no tracking URI, in its run directory.
DEFAULT_STORE = "mlruns"
# Tracking URI schemes of MLflow's database store, which needs SQLAlchemy (full `mlflow`).
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def check_available() -> None:
    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError("run.loggers = [\"mlflow\"] needs the mlflow package: "
                          "pip install 'stalwart[mlflow]'")


def check_settings() -> None:
    """Refuse, before the run starts, a database tracking URI that this MLflow cannot open
    (mlflow-skinny has no database store): it would fail at the first row."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    scheme = uri.partition(":")[0].partition("+")[0].lower()
    if scheme in DATABASE_SCHEMES and importlib.util.find_spec("sqlalchemy") is None:
        raise ConfigError(f"MLFLOW_TRACKING_URI {uri!r} is a database, which needs the full "
                          f"mlflow package (pip install mlflow); or point it at a tracking "
                          f"server (http://...), or unset it to log to a file store in the "
                          f"run directory (RUN_DIR/{DEFAULT_STORE})")


def tracking_uri(run_dir: Path) -> str | None:
    """The URI to log to: None where MLflow's own setting names one (MlflowClient reads it),
    else the run directory's file store."""
    if _tracking_uri_is_set():
        return None
    # MLflow 3 refuses a file store unless this is set (the store is in maintenance mode, and
    # still works); MLflow 2 ignores it. Set in the driver's process only.
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    return (run_dir / DEFAULT_STORE).resolve().as_uri()


def _tracking_uri_is_set() -> bool:
    try:  # also sees mlflow.set_tracking_uri() in this process
        from mlflow.tracking._tracking_service.utils import is_tracking_uri_set
    except ImportError:  # a release that moved it: the variable is MLflow's documented way
        return bool(os.environ.get("MLFLOW_TRACKING_URI"))
    return bool(is_tracking_uri_set())


class MLflowLogger(Tracker):
    name = "mlflow"

    def __init__(self, config: JobConfig, run_dir: Path) -> None:
        check_available()
        check_settings()
        self.config = config
        self.run_dir = Path(run_dir)
        self._client: Any = None
        self.run_id: str | None = None
        self._events = EventScalars()
        self._count = 0
        self._lock = threading.Lock()

    def _open(self) -> Any:
        """The client and this run's MLflow run, made at the first row or event (so a run
        refused before it starts leaves nothing in the tracker)."""
        if self._client is None:
            from mlflow import MlflowClient
            from mlflow.entities import Param

            client = MlflowClient(tracking_uri=tracking_uri(self.run_dir))
            name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or self.config.run.name
            experiment = client.get_experiment_by_name(name)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else client.create_experiment(name))
            run = client.create_run(experiment_id, run_name=self.run_dir.name, tags={
                "stalwart.run_dir": str(self.run_dir.resolve()),
                "stalwart.task": self.config.task.path})
            self.run_id = run.info.run_id
            params = [Param(k, str(v)[:PARAM_CHARS]) for k, v in flat_config(self.config).items()]
            for i in range(0, len(params), BATCH):
                client.log_batch(self.run_id, params=params[i:i + BATCH])
            self._client = client
            # A run that ends by an exception never calls on_end: not left RUNNING.
            atexit.register(self._end, "FAILED")
        return self._client

    def _log(self, values: dict[str, float], step: int, when: float) -> None:
        from mlflow.entities import Metric

        stamp = int(when * 1000)
        metrics = [Metric(k, float(v), stamp, step) for k, v in values.items()]
        if metrics:
            self._open().log_batch(self.run_id, metrics=metrics)

    def on_metrics(self, row: MetricsRow) -> None:
        with self._lock:
            self._log(row_scalars(row), row.step, row.time)

    def on_event(self, event: Event) -> None:
        text = describe(event)
        if text is None:
            return
        with self._lock:
            client = self._open()
            self._log(self._events.of(event), event_step(event), event.time)
            self._count += 1
            client.set_tag(self.run_id, f"stalwart.event.{self._count:03d}.{event.kind}",
                           text[:TAG_CHARS])

    def on_end(self, result: Any) -> None:
        self._end(getattr(result, "state", "FAILED"))

    def _end(self, state: str) -> None:
        with self._lock:
            if self._client is None:
                return
            atexit.unregister(self._end)
            self._client.set_tag(self.run_id, "stalwart.state", state)
            self._client.set_terminated(self.run_id, status=STATUS.get(state, "FAILED"))
            self._client = None

    def abandon(self) -> None:
        with self._lock:  # its MLflow run stays as it is (RUNNING): nothing more is sent
            atexit.unregister(self._end)
            self._client = None
