"""Data parallelism on a DeviceMesh: FSDP2 for dp_shard (ZeRO-2/3), HSDP with dp_replicate,
DDP for dp_replicate alone.

FSDP2 is also used whenever the parameters are DTensors (tensor parallel), the sequence is
split (context parallel: its peers shard the parameters and average the gradients with the
data-parallel ranks, over dp_shard x cp), or mixed precision or CPU offload is asked for:
DDP has none of those. Blocks are sharded one by one before the
root, so each block's parameters are gathered just before it runs and freed after (ZeRO-3)
or kept until backward (ZeRO-2, reshard_after_forward=False).

Replicas of a pipeline stage (dp_replicate > 1 with pp > 1) are HSDP with a shard group of
one, as in TorchTitan, never DDP: a schedule runs every micro-batch's forward before the
backwards, and DDP's reducer expects one forward per backward (it fails at the first step
with "rebuilt parameter indices size is not same as original model parameters size").
FSDP2 exposes the hooks the schedule drives instead: no reduction until the stage's last
backward, then one all-reduce over the replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from stalwart.parallel.blocks import blocks_of
from stalwart.parallel.dims import fsdp_mesh
from stalwart.parallel.grad_compression import reduce_dtype

if TYPE_CHECKING:
    from stalwart.core.config import ParallelConfig


def needs_fsdp(mesh: DeviceMesh, config: ParallelConfig) -> bool:
    """FSDP2 rather than DDP (or nothing); stalwart/plan/estimate.py mirrors this rule."""
    pipelined_replicas = mesh["pp"].size() > 1 and mesh["dp_replicate"].size() > 1
    return (mesh["dp_shard"].size() > 1 or mesh["tp"].size() > 1 or mesh["cp"].size() > 1
            or pipelined_replicas
            or config.mixed_precision != "fp32" or config.cpu_offload)


def apply_data_parallel(model: torch.nn.Module, mesh: DeviceMesh, config: ParallelConfig,
                        ignored: set[torch.nn.Parameter] | None = None) -> torch.nn.Module:
    """Wrap `model` for the mesh's data-parallel layout; returns the module to train.
    `ignored`: parameters FSDP2 leaves whole and unreduced (experts split over ep ranks)."""
    replicate = mesh["dp_replicate"].size()
    if not needs_fsdp(mesh, config):
        if replicate == 1 or config.invariant_reduction:  # the engine reduces (invariant_reduce)
            return model
        return DistributedDataParallel(model, process_group=mesh["dp_replicate"].get_group(),
                                       device_ids=None if mesh.device_type == "cpu" else [0])
    # HSDP when replicate > 1: shard inside each replica group (possibly of one rank),
    # all-reduce across them.
    kwargs: dict = {"mesh": fsdp_mesh(mesh, replicate=replicate > 1)}
    if ignored:
        kwargs["ignored_params"] = ignored
    compressed = reduce_dtype(config)  # a half-precision reduction, if asked for
    if config.mixed_precision == "bf16" or compressed is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if config.mixed_precision == "bf16" else None,
            reduce_dtype=compressed or torch.float32)
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in blocks_of(model):
        fully_shard(block, reshard_after_forward=config.reshard_after_forward, **kwargs)
    # The root holds what is left (embeddings, final norm, a tied output head); it is used
    # last in backward, so resharding it after forward would only regather it at once.
    fully_shard(model, reshard_after_forward=False, **kwargs)
    return model


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself: DDP keeps it as `.module` (and names its parameters so); FSDP2
    changes the model in place."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextlib.contextmanager
def gradient_sync(model: torch.nn.Module, enabled: bool) -> Iterator[None]:
    """Skip the gradient reduction on all but the last micro-batch of an accumulation."""
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(enabled)
        yield
    elif isinstance(model, DistributedDataParallel) and not enabled:
        with model.no_sync():
            yield
    else:
        yield
