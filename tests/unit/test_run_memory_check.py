"""`stalwart run`'s memory check before start (stalwart/plan/preflight.py): the configured
layout as plan reads it, plan's rule and message, and the memory of this machine's workers.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from stalwart.checkpointing.memory.limits import cgroup_memory_limit, physical_memory
from stalwart.core.config import load_config
from stalwart.core.task import TrainTask, build_task
from stalwart.plan.estimate import ModelShape, PlanError, PlanLayout
from stalwart.plan.preflight import (
    WorkerMemory,
    check_fits,
    check_run_memory,
    gpu_memory,
    local_worker_memory,
    parse_gpu_memory,
    run_layout,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

GIB = 2**30
MIB = 2**20
AUDIT_MODEL = ["task.args.d_model=1048576", "task.args.n_heads=4", "task.args.n_layers=4",
               "task.args.seq_len=128"]


def _memory(n: int) -> WorkerMemory:
    return WorkerMemory(bytes=n, what="each of the 2 workers has")


def test_the_layout_is_the_configs_as_plan_reads_it() -> None:
    config = load_config(None, [
        "scaling.num_workers=4", "parallel.dp_replicate=1", "parallel.dp_shard=-1",
        "parallel.mixed_precision=bf16", "parallel.activation_checkpointing=full",
        "parallel.reshard_after_forward=false", "train.micro_batch_size=2",
        "train.global_batch_size=8"])
    assert run_layout(config) == PlanLayout(
        dp_replicate=1, dp_shard=4, tp=1, pp=1, zero3=False, mixed_precision="bf16",
        activation_checkpointing="full", micro_batch_size=2)


def test_a_model_that_fits_goes_ahead() -> None:
    config = load_config(None, [])
    task = build_task(config.task.path, config.task.args)
    check_fits(ModelShape.from_task(task, config), config, _memory(GIB))


def test_a_model_no_layout_can_hold_is_refused_with_plans_message() -> None:
    config = load_config(None, AUDIT_MODEL)
    shape = ModelShape.from_task(build_task(config.task.path, config.task.args), config)
    with pytest.raises(PlanError) as err:
        check_fits(shape, config, _memory(16 * GIB))
    message = str(err.value)
    assert message.startswith(f"the model of task.args = {config.task.args!r} "
                              f"({shape.n_params:,} parameters) does not fit: dp_replicate=1 x "
                              f"dp_shard=2 x tp=1 x pp=1, ZeRO-3 needs ")
    assert " per worker by the estimate of `stalwart plan`, more than the 16.0 GiB each of the " \
           "2 workers has; no layout of 2 devices fits in 16.0 GiB per device: the smallest " \
           "estimate is " in message
    assert "\n" not in message


def test_a_layout_that_fits_is_named_with_its_flags() -> None:
    # DDP keeps all 16 bytes a parameter and a second gradient copy in its buckets (20 in
    # all); ZeRO-3 over two ranks keeps 8 of them: 10 per parameter lets only the second in.
    config = load_config(None, ["parallel.dp_replicate=-1", "parallel.dp_shard=1"])
    shape = ModelShape.from_param_count(10**6)
    with pytest.raises(PlanError) as err:
        check_fits(shape, config, _memory(10 * 10**6))
    message = str(err.value)
    assert "dp_replicate=2 x dp_shard=1 x tp=1 x pp=1, ZeRO-0 needs at least 19.1 MiB" in message
    assert message.endswith("; dp_replicate=1 x dp_shard=2 x tp=1 x pp=1, ZeRO-3 fits (7.63 MiB "
                            "per worker): --set parallel.dp_replicate=1 --set "
                            "parallel.dp_shard=2 --set parallel.cp=1 --set parallel.tp=1 --set "
                            "parallel.pp=1 --set parallel.ep=1")


def test_the_audits_model_is_refused_on_this_machine() -> None:
    config = load_config(None, AUDIT_MODEL)
    with pytest.raises(PlanError, match=r"does not fit: .* more than the .* each of the 2 "
                                        r"workers has \(this machine's .*, shared\); no layout"):
        check_run_memory(build_task(config.task.path, config.task.args), config)


class _NotOnMeta(TrainTask):
    def build_model(self, config: object) -> torch.nn.Module:
        raise RuntimeError("reads its weights from a file")


class _NoDimsOnMeta(TrainTask):
    def build_model(self, config: object) -> torch.nn.Module:
        return torch.nn.Linear(4, 4)

    def model_dims(self, model: torch.nn.Module) -> None:
        raise RuntimeError("reads the weights' values")


@pytest.mark.parametrize("task", [_NotOnMeta(), _NoDimsOnMeta()])
def test_a_model_that_cannot_be_estimated_goes_ahead_unchecked(task: TrainTask) -> None:
    check_run_memory(task, load_config(None, []))


def test_cpu_workers_share_this_machines_memory() -> None:
    total = min(n for n in (cgroup_memory_limit(), physical_memory()) if n)
    four = local_worker_memory(load_config(None, ["scaling.num_workers=4"]))
    assert four is not None and four.bytes == total // 4
    assert four.what.startswith("each of the 4 workers has (this machine's ")
    one = local_worker_memory(load_config(None, ["scaling.num_workers=1"]))
    assert one == WorkerMemory(bytes=total, what="that this machine has")


def _fake_nvidia_smi(folder: Path, output: str) -> None:
    exe = folder / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\nprintf '{output}'\n")
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)


def test_gpu_workers_get_the_largest_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_nvidia_smi(tmp_path, "16384\\n81559\\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    config = load_config(None, ["scaling.gpus_per_worker=1"])
    assert gpu_memory() == [16384 * MIB, 81559 * MIB]
    assert local_worker_memory(config) == WorkerMemory(bytes=81559 * MIB,
                                                       what="of this machine's largest GPU")


def test_gpu_workers_without_nvidia_smi_go_unchecked(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no nvidia-smi
    assert gpu_memory() == []
    assert local_worker_memory(load_config(None, ["scaling.gpus_per_worker=1"])) is None


def test_nvidia_smi_lines_that_are_not_sizes_are_left_out() -> None:
    assert parse_gpu_memory("81559\n[N/A]\n 40960 \n\nnan\n0\n") == [81559 * MIB, 40960 * MIB]
