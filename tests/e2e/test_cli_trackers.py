"""`run.loggers` as a user sets it: a digits run with a killed worker, logged to MLflow (a real
local store, named by MLFLOW_TRACKING_URI as MLflow users do) and read back with MLflow's own
client: the config as parameters, the metrics by step, the failure and recovery as tags."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.core.events import read_jsonl
from tests.cli_helpers import sets, stalwart

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

pytest.importorskip("sklearn")
pytest.importorskip("mlflow")

DIGITS_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "digits" / "config.toml"


def test_a_run_with_a_failure_reads_back_from_mlflow(tmp_path: Path, monkeypatch) -> None:
    from mlflow import MlflowClient

    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's local file store
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "digits-e2e")
    run_dir = tmp_path / "run"
    stalwart("run", str(DIGITS_CONFIG), *sets(
        'run.loggers=["mlflow"]', "train.steps=60", "data.val_every=30",
        "checkpoint.persist_every=30", "failure.max_failures=1"),
        "--inject", "kill:rank=1,step=25", "--run-dir", str(run_dir), cwd=tmp_path)

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("digits-e2e").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["task.args.hidden"] == "128"
    assert run.data.params["train.steps"] == "60"
    assert run.data.tags["stalwart.state"] == "FINISHED"
    assert run.data.tags["stalwart.run_dir"] == str(run_dir.resolve())

    # Every metrics row is in MLflow at its step, the task's accuracy included.
    rows = read_jsonl(run_dir / "metrics.jsonl")
    for name in ("loss", "accuracy"):
        history = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
        assert history == [(r["step"], pytest.approx(r[name])) for r in rows]
    val = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id,
                                                                 "val_accuracy")]
    assert [step for step, _ in val] == [30, 60]

    # The failure and the recovery, as events.jsonl has them.
    events = read_jsonl(run_dir / "events.jsonl")
    failure = next(e for e in events if e["kind"] == "failure")
    tags = {k: v for k, v in run.data.tags.items() if k.startswith("stalwart.event.")}
    kinds = [k.split(".")[-1] for k in sorted(tags)]
    assert kinds[:2] == ["fault_injected", "failure"] and "recovered" in kinds, kinds
    assert any(v.startswith(f"worker_died at step {failure['step']}") for v in tags.values())
    failures = client.get_metric_history(run.info.run_id, "events/failures")
    assert [(m.step, m.value) for m in failures] == [(failure["step"], 1.0)]
