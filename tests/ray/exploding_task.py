"""A task for the ray tests of a bug in user code: the reference GPT, whose learning-rate
schedule raises at step `explode_at` (counted by the optimizer, so any layout raises at the
same step: steps 1 .. explode_at - 1 complete and are reported, step explode_at is not)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from stalwart.examples.gpt.task import GPTTask

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig


class ExplodingGPTTask(GPTTask):
    def __init__(self, *, explode_at: int, **kw: Any) -> None:
        super().__init__(**kw)
        self.explode_at = explode_at

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer, config: JobConfig
                           ) -> torch.optim.lr_scheduler.LRScheduler:
        def factor(step: int) -> float:
            # LambdaLR asks for step k's factor right after the k-th optimizer step.
            if step == self.explode_at:
                raise ValueError(f"user bug at step {step}")
            return 1.0

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
