"""Process groups and devices: join a world at a rendezvous address, leave it cleanly.

The device is chosen at run time: CUDA with NCCL when the worker was given a GPU and CUDA
is present, otherwise CPU with gloo. Nothing else in stalwart hard-codes a backend.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RendezvousAddress:
    """Where a generation of workers meets to form its process group: rank 0's node address
    and a port free on it (torch's TCP init method)."""

    host: str
    port: int

    @property
    def init_method(self) -> str:
        return f"tcp://{self.host}:{self.port}"


def free_port() -> int:
    """A port that is free now on this host (the OS picks it, so parallel runs never clash)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def pick_device(want_gpu: bool) -> torch.device:
    if want_gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("scaling.gpus_per_worker > 0 but CUDA is not available on this worker")
        # Ray sets CUDA_VISIBLE_DEVICES per actor, so the actor's GPU is always index 0.
        torch.cuda.set_device(0)
        return torch.device("cuda", 0)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(rdzv: RendezvousAddress, *, rank: int, world_size: int,
                       device: torch.device, timeout_s: float) -> None:
    dist.init_process_group(
        backend=backend_for(device),
        init_method=rdzv.init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def abort_process_groups() -> None:
    """Abort every process group of this process at once: their connections close, so any
    operation still waiting on them fails now, here and on every peer.

    How a world is left after a failure: a peer lost with its node closes nothing, and a
    peer whose groups are only destroyed keeps their sockets open for as long as anything
    references them; either can leave a survivor blocked in a collective until its timeout.
    """
    if dist.is_available() and dist.is_initialized():
        dist.distributed_c10d._abort_process_group()


def forget_dtensor_caches() -> None:
    """Drop DTensor's caches of sharding decisions before a process joins a new world.

    DTensor caches the output spec of each op by its input specs, and a DeviceMesh compares
    equal to any mesh of the same shape: a process that was rank 1 of the last world and is
    rank 0 of this one would get the last world's mesh back (its coordinate, its groups)
    for parameters it shards now, and train and checkpoint the wrong shard. The
    sharding-propagation cache is per thread; this clears the calling thread's.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._collective_utils import MeshTopoInfo
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    # The C++ dispatch fast path keeps a cache of its own (per thread).
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    MeshTopoInfo.build_from_mesh.cache_clear()
