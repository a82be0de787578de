"""What went wrong, and what to do about it: failures and the failure policy's decisions.

Decisions are plain data (Ray Train v2's shape): the policy decides, the controller acts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FailureKind(StrEnum):
    WORKER_DIED = "worker_died"
    """The actor's process or node is gone (Ray actor error)."""
    USER_ERROR = "user_error"
    """An exception in the training thread: the task's code, or a failed collective."""
    START_ERROR = "start_error"
    """A worker could not be placed, joined or set up."""


@dataclass(frozen=True)
class WorkerFailure:
    kind: FailureKind
    rank: int | None
    message: str
    """One line for humans; for USER_ERROR the full traceback."""
    detected_at: float
    """time.time() when the controller noticed."""


@dataclass(frozen=True)
class RetryDecision:
    failure: WorkerFailure
    attempt: int
    """1 for the first recovery."""


@dataclass(frozen=True)
class FailDecision:
    failure: WorkerFailure
    reason: str


class FailurePolicy:
    """Restart from the newest checkpoint while the budget lasts; an exception raised by the
    task's code is not retried (it would fail the same way again) and ends the run at once."""

    def __init__(self, max_failures: int) -> None:
        self.max_failures = max_failures
        self.failures = 0

    def make_decision(self, failure: WorkerFailure) -> RetryDecision | FailDecision:
        self.failures += 1
        if failure.kind is FailureKind.USER_ERROR:
            return FailDecision(failure, "an exception in the training code is not retried")
        if failure.kind is FailureKind.START_ERROR and self.failures > self.max_failures:
            return FailDecision(failure, "the workers could not be started")
        if self.failures > self.max_failures:
            return FailDecision(failure, f"failure budget exhausted "
                                         f"(failure.max_failures={self.max_failures})")
        return RetryDecision(failure, attempt=self.failures)
