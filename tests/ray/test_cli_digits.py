"""The digits example end to end, run exactly as a user would: `stalwart run` on its config,
with DDP as shipped and with FSDP2 (each block of model.layers sharded over both workers),
its accuracy metric reaching metrics.jsonl and choosing the best checkpoint to keep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.core.events import read_jsonl
from tests.cli_helpers import sets, stalwart_here

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300), pytest.mark.usefixtures("local_ray")]

pytest.importorskip("sklearn")

DIGITS_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "digits" / "config.toml"


# The FSDP2 run also keeps its best checkpoint by the task's own metric: a checkpoint at
# every validation step, the newest one kept, and the best.
KEEP_BEST = ["checkpoint.persist_every=50", "checkpoint.keep_last=1", "checkpoint.keep_best=1",
             "checkpoint.best_metric=val_accuracy", "checkpoint.best_mode=max"]
LAYOUTS = {"ddp": [], "fsdp": ["parallel.dp_shard=2", "parallel.dp_replicate=1", *KEEP_BEST]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, local_ray) -> dict[str, Path]:
    out = {}
    for name, overrides in LAYOUTS.items():
        cwd = tmp_path_factory.mktemp(name)
        stalwart_here("run", str(DIGITS_CONFIG), *sets(*overrides), "--run-dir", "run", cwd=cwd)
        out[name] = cwd / "run"
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_digits_example_trains_to_a_low_val_loss(runs, layout) -> None:
    run_dir = runs[layout]
    events = read_jsonl(run_dir / "events.jsonl")
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == 300, events[-1]
    assert not [e for e in events if e["kind"] == "failure"]

    rows = read_jsonl(run_dir / "metrics.jsonl")
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    assert [step for step, _ in val] == [50, 100, 150, 200, 250, 300]  # data.val_every = 50
    assert val[-1][1] < 0.5, val  # from ln 10 = 2.3 at the start; about 0.05 in practice
    assert val[-1][1] < val[0][1]
    assert rows[-1]["world_size"] == 2
    # The task's own metric: accuracy on every row, val_accuracy on the validation rows,
    # both global means over the two workers.
    assert all(0 <= r["accuracy"] <= 1 for r in rows)
    val_accuracy = [r["val_accuracy"] for r in rows if "val_loss" in r]
    assert len(val_accuracy) == len(val) and val_accuracy[-1] > 0.9, val_accuracy
    assert not [r for r in rows if "val_accuracy" in r and "val_loss" not in r]


def test_keep_best_keeps_the_checkpoint_of_the_best_val_accuracy(runs) -> None:
    """checkpoint.keep_best by the task's own metric: the newest checkpoint, and the one whose
    step had the highest val_accuracy, whatever its age; the manifests record the metrics."""
    run_dir = runs["fsdp"]
    rows = read_jsonl(run_dir / "metrics.jsonl")
    scores = {r["step"]: r["val_accuracy"] for r in rows if "val_accuracy" in r}
    assert sorted(scores) == list(range(50, 301, 50))
    best = max(sorted(scores, reverse=True), key=lambda s: scores[s])  # a tie: the newer
    kept = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert kept == sorted({best, 300}), (kept, scores)
    manifest = json.loads((run_dir / "checkpoints" / f"step_{best:09d}" / "manifest.json")
                          .read_text())
    assert manifest["metrics"]["val_accuracy"] == scores[best]
    assert set(manifest["metrics"]) == {"loss", "val_loss", "accuracy", "val_accuracy"}
