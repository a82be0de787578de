"""stalwart: elastic, fault-tolerant PyTorch training on Ray.

Public API: `JobConfig` (+ `load_config`), `TrainTask`, `Trainer` and its `RunResult` (with
its `Checkpoint`), `Callback`; sweeps with Ray Tune in `stalwart.integrations.tune`.

Names are imported on first use: `stalwart` is the parent of every subsystem
(`stalwart.parallel`, `stalwart.workers`, ...), and importing one of them must not load the
trainer, Ray and the driver stack with it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.callbacks import Callback
    from stalwart.core.config import JobConfig, load_config
    from stalwart.core.task import TrainTask
    from stalwart.trainer import Checkpoint, RunResult, Trainer

_PUBLIC = {
    "Callback": "stalwart.callbacks",
    "JobConfig": "stalwart.core.config",
    "load_config": "stalwart.core.config",
    "TrainTask": "stalwart.core.task",
    "RunResult": "stalwart.trainer",
    "Checkpoint": "stalwart.trainer",
    "Trainer": "stalwart.trainer",
}

__all__ = ["Callback", "Checkpoint", "JobConfig", "RunResult", "TrainTask", "Trainer", "load_config"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'stalwart' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
