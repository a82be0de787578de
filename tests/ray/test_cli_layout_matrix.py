"""The layout matrix: `stalwart plan` lists for 2 and 4 workers exactly the layouts that
train, and they train to one worker's loss (4 steps from the CLI at 2 workers).

`plan` lists only what a run of the config starts, so a composition that cannot train must
be refused there and by `run` alike, never listed. At 2 workers every listed layout trains
from the CLI: each parallel degree on its own through plan, Ray and the engine. At 4 workers
each listed composition is checked for exactness without Ray, by the test named beside it in
DIST_CHECKED (same engine, same layouts): four ranks cost a tenth there of a CLI run here.
The runs are made in the test's process, on the local Ray that the ray tier shares.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.core.events import read_jsonl
from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart_here

DIST = Path(__file__).resolve().parents[1] / "dist"

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

# The tiny GPT untied (so it can be pipelined), 4 steps, a storage checkpoint at 2 and 4 (every
# layout's state dicts are staged in memory each step and written by DCP twice).
MATRIX = [*TINY, "task.args.tie_embeddings=false", "train.steps=4", "run.log_every=1",
          "train.warmup_steps=2", "data.val_every=0",
          "checkpoint.persist_every=2"]

# What plan lists for the tiny GPT (2 heads, 2 blocks, 64 tokens): tp <= 2, pp <= 2, cp up to
# 4 (not with pp), every data split.
EXPECTED = {
    2: {(2, 1, 1, 1, 1), (1, 2, 1, 1, 1), (1, 1, 2, 1, 1), (1, 1, 1, 2, 1), (1, 1, 1, 1, 2)},
    4: {(4, 1, 1, 1, 1), (2, 2, 1, 1, 1), (1, 4, 1, 1, 1), (2, 1, 1, 2, 1), (1, 2, 1, 2, 1),
        (2, 1, 1, 1, 2), (1, 2, 1, 1, 2), (1, 1, 1, 2, 2), (2, 1, 2, 1, 1), (1, 2, 2, 1, 1),
        (1, 1, 4, 1, 1), (1, 1, 2, 2, 1)},
}
DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")

# The 4-worker layouts, each with the tests/dist/ case that matches its loss to one process's:
# the file and the case id (test_layout_matches_one_process in test_data_parallel.py,
# test_pipeline_matches_one_process in test_pipeline.py,
# test_context_parallel_trains_like_one_process in test_context_parallel.py).
DIST_CHECKED = {
    (4, 1, 1, 1, 1): ("test_data_parallel.py", "ddp4"),
    (2, 1, 1, 2, 1): ("test_data_parallel.py", "replicate2xtp2"),
    (2, 2, 1, 1, 1): ("test_data_parallel.py", "hsdp2x2"),
    (1, 4, 1, 1, 1): ("test_data_parallel.py", "fsdp4"),
    (1, 2, 1, 2, 1): ("test_data_parallel.py", "fsdp2xtp2"),
    (2, 1, 1, 1, 2): ("test_pipeline.py", "replicate2xpp2"),
    (1, 2, 1, 1, 2): ("test_pipeline.py", "fsdp2xpp2"),
    (1, 1, 1, 2, 2): ("test_pipeline.py", "tp2xpp2"),
    (2, 1, 2, 1, 1): ("test_context_parallel.py", "replicate2xcp2"),
    (1, 2, 2, 1, 1): ("test_context_parallel.py", "cp2xfsdp2"),
    (1, 1, 4, 1, 1): ("test_context_parallel.py", "cp4"),
    (1, 1, 2, 2, 1): ("test_context_parallel.py", "tp2xcp2"),
}


@pytest.fixture(scope="module")
def one_worker(local_ray, tmp_path_factory) -> list[float]:
    cwd = tmp_path_factory.mktemp("one")
    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*MATRIX, "scaling.num_workers=1"),
                  "--run-dir", "run", cwd=cwd)
    return [r["loss"] for r in read_jsonl(cwd / "run" / "metrics.jsonl")]


def listed_layouts(workers: int, cwd: Path) -> set[tuple[int, ...]]:
    proc = stalwart_here("plan", str(REFERENCE_CONFIG), *sets(*MATRIX), "--devices",
                         str(workers), cwd=cwd)
    rows = [line.split() for line in proc.stdout.splitlines()]
    return {tuple(int(c) for c in r[:5]) for r in rows
            if len(r) > 5 and all(c.isdigit() for c in r[:6])}


def train(layout: tuple[int, ...], workers: int, cwd: Path
          ) -> tuple[tuple[int, ...], list[float], str]:
    name = "x".join(map(str, layout))
    overrides = [f"scaling.num_workers={workers}",
                 *(f"parallel.{k}={v}" for k, v in zip(DEGREES, layout, strict=True))]
    proc = stalwart_here("run", str(REFERENCE_CONFIG), *sets(*MATRIX, *overrides),
                         "--run-dir", name, cwd=cwd, check=None)
    metrics = cwd / name / "metrics.jsonl"
    losses = [r["loss"] for r in read_jsonl(metrics)] if metrics.exists() else []
    return layout, losses, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


def test_every_layout_plan_lists_at_2_workers_trains_like_one_worker(one_worker, tmp_path):
    layouts = listed_layouts(2, tmp_path)
    assert layouts == EXPECTED[2]
    results = [train(layout, 2, tmp_path) for layout in sorted(layouts)]
    assert len(one_worker) == 4
    for layout, losses, output in results:
        described = " x ".join(f"{k}={v}" for k, v in zip(DEGREES, layout, strict=True))
        assert losses == pytest.approx(one_worker, rel=1e-5), f"{described}: {output}"


def test_every_layout_plan_lists_at_4_workers_is_matched_to_one_process_in_dist(tmp_path):
    """No Ray and no run here: plan's listing, and a dist case for each layout in it."""
    layouts = listed_layouts(4, tmp_path)
    assert layouts == EXPECTED[4] == set(DIST_CHECKED)
    for file, case in DIST_CHECKED.values():  # a twin that goes fails here
        assert f'id="{case}"' in (DIST / file).read_text(), f"{file}: no case {case}"
