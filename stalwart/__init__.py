"""stalwart: elastic, fault-tolerant PyTorch training on Ray.

Public API: `JobConfig` (+ `load_config`), `TrainTask`, `Trainer` and its `RunResult`,
`Callback`; sweeps with Ray Tune in `stalwart.tune`.
"""

from __future__ import annotations

from stalwart.callbacks import Callback
from stalwart.config import JobConfig, load_config
from stalwart.task import TrainTask
from stalwart.trainer import RunResult, Trainer

__all__ = ["Callback", "JobConfig", "RunResult", "TrainTask", "Trainer", "load_config"]
