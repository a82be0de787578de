"""ParallelDims: how a world of ranks splits into pipeline, data, context and tensor dimensions.

`pp x dp_replicate x dp_shard x cp x tp = world`. The mesh is laid out outermost to innermost
in TorchTitan's order, (pp, dp_replicate, dp_shard, cp, tp): tensor-parallel peers are
adjacent ranks (on a multi-GPU host they share the fastest links), context-parallel peers
(one all-gather of keys and values per layer) next, and pipeline stages, which exchange the
least, are furthest apart. FSDP2 shards over dp_shard x cp flattened ("dp_shard_cp"):
context-parallel peers hold the same parameters and reduce their gradients together.
Pure data (no process group needed), so layouts can be validated on the driver before any
worker starts and after every resize.

Resizing keeps tp x cp x pp fixed and changes the data-parallel degree.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stalwart.core.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from stalwart.core.config import ParallelConfig

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
FSDP_DIM = "dp_shard_cp"
"""The flattened (dp_shard, cp) dimension that FSDP2 shards over."""


@dataclass(frozen=True)
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    cp: int = 1
    ep: int = 1
    """Expert parallel: splits the experts over ep consecutive dp_shard ranks (not a mesh
    dimension: parallel/expert_parallel.py makes its groups)."""
    stages_per_rank: int = 1
    """Pipeline stages each pp rank runs: 2 for the interleaved schedules (virtual stages)."""
    pp_schedule: str = "1f1b"
    """parallel.pp_schedule (only read when pp > 1)."""

    @classmethod
    def from_config(cls, parallel: ParallelConfig, world_size: int) -> ParallelDims:
        replicate, shard = parallel.degrees(world_size)
        looped = parallel.pp > 1 and parallel.pp_schedule in ("interleaved_1f1b", "zero_bubble")
        return cls(dp_replicate=replicate, dp_shard=shard, tp=parallel.tp, pp=parallel.pp,
                   cp=parallel.cp, ep=parallel.ep, stages_per_rank=2 if looped else 1,
                   pp_schedule=parallel.pp_schedule)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    def replica_class(self, rank: int) -> tuple[int, int, int, int]:
        """The (pp, dp_shard, cp, tp) coordinates of a rank: ranks with equal ones are
        data-parallel replicas, holding identical parameters and optimizer state."""
        tp_i = rank % self.tp
        cp_i = rank // self.tp % self.cp
        shard_i = rank // (self.tp * self.cp) % self.dp_shard
        pp_i = rank // (self.tp * self.cp * self.dp_shard * self.dp_replicate)
        return pp_i, shard_i, cp_i, tp_i

    def check_composition(self) -> None:
        """Refuse a composition of parallelisms that stalwart cannot train exactly, whatever
        the model (TrainTask.check_layout calls it, on the driver before any worker starts)."""
        if self.pp > 1 and self.pp_schedule == "zero_bubble" and self.dp_size > 1:
            # torch 2.13's split backward (input, then weight gradients) under FSDP2 gives
            # gradients off one process's (the loss 0.6% off after one step, dp 2 x pp 2).
            raise ConfigError(
                f"parallel.pp_schedule = zero_bubble is invalid with {self.dp_size} "
                f"data-parallel ranks ({self.describe()}): its split backward does not "
                f"compose with data parallelism; use pp_schedule = interleaved_1f1b (the same "
                f"stages per rank) or dp_replicate = dp_shard = 1")
        if self.cp > 1 and self.pp > 1:
            raise ConfigError(
                f"parallel.cp = {self.cp} is invalid with parallel.pp = {self.pp}: context "
                f"parallelism does not yet run inside pipeline stages; use cp with data and "
                f"tensor parallelism, or pp without cp")

    def check_model(self, *, n_heads: int | None, n_layers: int | None = None,
                    seq_len: int | None = None) -> None:
        """Refuse a layout the model cannot be split by."""
        if self.tp > 1 and n_heads is not None and n_heads % self.tp:
            raise ConfigError(f"parallel.tp = {self.tp} is invalid: must divide the model's "
                              f"{n_heads} attention heads")
        if self.cp > 1 and seq_len is not None and seq_len % (2 * self.cp):
            raise ConfigError(f"parallel.cp = {self.cp} is invalid: the sequence length "
                              f"{seq_len} must be a multiple of 2 x cp = {2 * self.cp} (each "
                              f"rank holds two equal chunks)")
        stages = self.pp * self.stages_per_rank
        if self.pp > 1 and n_layers is not None and n_layers < stages:
            raise ConfigError(f"parallel.pp = {self.pp} is invalid: {stages} pipeline stages "
                              f"need at least as many blocks, the model has {n_layers}")

    def build_mesh(self, device_type: str) -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (self.pp, self.dp_replicate, self.dp_shard,
                                               self.cp, self.tp), mesh_dim_names=MESH_DIMS)
        if self.cp > 1:
            # FSDP2's dimension (DeviceMesh's flatten is private API; TorchTitan builds its
            # FSDP mesh the same way). Only then: it makes process groups of its own.
            mesh["dp_shard", "cp"]._flatten(FSDP_DIM)
        return mesh

    def describe(self) -> str:
        ep = f" (ep={self.ep})" if self.ep > 1 else ""
        return (f"pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} "
                f"x cp={self.cp} x tp={self.tp}{ep}")


def fsdp_mesh(mesh: DeviceMesh, *, replicate: bool) -> DeviceMesh:
    """The mesh FSDP2 shards over: dp_shard, or dp_shard x cp flattened; with `replicate`,
    the dp_replicate dimension before it (HSDP)."""
    shard = FSDP_DIM if mesh["cp"].size() > 1 else "dp_shard"
    with warnings.catch_warnings():
        # torch warns that slicing a flattened dimension from the root mesh will go; torch
        # 2.13 has no other way to name it beside dp_replicate.
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        return mesh["dp_replicate", shard] if replicate else mesh[shard]


def dp_coordinates(mesh: DeviceMesh) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of this rank: which slice of the batch it reads."""
    shard = mesh["dp_shard"]
    rank = mesh["dp_replicate"].get_local_rank() * shard.size() + shard.get_local_rank()
    return rank, mesh["dp_replicate"].size() * shard.size()
