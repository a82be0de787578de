"""`stalwart plan` plans for the devices a run here would have, and for speed among the layouts
that fit: unsharded (DDP) when its replicas leave headroom, sharded only for memory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from stalwart.cli.main import main
from stalwart.core.config import load_config
from stalwart.plan.devices import planned_devices
from stalwart.plan.estimate import ModelShape, PlanError, PlanLayout, estimate
from stalwart.plan.search import HEADROOM, plan, recommend, why_recommended
from tests.cli_helpers import REFERENCE_CONFIG

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

GIB = 2**30
# Every part known (d_model, heads, seq_len, blocks): the estimate is complete.
SHAPE = ModelShape(n_params=10**6, n_layers=4, d_model=128, n_heads=4, seq_len=128,
                   vocab_size=256, block_params=200_000)


def _degrees(layout: PlanLayout) -> tuple[int, int, int, int]:
    return layout.dp_replicate, layout.dp_shard, layout.tp, layout.pp


def test_a_model_whose_replicas_fit_with_headroom_trains_unsharded() -> None:
    best = recommend(plan(SHAPE, 2, GIB), GIB)
    assert _degrees(best.layout) == (2, 1, 1, 1) and best.roomy
    assert "unsharded" in why_recommended(best)


def test_sharding_is_chosen_for_memory_only() -> None:
    ddp = estimate(SHAPE, PlanLayout(dp_replicate=2)).device
    zero3 = estimate(SHAPE, PlanLayout(dp_shard=2)).device
    assert zero3 < ddp
    # DDP fits, but leaves less than the headroom: the widest sharding wins.
    tight = int(ddp / (1 - HEADROOM / 2))
    best = recommend(plan(SHAPE, 2, tight), tight)
    assert _degrees(best.layout) == (1, 2, 1, 1) and not best.roomy
    assert "no unsharded layout leaves 10% of the device free" in why_recommended(best)
    # With the headroom, DDP again.
    roomy = int(ddp / (1 - HEADROOM)) + 1
    assert _degrees(recommend(plan(SHAPE, 2, roomy), roomy).layout) == (2, 1, 1, 1)


def test_unknown_activations_leave_the_headroom_unknown_so_the_least_memory_wins() -> None:
    bare = ModelShape.from_param_count(10**6)
    best = recommend(plan(bare, 4, 80 * GIB), 80 * GIB)
    assert _degrees(best.layout) == (1, 4, 1, 1) and "activations are unknown" in (
        why_recommended(best))


def test_cpu_workers_share_this_machines_memory() -> None:
    config = load_config(REFERENCE_CONFIG, [])
    target = planned_devices(None, 2, config, gpus=[80 * GIB], machine_bytes=8 * GIB, cpus=2)
    # The config trains on CPU: a GPU here is not its device.
    assert target.bytes == 4 * GIB and not target.gpu
    assert target.source == "CPU workers: this machine's 8.00 GiB shared by 2, on 2 CPUs"
    assert planned_devices(None, 1, None, gpus=[], machine_bytes=8 * GIB,
                           cpus=4).bytes == 8 * GIB


def test_gpu_workers_plan_for_the_smallest_gpu_here() -> None:
    config = load_config(REFERENCE_CONFIG, ["scaling.gpus_per_worker=1"])
    target = planned_devices(None, 2, config, gpus=[80 * GIB, 40 * GIB])
    assert target.bytes == 40 * GIB and target.gpu
    assert target.source == "this machine's 2 GPUs, the smallest"
    # --params with no config: this machine's GPUs when it has any.
    assert planned_devices(None, 8, None, gpus=[24 * GIB]).source == "this machine's 1 GPU"
    with pytest.raises(PlanError, match=r"scaling.gpus_per_worker = 1.0 but this machine has "
                                        r"no GPU that nvidia-smi reports: give --memory-gb G"):
        planned_devices(None, 2, config, gpus=[])


def test_memory_gb_wins() -> None:
    target = planned_devices(16.0, 2, None, gpus=[80 * GIB], machine_bytes=GIB)
    assert target.bytes == 16 * GIB and target.source == "--memory-gb"


def test_plan_of_the_reference_config_recommends_its_own_ddp_layout(capsys, tmp_path: Path,
                                                                   monkeypatch) -> None:
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    smi = tmp_path / "nvidia-smi"  # a GPU here must not change a CPU config's devices
    smi.write_text("#!/bin/sh\necho 81559\n")
    smi.chmod(0o755)
    assert main(["plan", str(REFERENCE_CONFIG)]) == 0
    out = capsys.readouterr().out
    assert "(CPU workers: this machine's " in out and "80.0 GiB" not in out
    assert "<- recommended, config" in out
    assert "recommended: dp_replicate=2 x dp_shard=1 x tp=1 x pp=1" in out
