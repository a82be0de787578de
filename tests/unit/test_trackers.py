"""run.loggers: MLflow against a real local file store, read back with MLflow's own client, and
Weights & Biases in offline mode, read back from the run file it writes. The loggers see the
same typed rows and events a run writes (stalwart/callbacks.py), each behind its guard
(stalwart/integrations/loggers.py)."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from stalwart.core.config import load_config
from stalwart.core.errors import ConfigError
from stalwart.core.events import MetricsRow, parse_event
from stalwart.integrations.loggers import logger_callbacks
from stalwart.integrations.run_log import flat_config
from stalwart.integrations.tensorboard import TensorBoardLogger
from stalwart.run_dir import RunDir

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

T0 = 1_700_000_000.0
CONFIG = load_config(None, ["run.name=trackers", "task.args.d_model=64"])


def _row(step: int, loss: float, **extra: Any) -> MetricsRow:
    return MetricsRow(step=step, loss=loss, lr=1e-3, tokens_per_s=100.0, world_size=2,
                      samples_seen=8 * step, time=T0 + step, **extra)


EVENTS = [
    {"time": T0, "kind": "started", "world_size": 2, "steps": 30, "start_step": 0,
     "task": "t:T"},
    {"time": T0 + 12, "kind": "failure", "failure_kind": "worker_died", "rank": 1,
     "ranks": [1], "nodes": ["10.0.0.2"], "step": 12, "retry": True, "attempt": 1,
     "detection_s": 0.2, "message": "worker rank 1 died: SIGKILL"},
    {"time": T0 + 14, "kind": "recovered", "from_step": 12, "source": "memory",
     "peer_fetches": 0, "world_size": 2, "lost_steps": 0, "recovery_s": 0.8, "phases": {},
     "generation": 1},
    {"time": T0 + 30, "kind": "finished", "step": 30, "loss": 1.0, "val_loss": None},
]


def _trackers(config: Any, path: Path) -> list[Any]:
    """The trackers of `config` for a run dir at `path`, as the Trainer makes them."""
    return logger_callbacks(config, RunDir(path))


def _feed(logger: Any) -> None:
    logger.on_event(parse_event(EVENTS[0]))
    logger.on_metrics(_row(10, 2.5, task_metrics={"accuracy": 0.5}))
    logger.on_event(parse_event(EVENTS[1]))
    logger.on_event(parse_event(EVENTS[2]))
    logger.on_metrics(_row(20, 2.0, val_loss=2.2, task_metrics={"accuracy": 0.6,
                                                                "val_accuracy": 0.55}))
    logger.on_metrics(_row(30, 1.0, task_metrics={"accuracy": 0.7}))
    logger.on_event(parse_event(EVENTS[3]))
    logger.on_end(SimpleNamespace(state="FINISHED", step=30))
    assert not logger.failed


def test_mlflow_run_reads_back_through_mlflows_client(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's local file store
    (logger,) = _trackers(load_config(None, ["run.name=trackers", 'run.loggers=["mlflow"]']),
                          tmp_path / "run")
    _feed(logger)

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("trackers")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == logger.tracker.run_id and run.info.run_name == "run"
    assert run.info.status == "FINISHED"
    params = run.data.params
    assert params["train.lr"] == "0.003" and params["run.loggers"] == "['mlflow']"
    assert params["task.path"] == CONFIG.task.path

    def history(name: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]

    assert history("loss") == [(10, 2.5), (20, 2.0), (30, 1.0)]
    assert history("accuracy") == [(10, 0.5), (20, 0.6), (30, 0.7)]
    assert history("val_accuracy") == [(20, 0.55)]
    assert history("events/failures") == [(12, 1)]
    assert history("events/recovery_s") == [(12, 0.8)]
    tags = run.data.tags
    assert tags["stalwart.state"] == "FINISHED"
    assert tags["stalwart.run_dir"] == str((tmp_path / "run").resolve())
    assert tags["stalwart.event.001.failure"] == (
        "worker_died at step 12 (ranks [1], attempt 1, recovering): worker rank 1 died: SIGKILL")
    assert tags["stalwart.event.002.recovered"].startswith("recovered from step 12 (memory)")
    assert tags["stalwart.event.003.finished"] == "finished at step 30"


def test_mlflow_without_a_tracking_uri_logs_to_the_run_directory(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """MLflow 3's own default (sqlite:///mlflow.db) fails under mlflow-skinny at the first
    row: with no URI set, the run's own file store is used, with either package."""
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "unset below")  # restored after the test
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    monkeypatch.chdir(tmp_path)
    (logger,) = _trackers(load_config(None, ["run.name=trackers", 'run.loggers=["mlflow"]']),
                          tmp_path / "run")
    _feed(logger)

    client = MlflowClient(tracking_uri=(tmp_path / "run" / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("trackers").experiment_id])
    assert run.info.run_id == logger.tracker.run_id and run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == \
        [2.5, 2.0, 1.0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"], "nothing in the working dir"


def test_a_database_tracking_uri_without_its_store_is_refused_up_front(tmp_path: Path,
                                                                      monkeypatch) -> None:
    pytest.importorskip("mlflow")
    if importlib.util.find_spec("sqlalchemy") is not None:
        pytest.skip("the full mlflow package (with its database store) is installed")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    with pytest.raises(ConfigError, match=r"is a database, which needs the full mlflow package "
                                          r"\(pip install mlflow\).*unset it to log to a file "
                                          r"store in the run directory \(RUN_DIR/mlruns\)"):
        _trackers(load_config(None, ['run.loggers=["mlflow"]']), tmp_path / "run")


def _wandb_records(path: Path) -> list[Any]:
    """The records of a W&B run file: a 7-byte header (':W&B', magic, version), then LevelDB's
    log format (32 KiB blocks of records: crc32, length, type; a record may span blocks)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, records, pending = 32768, 7, [], b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # the block's tail is padding
            pos += room
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_offline_run_holds_the_config_metrics_and_events(tmp_path: Path,
                                                               monkeypatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "trackers-test")
    (logger,) = _trackers(load_config(None, ['run.loggers=["wandb"]']), tmp_path / "run")
    _feed(logger)

    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    # W&B's own process writes the file; on a loaded machine it may still be writing when
    # the run has finished here.
    deadline = time.monotonic() + 60
    while True:
        records = _wandb_records(run_file)
        kinds = {r.WhichOneof("record_type") for r in records}
        if {"run", "summary"} <= kinds or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.project == "trackers-test" and run.display_name == "run"
    config = {i.key: json.loads(i.value_json) for i in run.config.update}
    assert config["train"]["lr"] == 0.003 and config["run"]["loggers"] == ["wandb"]
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in records if r.WhichOneof("record_type") == "history"]
    loss = [(row["step"], row["loss"]) for row in rows if "loss" in row]
    assert loss == [(10, 2.5), (20, 2.0), (30, 1.0)]
    assert [(row["step"], row["val_accuracy"]) for row in rows if "val_accuracy" in row] == \
        [(20, 0.55)]
    assert [(row["step"], row["events/failures"]) for row in rows
            if "events/failures" in row] == [(12, 1)]
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                            for i in r.summary.update})
    assert summary["stalwart/state"] == "FINISHED"
    assert summary["stalwart/events"][0].startswith("worker_died at step 12")


def test_loggers_by_name_and_the_tensorboard_alias(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from stalwart.integrations.mlflow_logger import MLflowLogger
    from stalwart.integrations.wandb_logger import WandbLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    config = load_config(None, ['run.loggers=["wandb", "mlflow"]', "run.tensorboard=true"])
    kinds = [type(cb.tracker) for cb in _trackers(config, tmp_path)]
    assert kinds == [WandbLogger, MLflowLogger, TensorBoardLogger]
    assert _trackers(load_config(None), tmp_path) == []
    assert not list(tmp_path.iterdir()), "nothing is written before the first row or event"


@pytest.mark.parametrize(("name", "module"), [("mlflow", "mlflow"), ("wandb", "wandb")])
def test_a_missing_tracker_package_is_one_clear_error(tmp_path: Path, monkeypatch,
                                                      name: str, module: str) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # as if it were not installed
    config = load_config(None, [f'run.loggers=["{name}"]'])
    with pytest.raises(ConfigError, match=rf"needs the {module} package: pip install "
                                          rf"'stalwart\[{name}\]'"):
        _trackers(config, tmp_path)


def test_run_loggers_are_checked_by_name() -> None:
    for value, fragment in [('["comet"]', "'comet' is not one of tensorboard, mlflow, wandb"),
                            ('["wandb", "wandb"]', "names a logger twice"),
                            ('"wandb"', "expected a list")]:
        with pytest.raises(ConfigError, match=fragment):
            load_config(None, [f"run.loggers={value}"])


def test_the_config_as_parameters() -> None:
    flat = flat_config(CONFIG)
    assert flat["task.args.d_model"] == 64 and flat["train.lr"] == 0.003
    assert flat["run.loggers"] == [] and flat["faults"] == ()
