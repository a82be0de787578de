"""stalwart.integrations.tune: hyperparameter sweeps of stalwart jobs with Ray Tune.

`trainable(config, overrides, metric=...)` is a Tune function trainable: one whole stalwart
run per trial (its own workers and fault tolerance), reporting every logged step and
registering its checkpoints, so ASHA can stop trials early and Population Based Training can
restart one from another's checkpoint. `stalwart sweep SWEEP.toml` runs one from a file
(see stalwart.integrations.tune.sweep_file).

Names load on first use, as `stalwart`'s do: reading a sweep file must not import torch and
the checkpoint writer, so `stalwart sweep` refuses a bad file in a second.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.integrations.tune.reporter import TuneReporter
    from stalwart.integrations.tune.sweep_file import Sweep, SweepError, load_sweep
    from stalwart.integrations.tune.trainable import as_overrides, trainable

_PUBLIC = {
    "TuneReporter": "stalwart.integrations.tune.reporter",
    "Sweep": "stalwart.integrations.tune.sweep_file",
    "SweepError": "stalwart.integrations.tune.sweep_file",
    "load_sweep": "stalwart.integrations.tune.sweep_file",
    "as_overrides": "stalwart.integrations.tune.trainable",
    "trainable": "stalwart.integrations.tune.trainable",
}

__all__ = ["Sweep", "SweepError", "TuneReporter", "as_overrides", "load_sweep", "trainable"]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'stalwart.integrations.tune' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
