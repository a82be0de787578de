"""`run.loggers` as a user sets it: a digits run with a killed worker, logged to MLflow with no
tracking URI set (so to the run directory's own store, which works with mlflow-skinny) and read
back with MLflow's own client: the config as parameters, the metrics by step, the failure and
recovery as tags. And W&B with neither a key nor offline mode, refused before anything starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.core.events import read_jsonl
from tests.cli_helpers import sets, stalwart

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

pytest.importorskip("sklearn")

DIGITS_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "digits" / "config.toml"


def test_a_run_with_a_failure_reads_back_from_mlflow(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient

    # As a new user has it: no tracking URI, and no MLflow 3 file store switch either.
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "digits-e2e")
    run_dir = tmp_path / "run"
    proc = stalwart("run", str(DIGITS_CONFIG), *sets(
        'run.loggers=["mlflow"]', "train.steps=60", "data.val_every=30",
        "checkpoint.persist_every=30", "failure.max_failures=1"),
        "--inject", "kill:rank=1,step=25", "--run-dir", str(run_dir), cwd=tmp_path)
    assert "warning: tracker" not in proc.stderr, proc.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # this process reads the store
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
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


@pytest.mark.timeout(90)
def test_wandb_with_no_key_and_no_offline_mode_is_refused_before_it_starts(
        tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wandb")
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_DISABLED",
                 "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    # Nothing `wandb login` or `wandb offline` could have saved on this machine.
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    run_dir = tmp_path / "run"
    proc = stalwart("run", str(DIGITS_CONFIG), *sets('run.loggers=["wandb"]'),
                    "--run-dir", str(run_dir), cwd=tmp_path, timeout=60, check=2)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "`wandb login` (or set WANDB_API_KEY)" in proc.stderr, proc.stderr
    assert "WANDB_MODE=offline" in proc.stderr, proc.stderr
    assert not run_dir.exists() and not (tmp_path / "wandb").exists()
