"""`stalwart run`'s memory check before start: `stalwart plan`'s estimate of the configured
layout against the memory each worker's device will have.

The model is built on the meta device on the driver and estimated as `plan` does
(estimate.py); the run is refused when the busiest rank needs more than a worker's device
holds: plan's rule for a layout that fits. Only memory known before Ray starts counts: a
run on this machine's own Ray, whose workers share its RAM (CPU workers) or each use one of
its GPUs. On a cluster the workers' nodes are not known yet; there, as for a model that
cannot be built on the meta device, the run goes ahead unchecked.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stalwart.plan.estimate import ModelShape, PlanError, PlanLayout, estimate
from stalwart.plan.search import format_bytes, plan, recommend, runnable_check

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig
    from stalwart.core.task import TrainTask

NVIDIA_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True, kw_only=True)
class WorkerMemory:
    bytes: int
    """What one worker's device holds."""
    what: str
    """Whose memory that is, for the message: `each of the 2 workers has (...)`."""


def run_layout(config: JobConfig) -> PlanLayout:
    """The layout a run of `config` starts with (scaling.num_workers ranks), with the options
    that size its memory, read from the config as `stalwart plan CONFIG` reads them."""
    par = config.parallel
    replicate, shard = par.degrees(config.scaling.num_workers)
    return PlanLayout(dp_replicate=replicate, dp_shard=shard, cp=par.cp, tp=par.tp, pp=par.pp,
                      ep=par.ep,
                      zero3=par.reshard_after_forward, mixed_precision=par.mixed_precision,
                      cpu_offload=par.cpu_offload,
                      activation_checkpointing=par.activation_checkpointing,
                      sequence_parallel=par.sequence_parallel,
                      micro_batch_size=config.train.micro_batch_size,
                      pp_schedule=par.pp_schedule)


def check_fits(shape: ModelShape, config: JobConfig, memory: WorkerMemory) -> None:
    """Refuse, with plan's figures, a config whose layout's estimate exceeds `memory`."""
    layout = run_layout(config)
    need = estimate(shape, layout)
    if need.device <= memory.bytes:
        return
    bound = "" if need.complete else " at least"
    head = (f"the model of task.args = {config.task.args!r} ({shape.n_params:,} parameters) "
            f"does not fit: {layout.describe()} needs{bound} {format_bytes(need.device)} per "
            f"worker by the estimate of `stalwart plan`, more than the "
            f"{format_bytes(memory.bytes)} {memory.what}")
    try:
        best = recommend(plan(shape, layout.devices, memory.bytes, layout,
                              check=runnable_check(config)), memory.bytes)
    except PlanError as exc:  # no layout fits (plan's own message), or none can run
        raise PlanError(f"{head}; {exc}") from None
    flags = " ".join(f"--set parallel.{k}={v}" for k, v in best.layout.degrees().items())
    raise PlanError(f"{head}; {best.layout.describe()} fits "
                    f"({format_bytes(best.estimate.device)} per worker): {flags}")


def check_run_memory(task: TrainTask, config: JobConfig) -> None:
    """Refuse a run on this machine's Ray whose model does not fit its workers' devices."""
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return  # joined earlier (a Tune trial, a notebook): its nodes are not this machine
    memory = local_worker_memory(config)
    if memory is None:
        return
    try:
        shape = ModelShape.from_task(task, config)
    except Exception:  # user code (build_model, model_dims) on the meta device
        return  # not estimable: the workers build it for real and report their own errors
    check_fits(shape, config, memory)


def local_worker_memory(config: JobConfig) -> WorkerMemory | None:
    """What each worker of a run on this machine's Ray has: its GPU's memory (the largest
    GPU's, none being known to be the worker's), or for CPU workers an even share of the
    machine's memory (its RAM, or its cgroup's limit when lower). None: unknown."""
    workers = config.scaling.num_workers
    if config.scaling.gpus_per_worker > 0:
        gpus = gpu_memory()
        if not gpus:
            return None  # no GPU here: Ray has none either, and says so before start
        return WorkerMemory(bytes=max(gpus), what="of this machine's largest GPU")
    total = machine_memory()
    if workers == 1:
        return WorkerMemory(bytes=total, what="that this machine has")
    return WorkerMemory(bytes=total // workers,
                        what=f"each of the {workers} workers has (this machine's "
                             f"{format_bytes(total)}, shared)")


def machine_memory() -> int:
    """This machine's memory: its RAM, or its cgroup's limit when lower."""
    from stalwart.checkpointing.memory.limits import cgroup_memory_limit, physical_memory

    return min(n for n in (cgroup_memory_limit(), physical_memory()) if n)


def gpu_memory() -> list[int]:
    """Bytes of each NVIDIA GPU of this machine, from nvidia-smi; [] when there is none or
    it cannot say. Asked in a process of its own: the driver opens no CUDA context, which
    would hold memory on a GPU the workers need."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S,
                             check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_gpu_memory(out)


def parse_gpu_memory(text: str) -> list[int]:
    """nvidia-smi's `memory.total` in MiB, one GPU a line, as bytes; a line that is not a
    number (`[N/A]`) is left out."""
    sizes = []
    for line in text.splitlines():
        try:
            sizes.append(int(float(line.strip()) * 2**20))
        except (ValueError, OverflowError):
            continue
    return [n for n in sizes if n > 0]
