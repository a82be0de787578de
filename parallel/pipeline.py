"""Pipeline parallelism with torch.distributed.pipelining: stages on the pp mesh, one schedule.

The micro-batches of a pipeline are the step's gradient-accumulation micro-batches
(global batch / (micro_batch_size x data-parallel ranks)), so the global batch, and with it
the loss curve, is the same as in any other layout. Stage s of S runs on pp rank s % pp
(looped: the interleaved schedules give each rank stages r and r + pp).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from stalwart.parallel.meta_init import allocate
from stalwart.parallel.recipe import parallelize

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from stalwart.core.config import ParallelConfig
    from stalwart.core.task import TrainTask
    from stalwart.parallel.dims import ParallelDims

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}


@dataclass
class Pipeline:
    schedule: object
    stages: list[torch.nn.Module]
    """The stage modules this rank runs (parallelized)."""
    rank_module: torch.nn.Module
    """Every parameter of this rank's stages under the whole model's names."""
    has_first: bool
    has_last: bool

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of all micro-batches; the mean loss on the last stage."""
        return self._run(self.schedule.step, inputs, targets)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        """Forward only; the mean loss on the last stage."""
        return self._run(self.schedule.eval, inputs, targets)

    def _run(self, run: Callable, inputs: torch.Tensor, targets: torch.Tensor
             ) -> torch.Tensor | None:
        # Only the first stage feeds inputs and only the last has targets and losses.
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        run(*args, target=targets if self.has_last else None, losses=losses)
        return torch.stack(losses).mean() if self.has_last else None


def build_pipeline(model: torch.nn.Module, *, task: TrainTask, dims: ParallelDims,
                   mesh: DeviceMesh, config: ParallelConfig, device: torch.device,
                   n_microbatches: int, loss_fn: Callable,
                   init: Callable[[torch.nn.Module], None] | None = None) -> Pipeline:
    """`init`: for a model built on the meta device, what fills it (the task's
    init_weights), called once on the rank's module after every stage is split and
    allocated."""
    pp_rank = mesh["pp"].get_local_rank()
    num_stages = dims.pp * dims.stages_per_rank
    stage_ids = [pp_rank + k * dims.pp for k in range(dims.stages_per_rank)]
    stage_modules, rank_module = task.split_pipeline(model, stage_ids, num_stages)
    # Each stage is parallelized on its own (TP, AC, compile, FSDP): FSDP's root per stage
    # lets the schedule drive each stage's gradient reduction at its last micro-batch.
    stage_modules = [parallelize(m, mesh=mesh, config=config, task=task) for m in stage_modules]
    if init is not None:
        for m in stage_modules:
            allocate(m, device)
        with torch.no_grad():
            init(rank_module)  # once: a load from files is collective over the world
    stages = [PipelineStage(m, s, num_stages, device, group=mesh["pp"].get_group())
              for m, s in zip(stage_modules, stage_ids, strict=True)]
    cls = SCHEDULES[config.pp_schedule]
    # scale_grads: the gradients are averaged over micro-batches, as accumulation does.
    schedule = (cls(stages[0], n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
                if dims.stages_per_rank == 1 else
                cls(stages, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True))
    return Pipeline(schedule=schedule, stages=stage_modules, rank_module=rank_module,
                    has_first=0 in stage_ids, has_last=num_stages - 1 in stage_ids)
