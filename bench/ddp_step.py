"""One optimizer step of a plain user DDP loop, as the baselines run it (torchrun_ddp.py and
Ray Train's workers in raytrain_worker.py): gradient accumulation with no_sync() on every
micro-batch but the last, clip_grad_norm_, optimizer and LR schedule, then the loss summed
over ranks. The same step on both baselines, so that they differ only in what runs them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from stalwart.config import TrainConfig
    from stalwart.task import TrainTask


def ddp_step(ddp: DistributedDataParallel, task: TrainTask, data: Any, items: Any,
             t: TrainConfig, accum: int, optimizer: torch.optim.Optimizer,
             scheduler: torch.optim.lr_scheduler.LRScheduler) -> tuple[float, int]:
    """Train one step on this rank's `items`, `accum` micro-batches; (the loss summed over
    ranks, this rank's tokens)."""
    ddp.train()
    loss_sum = torch.zeros(())
    tokens = 0
    for i in range(accum):
        inputs, targets = data.get_batch(items[i * t.micro_batch_size:
                                               (i + 1) * t.micro_batch_size])
        tokens += targets.numel()
        if i < accum - 1:
            with ddp.no_sync():
                loss = task.loss(ddp, inputs, targets) / accum
                loss.backward()
        else:
            loss = task.loss(ddp, inputs, targets) / accum
            loss.backward()
        loss_sum += loss.detach()
    if t.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), t.grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    dist.all_reduce(loss_sum)  # the global mean loss, for logging
    return loss_sum.item(), tokens
