"""parallelize: the one recipe that turns a freshly initialised model into its parallel form.

Read top to bottom; each step's place in the order is a constraint, said where it applies.
Re-runnable unchanged after a resize: it only reads the mesh and config it is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from stalwart.parallel.activation_checkpoint import apply_activation_checkpointing
from stalwart.parallel.blocks import blocks_of
from stalwart.parallel.data_parallel import apply_data_parallel, needs_fsdp

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from stalwart.core.config import ParallelConfig
    from stalwart.core.task import TrainTask
    from stalwart.parallel.context_parallel import ContextShard


def parallelize(model: torch.nn.Module, *, mesh: DeviceMesh | None, config: ParallelConfig,
                task: TrainTask,
                materialize: Callable[[torch.nn.Module], None] | None = None,
                context: ContextShard | None = None,
                experts: set[torch.nn.Parameter] | None = None) -> torch.nn.Module:
    """`mesh` None: a single process without a process group (only steps 2 and 3 apply).

    `materialize`: for a model built on the meta device, what allocates and fills it
    (parallel/meta_init.py), called once its parameters are split (step 4). `context`: this
    rank's part of each sequence under context parallelism, the one the engine cuts batches
    by (parallel/context_parallel.py). `experts`: the
    parameters expert parallelism split (parallel/expert_parallel.py), which data
    parallelism leaves whole."""
    materialize = materialize or (lambda _: None)
    # 1. Tensor parallel first: it replaces parameters with DTensors sharded over the tp
    #    mesh, which FSDP below then shards again over dp (2-D parameters).
    if mesh is not None and mesh["tp"].size() > 1:
        task.apply_tensor_parallel(model, mesh["tp"], sequence_parallel=config.sequence_parallel)
    # 1b. Context parallel: attention learns the rank's share of the sequence. It changes no
    #     parameter, so its place among the steps only needs to precede compilation.
    if context is not None:
        task.apply_context_parallel(model, context)

    # 2. Activation checkpointing wraps whole blocks, after TP so that recomputation
    #    replays the block's TP collectives too, and before FSDP so that FSDP's hooks sit
    #    outside the checkpointed region (parameters are gathered once per recompute).
    apply_activation_checkpointing(model, config.activation_checkpointing)
    # 3. Compile each block on its own: same-shaped blocks reuse one compiled graph, and
    #    FSDP's per-block communication stays outside the graphs.
    if config.compile:
        for block in blocks_of(model):
            block.compile()

    # 4. Data parallel last: FSDP2 / HSDP (with mixed precision and CPU offload) or DDP.
    #    A meta-device model is allocated after FSDP shards it (each rank then holds only
    #    its shards), but before DDP, which needs real parameters to wrap.
    if mesh is not None and needs_fsdp(mesh, config):
        model = apply_data_parallel(model, mesh, config, ignored=experts)
        materialize(model)
        return model
    materialize(model)
    return apply_data_parallel(model, mesh, config) if mesh is not None else model
