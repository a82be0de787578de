"""Layouts from the CLI through the Ray workers, and a run resumed in another layout."""

from __future__ import annotations

import pytest

from stalwart.core.events import read_jsonl
from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart_here

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("local_ray")]

# An untied GPT with four blocks: two pipeline stages on each of two ranks. Resharding into
# the 4-rank compositions (fsdp4 to tp2 x pp2 and others) is checked without Ray, rank by
# rank, in tests/dist/test_checkpoint_reshard.py; here the CLI resumes into another layout.
UNTIED = [*TINY, "task.args.n_layers=4", "task.args.tie_embeddings=false", "data.val_every=5",
          "run.log_every=1"]


def test_resume_a_fsdp_run_as_pipeline_parallel(tmp_path):
    config = str(REFERENCE_CONFIG)
    fsdp = ["parallel.dp_replicate=1", "parallel.dp_shard=2"]
    stalwart_here("run", config, *sets(*UNTIED, *fsdp, "train.steps=6"), "--run-dir", "run",
                  cwd=tmp_path)

    pp = ["parallel.dp_replicate=1", "parallel.dp_shard=1", "parallel.pp=2",
          "parallel.pp_schedule=interleaved_1f1b"]
    stalwart_here("run", config, *sets(*UNTIED, *pp, "train.steps=12"), "--run-dir", "run",
                  "--resume", cwd=tmp_path)

    events = read_jsonl(tmp_path / "run" / "events.jsonl")
    (resumed,) = [e for e in events if e["kind"] == "resumed"]
    assert resumed["from_step"] == 6
    assert resumed["config_changes"]["parallel.pp"] == [1, 2]
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == 12
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 13))
    # The pipeline continued the same training: the loss keeps falling from where FSDP left it.
    assert rows[-1]["loss"] < rows[5]["loss"] and "val_loss" in rows[-1]
