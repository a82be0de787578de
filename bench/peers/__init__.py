"""The peers stalwart is measured against, as a careful user runs them: the same model, data,
sample order and step (ddp_step.py) under torchrun and under Ray Train's TorchTrainer."""

from __future__ import annotations

import sys


def torchrun(module: str, nproc: int, args: list[str], *, max_restarts: int = 0) -> list[str]:
    """`torchrun --standalone` over `python -m module args`, run from the repository root."""
    restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(nproc), *restarts, "-m", module, *args]
