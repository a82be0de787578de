"""The controller's policies, built from the job's config: failure, scaling and restore.

Each is pure: it is given views (orchestrator/group.py) and times, and returns its decisions
as plain data; the controller fetches the views and carries the decisions out. Tests build
their own (or these, from a test config) and pass them in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stalwart.orchestrator.failures import FailurePolicy
from stalwart.orchestrator.restore import RestorePolicy
from stalwart.orchestrator.scaling import ScalingPolicy

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig


@dataclass(frozen=True, kw_only=True)
class Policies:
    failure: FailurePolicy
    scaling: ScalingPolicy
    restore: RestorePolicy


def default_policies(config: JobConfig, *, storage_url: str) -> Policies:
    """The policies config asks for."""
    fc = config.failure
    return Policies(
        failure=FailurePolicy(fc.max_failures, retry_user_errors=fc.retry_user_errors,
                              backoff_s=fc.backoff_s),
        scaling=ScalingPolicy(config.scaling, storage_url=storage_url),
        restore=RestorePolicy(memory_tier=config.checkpoint.memory_tier))
