"""Data parallelism on a DeviceMesh: FSDP2 for dp_shard, DDP for dp_replicate alone, HSDP for both.

The recipe is re-runnable after a resize: it only reads the mesh it is given.
Order matters and is fixed here: blocks are sharded one by one before the root, so each
block's parameters are gathered just before it runs and freed after (ZeRO-3) or kept
until backward (ZeRO-2, reshard_after_forward=False).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.nn.parallel import DistributedDataParallel


def build_mesh(device: torch.device, *, dp_replicate: int, dp_shard: int) -> DeviceMesh:
    return init_device_mesh(device.type, (dp_replicate, dp_shard),
                            mesh_dim_names=("dp_replicate", "dp_shard"))


def apply_data_parallel(model: torch.nn.Module, mesh: DeviceMesh, *,
                        reshard_after_forward: bool) -> torch.nn.Module:
    """Wrap `model` for the mesh's data-parallel layout; returns the module to train."""
    replicate, shard = mesh["dp_replicate"].size(), mesh["dp_shard"].size()
    if replicate * shard == 1:
        return model
    if shard == 1:
        return DistributedDataParallel(model, process_group=mesh["dp_replicate"].get_group(),
                                       device_ids=None if mesh.device_type == "cpu" else [0])
    # HSDP when replicate > 1: shard inside each replica group, all-reduce across them.
    fsdp_mesh = mesh if replicate > 1 else mesh["dp_shard"]
    blocks = getattr(model, "layers", None)
    if blocks is not None:
        for block in blocks:
            fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward)
    # The root holds what is left (embeddings, final norm, a tied output head); it is used
    # last in backward, so resharding it after forward would only regather it at once.
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=False)
    return model


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


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model
