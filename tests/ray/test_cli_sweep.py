"""`stalwart sweep` end to end on a local Ray: ASHA stops a worse trial early, Population
Based Training restarts a worse trial from a better one's checkpoint, a finished sweep resumes
with Tune's own restore, and every trial reports each logged step."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

from stalwart.core.events import read_jsonl
from tests.cli_helpers import REFERENCE_CONFIG, TINY, stalwart_here

pytestmark = [pytest.mark.ray, pytest.mark.timeout(400), pytest.mark.usefixtures("local_ray")]

# One worker per trial, a metrics row and a checkpoint every 5 steps.
JOB = [*TINY, "scaling.num_workers=1", "data.val_every=0",
       "run.log_every=5", "checkpoint.persist_every=5"]


def _write_sweep(tmp_path: Path, name: str, body: str, steps: int) -> Path:
    path = tmp_path / f"{name}.toml"
    path.write_text(f'config = "{REFERENCE_CONFIG}"\n'
                    f'set = {json.dumps([*JOB, f"train.steps={steps}"])}\n'
                    f'metric = "loss"\nstorage = "{tmp_path / "sweeps"}"\n{body}')
    return path


def _results(tmp_path: Path, name: str) -> dict:
    return json.loads((tmp_path / "sweeps" / name / "sweep_results.json").read_text())


def _trial_dirs(tmp_path: Path, name: str) -> list[Path]:
    return sorted(p for p in (tmp_path / "sweeps" / name).iterdir()
                  if p.is_dir() and p.name.startswith("stalwart_trial"))


def test_asha_stops_the_worse_trial_and_the_sweep_resumes(tmp_path: Path) -> None:
    # One trial at a time, the good learning rate first: when the bad one reaches the first
    # rung (step 5), ASHA has the good one's loss there to compare with, and stops it.
    sweep = _write_sweep(tmp_path, "asha", '''concurrency = 1
[search]
"train.lr" = { grid = [1e-2, 1e-5] }
[scheduler]
type = "asha"
grace_period = 5
reduction_factor = 2
''', steps=20)
    out = stalwart_here("sweep", str(sweep), cwd=tmp_path).stdout
    results = _results(tmp_path, "asha")
    by_lr = {t["params"]["train.lr"]: t for t in results["trials"]}
    assert by_lr[1e-2]["state"] == "finished" and by_lr[1e-2]["step"] == 20
    assert by_lr[1e-5]["state"] == "stopped early" and by_lr[1e-5]["step"] < 20
    assert results["best"]["params"] == {"train.lr": 1e-2}
    assert "best: " in out and "--set train.lr=0.01" in out and "stopped early" in out

    for trial in _trial_dirs(tmp_path, "asha"):
        # Every logged step reached Tune, with the run's own numbers (the final checkpoint
        # may come with one more report of the last row).
        rows = read_jsonl(trial / "run-0" / "metrics.jsonl")
        reported = read_jsonl(trial / "result.json")
        steps = [r["step"] for r in reported]
        assert steps[:len(rows)] == [r["step"] for r in rows]
        assert [r["loss"] for r in reported][:len(rows)] == [r["loss"] for r in rows]
        if rows[-1]["step"] == 20:  # the finished trial registered its checkpoints
            registered = [r["checkpoint_step"] for r in reported if r.get("checkpoint_step")]
            assert registered[-1] == 20 and set(registered) <= {5, 10, 15, 20}
            assert len(list(trial.glob("checkpoint_*/manifest.json"))) == len(registered)

    again = stalwart_here("sweep", str(sweep), cwd=tmp_path, check=2)
    assert "already holds a sweep; pass --resume" in again.stderr
    resumed = stalwart_here("sweep", str(sweep), "--resume", cwd=tmp_path).stdout
    assert "--set train.lr=0.01" in resumed


def test_pbt_exploit_restarts_a_trial_from_another_trials_checkpoint(tmp_path: Path) -> None:
    # Synchronous PBT waits for both trials at its perturbation (step 10; one is enough), so
    # the worse one exploits the better however far apart their starts are. Asynchronous PBT
    # exploits only when the two reach an interval close together: on a loaded machine one
    # trial could finish before the other's first report.
    sweep = _write_sweep(tmp_path, "pbt", '''concurrency = 2
[search]
"train.lr" = { grid = [1e-4, 1e-2] }
[scheduler]
type = "pbt"
perturbation_interval = 10
quantile_fraction = 0.5
resample_probability = 0.0
synch = true
[scheduler.mutations]
"train.lr" = { loguniform = [1e-3, 1e-2] }
''', steps=15)
    stalwart_here("sweep", str(sweep), cwd=tmp_path)
    exploits = [json.loads(line) for line in
                (tmp_path / "sweeps" / "pbt" / "pbt_global.txt").read_text().splitlines()]
    assert exploits, "PBT never exploited"
    target_tag, clone_tag, *_, new_config = exploits[0]
    trials = {p.name.split("_", 4)[-1]: p for p in _trial_dirs(tmp_path, "pbt")}
    target = next(p for tag, p in trials.items() if tag.startswith(target_tag))
    clone = next(p for tag, p in trials.items() if tag.startswith(clone_tag))
    assert target != clone

    restarts = [read_jsonl(run / "events.jsonl") for run in sorted(target.glob("run-*"))[1:]]
    started = [e for events in restarts for e in events if e["kind"] == "started_from"]
    assert started and started[0]["origin"].startswith(str(clone))  # the other trial's
    first = next(run for run in sorted(target.glob("run-*"))[1:])
    config = tomllib.loads((first / "config.toml").read_text())
    assert config["train"]["lr"] == pytest.approx(new_config["train.lr"])
    # Runs that Tune paused end `interrupted`; the trial's last run finishes.
    assert restarts[-1][-1]["kind"] == "finished" and restarts[-1][-1]["step"] == 15
    assert all(events[-1]["kind"] == "interrupted" for events in restarts[:-1])
    assert {t["state"] for t in _results(tmp_path, "pbt")["trials"]} == {"finished"}
