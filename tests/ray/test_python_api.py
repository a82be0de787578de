"""The Python API from a plain script: a task defined in `__main__` reaches the workers by value
(nothing on their path could import it), a killed worker's replacement gets it too, and
RunResult carries the run's newest checkpoint and last metrics."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stalwart.core.events import read_jsonl

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]

# A task instance (not a class) built in __main__, with a kill of rank 1 at step 12. The
# script prints RunResult's fields as JSON on its last line.
INLINE = textwrap.dedent('''
    import json

    import torch
    from torch import nn

    import stalwart


    class Line:
        def __init__(self, n):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(n, 4, generator=g)
            self.y = self.x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

        def __len__(self):
            return len(self.x)

        def get_batch(self, indices):
            idx = torch.as_tensor(indices)
            return self.x[idx], self.y[idx]


    class LineTask(stalwart.TrainTask):
        def build_model(self, config):
            return nn.Linear(4, 1)

        def train_dataset(self, config):
            return Line(512)

        def loss(self, model, inputs, targets):
            error = model(inputs) - targets
            return error.pow(2).mean(), {"max_error": error.abs().max()}


    if __name__ == "__main__":
        result = stalwart.Trainer(task=LineTask(), run_dir="run", config={
            "train": {"steps": 30, "global_batch_size": 16, "micro_batch_size": 8,
                      "lr": 0.02, "warmup_steps": 2},
            "checkpoint": {"persist_every": 10},
            "data": {"val_every": 0},
            "run": {"log_every": 5, "progress": False},
            "failure": {"max_failures": 2},
            "faults": [{"kind": "kill", "rank": 1, "step": 12}],
        }).fit()
        print(json.dumps({"state": result.state, "step": result.step,
                          "checkpoint": [result.checkpoint.step, result.checkpoint.path],
                          "metrics": result.metrics, "run_dir": str(result.run_dir)}))
''')


def _python(script: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, str(script)], cwd=cwd, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    return proc


def test_the_quickstart_example_runs_as_a_user_runs_it(tmp_path: Path) -> None:
    proc = _python(ROOT / "examples" / "quickstart.py", cwd=tmp_path)
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert f"newest checkpoint: step 300 at {run_dir}/checkpoints/step_000000300" in proc.stdout
    assert "FINISHED at step 300: val_loss" in proc.stdout
    assert 'path = "__main__:WavesTask"' in (run_dir / "config.toml").read_text()
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert all("mae" in r for r in rows)
    val = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in val] == [50, 100, 150, 200, 250, 300]
    assert all("val_mae" in r for r in val) and val[-1]["val_mae"] < val[0]["val_mae"]


def test_an_inline_task_instance_survives_a_killed_worker(tmp_path: Path) -> None:
    script = tmp_path / "train_line.py"
    script.write_text(INLINE)
    proc = _python(script, cwd=tmp_path)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    run_dir = tmp_path / "run"
    assert result["state"] == "FINISHED" and result["step"] == 30
    assert result["checkpoint"] == [30, str(run_dir / "checkpoints" / "step_000000030")]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert result["metrics"] == rows[-1] and "max_error" in rows[-1]

    events = read_jsonl(run_dir / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert "failure" in kinds and "recovered" in kinds, kinds
    # The replacement worker built the task from the pickled instance too: the world after
    # the kill trained on to the end.
    recovered = next(e for e in events if e["kind"] == "recovered")
    assert recovered["world_size"] == 2 and kinds[-1] == "finished"
