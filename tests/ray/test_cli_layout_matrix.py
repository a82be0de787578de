"""The layout matrix: every layout `stalwart plan` lists for 2 and 4 workers trains 4 steps
from the CLI and matches one worker's loss.

The one place that runs them all from the CLI (tests/dist/ checks each composition's
exactness over 20 steps without Ray). `plan` lists only what a run of the config starts, so
a composition that cannot train must be refused there and by `run` alike, never listed.
One local Ray serves every run of the module (`--address`); two runs go at a time.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from stalwart.core.events import read_jsonl
from tests.cli_helpers import REFERENCE_CONFIG, STALWART, TINY, run_from_thread, sets, stalwart
from tests.ray.helpers import local_cluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

# The tiny GPT untied (so it can be pipelined), 4 steps, a storage checkpoint at 2 and 4 (every
# layout's state dicts are staged in memory each step and written by DCP twice).
MATRIX = [*TINY, "task.args.tie_embeddings=false", "train.steps=4", "run.log_every=1",
          "train.warmup_steps=2", "data.val_every=0", "scaling.spare_workers=0",
          "scaling.cpus_per_worker=0.5",
          "checkpoint.persist_every=2"]

# What plan lists for the tiny GPT (2 heads, 2 blocks): tp <= 2, pp <= 2, every data split.
EXPECTED = {
    2: {(2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (1, 1, 1, 2)},
    4: {(4, 1, 1, 1), (2, 2, 1, 1), (1, 4, 1, 1), (2, 1, 2, 1), (1, 2, 2, 1),
        (2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2)},
}
DEGREES = ("dp_replicate", "dp_shard", "tp", "pp")


@pytest.fixture(scope="module")
def address():
    cluster = local_cluster(1, cpus=4)  # two runs of four 0.5-CPU workers at a time
    try:
        yield cluster.address
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def one_worker(address, tmp_path_factory) -> list[float]:
    cwd = tmp_path_factory.mktemp("one")
    stalwart("run", str(REFERENCE_CONFIG), *sets(*MATRIX, "scaling.num_workers=1"),
             "--address", address, "--run-dir", "run", cwd=cwd)
    return [r["loss"] for r in read_jsonl(cwd / "run" / "metrics.jsonl")]


def listed_layouts(workers: int, cwd: Path) -> set[tuple[int, ...]]:
    proc = stalwart("plan", str(REFERENCE_CONFIG), *sets(*MATRIX), "--devices", str(workers),
                    cwd=cwd)
    rows = [line.split() for line in proc.stdout.splitlines()]
    return {tuple(int(c) for c in r[:4]) for r in rows
            if len(r) > 4 and all(c.isdigit() for c in r[:5])}


def train(layout: tuple[int, ...], workers: int, address: str, cwd: Path
          ) -> tuple[tuple[int, ...], list[float], str]:
    name = "x".join(map(str, layout))
    overrides = [f"scaling.num_workers={workers}",
                 *(f"parallel.{k}={v}" for k, v in zip(DEGREES, layout, strict=True))]
    proc = run_from_thread([STALWART, "run", str(REFERENCE_CONFIG), *sets(*MATRIX, *overrides),
                            "--address", address, "--run-dir", name], timeout=240, cwd=cwd)
    metrics = cwd / name / "metrics.jsonl"
    losses = [r["loss"] for r in read_jsonl(metrics)] if metrics.exists() else []
    return layout, losses, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("workers", [2, 4])
def test_every_layout_plan_lists_trains_like_one_worker(workers, address, one_worker,
                                                        tmp_path):
    layouts = listed_layouts(workers, tmp_path)
    assert layouts == EXPECTED[workers]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda lo: train(lo, workers, address, tmp_path),
                                sorted(layouts)))
    assert len(one_worker) == 4
    for layout, losses, output in results:
        described = " x ".join(f"{k}={v}" for k, v in zip(DEGREES, layout, strict=True))
        assert losses == pytest.approx(one_worker, rel=1e-5), f"{described}: {output}"
