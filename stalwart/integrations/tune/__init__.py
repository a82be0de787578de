"""stalwart.integrations.tune: hyperparameter sweeps of stalwart jobs with Ray Tune.

`trainable(config, overrides, metric=...)` is a Tune function trainable: one whole stalwart
run per trial (its own workers and fault tolerance), reporting every logged step and
registering its checkpoints, so ASHA can stop trials early and Population Based Training can
restart one from another's checkpoint. `stalwart sweep SWEEP.toml` runs one from a file
(see stalwart.integrations.tune.sweep_file).
"""

from __future__ import annotations

from stalwart.integrations.tune.reporter import TuneReporter
from stalwart.integrations.tune.sweep_file import Sweep, SweepError, load_sweep
from stalwart.integrations.tune.trainable import as_overrides, trainable

__all__ = ["Sweep", "SweepError", "TuneReporter", "as_overrides", "load_sweep", "trainable"]
