"""The devices `stalwart plan` plans for: their memory each, and where that figure came from.

`--memory-gb` wins. Without it, the devices a run on this machine would train on: its GPUs
(the smallest, as every rank must fit) when the run trains on CUDA (`scaling.gpus_per_worker >
0`, or with `--params` whenever nvidia-smi reports a GPU), else CPU workers, which share this
machine's memory (its RAM, or its cgroup's limit when lower) evenly. No fixed size is assumed:
a plan for devices that are not these says so with `--memory-gb`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stalwart.plan.estimate import PlanError
from stalwart.plan.preflight import gpu_memory, machine_memory
from stalwart.plan.search import format_bytes

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig


@dataclass(frozen=True, kw_only=True)
class PlannedDevices:
    bytes: int
    """The memory of one device."""
    source: str
    """Where `bytes` came from, shown after the plan's `devices:` line."""
    gpu: bool
    """CUDA devices; False: CPU workers."""


def planned_devices(memory_gb: float | None, devices: int, config: JobConfig | None, *,
                    gpus: list[int] | None = None, machine_bytes: int | None = None,
                    cpus: int | None = None) -> PlannedDevices:
    """The devices to plan for (`gpus`, `machine_bytes`, `cpus`: this machine's, read when
    None)."""
    wants_gpu = config is not None and config.scaling.gpus_per_worker > 0
    if memory_gb is not None:
        return PlannedDevices(bytes=round(memory_gb * 2**30), source="--memory-gb",
                              gpu=wants_gpu or config is None)
    if wants_gpu or config is None:
        sizes = gpu_memory() if gpus is None else gpus
        if sizes:
            return _gpus(sizes)
        if wants_gpu:
            raise PlanError(f"scaling.gpus_per_worker = {config.scaling.gpus_per_worker} but "
                            f"this machine has no GPU that nvidia-smi reports: give "
                            f"--memory-gb G, the GiB of each GPU the run will have")
    return _cpu_workers(devices, machine_bytes or machine_memory(), cpus or os.cpu_count() or 1)


def _gpus(sizes: list[int]) -> PlannedDevices:
    smallest = min(sizes)
    which = (f"this machine's {len(sizes)} GPU{'s' if len(sizes) > 1 else ''}"
             + ("" if len(set(sizes)) == 1 else ", the smallest"))
    return PlannedDevices(bytes=smallest, source=which, gpu=True)


def _cpu_workers(devices: int, total: int, cpus: int) -> PlannedDevices:
    shared = f" shared by {devices}" if devices > 1 else ""
    return PlannedDevices(bytes=total // devices, gpu=False,
                          source=f"CPU workers: this machine's {format_bytes(total)}{shared}, "
                                 f"on {cpus} CPU{'s' if cpus != 1 else ''}")
