"""A plain user DDP loop's setup and optimizer step, the same for every peer: stalwart's task,
data, sample order and seeded model, no_sync() accumulation, clipping, optimizer and schedule,
so that the peers differ only in what runs them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from stalwart.core.config import load_config
from stalwart.core.task import build_task
from stalwart.examples.gpt.data import TokenDataset, build_token_files
from stalwart.workers.sampler import GlobalSampler, rank_slice

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig, TrainConfig
    from stalwart.core.task import TrainTask


@dataclass
class DDPSetup:
    train: TrainConfig
    task: TrainTask
    accum: int
    """Micro-batches per step on each rank."""
    data: TokenDataset
    sampler: GlobalSampler
    model: torch.nn.Module
    """The bare model, whose state_dict a checkpoint saves."""
    ddp: DistributedDataParallel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int = 0
    """Optimizer steps taken (or restored)."""
    samples_seen: int = 0

    def state_dict(self) -> dict[str, Any]:
        """What a baseline's checkpoint holds: enough to resume at `step` bit for bit."""
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(), "step": self.step,
                "samples_seen": self.samples_seen}

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.samples_seen = state["step"], state["samples_seen"]

    def rank_step(self, rank: int, world: int) -> tuple[float, int]:
        """The next step on this rank's share: (the loss summed over ranks, this rank's tokens)."""
        ddp, task, data, accum, t = self.ddp, self.task, self.data, self.accum, self.train
        start, count = rank_slice(self.samples_seen, t.global_batch_size, rank, world)
        items = self.sampler.items(start, count)
        ddp.train()
        loss_sum, tokens = torch.zeros(()), 0
        for i in range(accum):
            inputs, targets = data.get_batch(items[i * t.micro_batch_size:
                                                   (i + 1) * t.micro_batch_size])
            tokens += targets.numel()
            # The gradients are all-reduced once, in the last micro-batch's backward.
            with ddp.no_sync() if i < accum - 1 else contextlib.nullcontext():
                loss = task.loss(ddp, inputs, targets) / accum
                loss.backward()
            loss_sum += loss.detach()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), t.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_sum)  # the global mean loss, for logging
        self.step += 1
        self.samples_seen += t.global_batch_size
        return loss_sum.item(), tokens


def build_ddp(config: JobConfig, world: int) -> DDPSetup:
    """The baseline's task, data (file-locked: every rank may build it) and DDP model."""
    t = config.train
    task = build_task(config.task.path, config.task.args)
    files = build_token_files((Path(config.data.cache_dir) / "gpt-stdlib").expanduser(),
                              val_fraction=task.val_fraction)
    data = TokenDataset(files.train, task.model_config.seq_len)
    torch.manual_seed(t.seed)
    model = task.build_model(config)
    task.init_weights(model)
    ddp = DistributedDataParallel(model)
    optimizer = task.build_optimizer(ddp, config)
    return DDPSetup(train=t, task=task, accum=t.global_batch_size // (t.micro_batch_size * world),
                    data=data, sampler=GlobalSampler(len(data), seed=t.seed), model=model, ddp=ddp,
                    optimizer=optimizer, scheduler=task.build_lr_scheduler(optimizer, config))


def torchrun_setup(config: str, overrides: list[str], steps: int | None
                   ) -> tuple[int, int, DDPSetup]:
    """(rank, world, baseline) of a torchrun process: gloo, one thread per rank."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    sets = [*overrides, f"scaling.num_workers={world}"] + (
        [f"train.steps={steps}"] if steps is not None else [])
    return dist.get_rank(), world, build_ddp(load_config(config, sets), world)
