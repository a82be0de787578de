"""run.loggers: the experiment trackers a run writes to, as Callbacks on the driver.

Each one's package is checked when the Trainer is made, so a missing one is a single clear
error before Ray or any worker starts. What each logs is in stalwart/integrations/run_log.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.callbacks import Callback

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig


def logger_callbacks(config: JobConfig, run_dir: Path) -> list[Callback]:
    """One callback per active logger (run.loggers, and run.tensorboard's `tensorboard`)."""
    callbacks: list[Callback] = []
    for name in config.run.active_loggers:
        if name == "tensorboard":
            from stalwart.integrations.tensorboard import TensorBoardLogger

            callbacks.append(TensorBoardLogger(run_dir / "tensorboard"))
        elif name == "mlflow":
            from stalwart.integrations.mlflow_logger import MLflowLogger

            callbacks.append(MLflowLogger(config, run_dir))
        elif name == "wandb":
            from stalwart.integrations.wandb_logger import WandbLogger

            callbacks.append(WandbLogger(config, run_dir))
    return callbacks
