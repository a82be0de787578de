"""bench/data.py without Ray: its arguments (the quick mode's defaults, the checks), its
dataset (written once, reused while the parameters hold, never over files it did not write),
and a tiny run whose JSON has every figure and goal. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import data

pytestmark = [pytest.mark.unit, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]


def test_quick_fills_the_defaults_it_was_not_given() -> None:
    args = data.parse_args(["--quick", "--files", "2"])
    assert (args.size_mb, args.files, args.rounds) == (data.QUICK["size_mb"], 2, 1)
    assert args.micro_batch == args.global_batch
    assert f"{data.QUICK['size_mb']}mb" in args.dir  # the quick and full datasets apart
    full = data.parse_args([])
    assert (full.size_mb, full.files) == (data.FULL["size_mb"], data.FULL["files"])


@pytest.mark.parametrize("argv, says", [
    (["--global-batch", "256", "--micro-batch", "96"], "multiple of --micro-batch"),
    (["--size-mb", "0.1", "--files", "4"], "raise --size-mb"),
    (["--global-batch", "0"], "not above 0"),
    (["--loader-workers", "3"], "invalid choice"),
])
def test_bad_arguments_are_refused_with_the_reason(argv: list[str], says: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        data.parse_args(argv)
    assert says in capsys.readouterr().err


def test_the_dataset_is_reused_while_its_parameters_hold(tmp_path: Path) -> None:
    args = data.parse_args(["--size-mb", "1", "--files", "2", "--row-group-mb", "0.25",
                            "--features", "8", "--global-batch", "16"])
    params = data.dataset_params(args)
    meta, written = data.make_dataset(tmp_path, params)
    assert written and len(meta["sizes"]) == 2
    stamps = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.parquet")}
    again, written = data.make_dataset(tmp_path, params)
    assert not written and again == meta
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.parquet")} == stamps

    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path)
    assert table.column_names == ["id", "features", "label"]
    assert table.num_rows == params["rows"]
    assert pq.ParquetFile(next(tmp_path.glob("*.parquet"))).metadata.row_group(0).num_rows \
        == params["row_group_rows"]
    _, written = data.make_dataset(tmp_path, params | {"files": 3})
    assert written and len(list(tmp_path.glob("*.parquet"))) == 3


def test_a_directory_of_other_parquet_files_is_left_alone(tmp_path: Path) -> None:
    (tmp_path / "theirs.parquet").write_bytes(b"PAR1")
    args = data.parse_args(["--size-mb", "1", "--files", "1", "--features", "8"])
    with pytest.raises(SystemExit, match="did not write"):
        data.make_dataset(tmp_path, data.dataset_params(args))
    assert (tmp_path / "theirs.parquet").read_bytes() == b"PAR1"


def test_a_tiny_run_reports_every_figure_and_goal(tmp_path: Path) -> None:
    out = tmp_path / "data.json"
    # One torch thread: idle threads spinning beside other tests' would only cost CPU.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.data", "--quick", "--no-ray", "--size-mb", "8",
         "--dir", str(tmp_path / "set"), "--json", str(out), "--slow-steps", "10",
         "--step-ms", "5", "--resume-reps", "1", "--loader-workers", "1"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    rates = report["samples_per_s"]
    assert all(rates[k] > 0 for k in ("stream", "raw", "loader")) and rates["ray"] is None
    assert report["ray"] == {"skipped": "--no-ray"}
    assert set(report["goals"]) == {"stream_over_raw", "slow_step_wait_share",
                                    "resume_deep_over_near", "dataset_over_peak_rss"}
    assert all(g["met"] in (True, False) for g in report["goals"].values())
    rows = report["dataset"]["rows"]
    # Each reader read the whole dataset (the stream: its whole steps of it).
    assert report["raw"][0]["samples"] == report["loader"]["samples"] == rows
    assert report["stream"][0]["samples"] == rows // 256 * 256
    assert report["stream_slow"]["steps"] == report["stream_slow_deep"]["steps"] == 10
    assert report["stream_slow_deep"]["prefetch"] > report["stream_slow"]["prefetch"]
    assert report["resume"]["positions"]["deep"] > report["resume"]["positions"]["near"]
    assert report["memory"]["peak_rss"] > 0 and report["index"]["units"] > 0
    for line in ("stalwart stream", "pyarrow.dataset scan", "DataLoader", "goals:"):
        assert line in done.stdout  # the table
