"""bench/gpu_check.py on CPU at its smallest, so that the script a GPU machine runs cannot rot
unnoticed: every check is in its JSON, each with figures or skipped with a reason, and none
errored. torch.compile (20 s of inductor here; the dist tier compiles a 2-rank run) and the two
checks that start Ray are left out. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.gpu_check import CHECKS

pytestmark = [pytest.mark.unit, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
LEFT_OUT = ["compile", "recovery", "multi_gpu"]
ROWS = [name for check in CHECKS for name in check.rows]


def _gpu_check(*args: str) -> subprocess.CompletedProcess[str]:
    # One torch thread: idle threads spinning beside other tests' would only cost CPU.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "bench.gpu_check", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=200)


def test_on_cpu_every_check_has_figures_or_a_reason_and_none_errored(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    done = _gpu_check("--cpu", "--small", "--rounds", "1", "--skip", *LEFT_OUT,
                      "--json", str(out), "--cache-dir", str(tmp_path / "cache"))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["name"]: r for r in report["checks"]}
    assert [r["name"] for r in report["checks"]] == ROWS
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("traceback"))
        if "skipped" in r:
            assert r["skipped"], name
        else:
            assert r["figures"] and r["met"] in (True, False), name
    assert {n for n, r in rows.items() if r.get("skipped") == "--skip"} == set(LEFT_OUT)
    # Without CUDA: no offload, no memory statistics, each said so.
    assert "CUDA" in rows["offload"]["skipped"] and "CPU" in rows["memory"]["skipped"]
    assert "compute capability 8.9" in rows["float8"]["skipped"]
    throughput = rows["throughput"]["figures"]["by_variant"]
    assert all(v["tokens_per_s"] > 0 and v["loss_finite"] for v in throughput.values())
    # The engine and the plain FSDP2 loop start from the same weights on the same samples.
    assert throughput["stalwart"]["first_loss"] == pytest.approx(
        throughput["plain-fsdp2"]["first_loss"], rel=1e-6)
    assert rows["snapshot_staging"]["figures"]["bytes"] > 0
    assert rows["activation_checkpointing"]["met"] is True
    assert rows["numerics"]["figures"]["loss_finite"]  # every variant trained
    for name in ("throughput", "snapshot_overhead", "activation_checkpointing"):
        assert name in done.stdout  # the table


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_exits_0(tmp_path: Path) -> None:
    done = _gpu_check("--json", str(tmp_path / "never.json"))
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 1 and "no CUDA device" in done.stdout
    assert not (tmp_path / "never.json").exists()
