"""JobConfig: the one frozen dataclass tree that describes a run, loaded from TOML.

sections.py holds one dataclass per TOML table (and the [[faults]] tables), job.py the tree
and its cross-section checks, loading.py reading TOML, ``--set`` overrides and dumping.
Every public name is re-exported here: import from ``stalwart.config``.
"""

from __future__ import annotations

from stalwart.core.config.job import JobConfig
from stalwart.core.config.loading import (
    apply_overrides,
    config_from_dict,
    dump_config,
    flatten,
    load_config,
    read_toml,
)
from stalwart.core.config.numerics import NumericsConfig
from stalwart.core.config.sections import (
    AC_MODES,
    PP_SCHEDULES,
    PRECISIONS,
    CheckpointConfig,
    DataConfig,
    FailureConfig,
    FaultKind,
    FaultSpec,
    ParallelConfig,
    RunConfig,
    ScalingConfig,
    TaskConfig,
    TrainConfig,
    parse_fault,
    parse_profile_steps,
)

__all__ = [
    "AC_MODES",
    "PP_SCHEDULES",
    "PRECISIONS",
    "CheckpointConfig",
    "DataConfig",
    "FailureConfig",
    "FaultKind",
    "FaultSpec",
    "JobConfig",
    "NumericsConfig",
    "ParallelConfig",
    "RunConfig",
    "ScalingConfig",
    "TaskConfig",
    "TrainConfig",
    "apply_overrides",
    "flatten",
    "config_from_dict",
    "dump_config",
    "load_config",
    "parse_fault",
    "parse_profile_steps",
    "read_toml",
]
