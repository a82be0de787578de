"""What went wrong, and what to do about it: failures and the failure policy's decisions.

Decisions are plain data (Ray Train v2's shape): the policy decides, the controller acts.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class FailureKind(StrEnum):
    WORKER_DIED = "worker_died"
    """The actor's process is gone (Ray actor error)."""
    NODE_DIED = "node_died"
    """The node under the actor is gone (Ray marked it dead, or its raylet vanished), or its
    GPU failed the health check a worker runs before it can join a world."""
    HANG = "hang"
    """No heartbeat for longer than the hang limit (stopped process, stuck collective...)."""
    USER_ERROR = "user_error"
    """An exception raised by the task's code on a worker."""
    COLLECTIVE_ERROR = "collective_error"
    """A collective failed or timed out with no dead or silent rank to blame."""
    START_ERROR = "start_error"
    """Workers could not be placed, joined or set up."""
    STRAGGLER = "straggler"
    """A rank stayed slower than its peers (failure.replace_stragglers)."""
    FAULTY_DEVICE = "faulty_device"
    """A rank's state differed from its replicas numerics.evict_after times: it is replaced,
    and no worker is placed on its node again."""
    NUMERICS = "numerics"
    """A numerical fault the world could not mend in place (numerics.max_skips spent, or no
    snapshot to roll back to): not retried."""


@dataclass(frozen=True)
class WorkerFailure:
    kind: FailureKind
    rank: int | None
    """The rank to blame first (None: the group as a whole)."""
    message: str
    """One line for humans; for USER_ERROR that line (where, the task's phase, the error),
    then the traceback trimmed to the task's frames (stalwart.core.task_errors)."""
    detected_at: float
    """time.time() when the controller noticed."""
    ranks: tuple[int, ...] = ()
    """Every rank that must be replaced (dead, silent or on a lost node)."""
    last_seen: float | None = None
    """time.time() of the last sign of life before the failure (heartbeat or injected fault):
    detected_at - last_seen bounds the detection latency."""
    pids: tuple[int, ...] = ()
    """The failed ranks' processes, when the detector knows them (a silent survivor)."""
    nodes: tuple[str, ...] = ()
    """IPs of the nodes hit, when no rank of a world names them (a worker that never
    joined one)."""

    @property
    def failed_ranks(self) -> tuple[int, ...]:
        if self.ranks:
            return self.ranks
        return () if self.rank is None else (self.rank,)


@dataclass(frozen=True)
class RetryDecision:
    failure: WorkerFailure
    attempt: int
    """1 for the first recovery."""
    delay_s: float
    """Backoff to wait before recovering."""


@dataclass(frozen=True)
class FailDecision:
    failure: WorkerFailure
    reason: str


class FailurePolicy:
    """Recover in place while the budget lasts, backing off when failures come back to back.

    An exception raised by the task's code is not retried unless configured (it would most
    likely fail the same way again) and ends the run at once.
    """

    MAX_DELAY_S = 60.0

    def __init__(self, max_failures: int, *, retry_user_errors: bool = False,
                 backoff_s: float = 0.0) -> None:
        self.max_failures = max_failures
        self.retry_user_errors = retry_user_errors
        self.backoff_s = backoff_s
        self.failures = 0
        self.consecutive = 0
        self.history: list[WorkerFailure] = []

    def made_progress(self) -> None:
        """A step completed after the last recovery: the next failure starts a new streak."""
        self.consecutive = 0

    def make_decision(self, failure: WorkerFailure) -> RetryDecision | FailDecision:
        self.failures += 1
        self.consecutive += 1
        self.history.append(failure)
        if failure.kind is FailureKind.NUMERICS:
            return FailDecision(failure, "a numerical fault the checks could not mend "
                                         "([numerics])")
        if failure.kind is FailureKind.USER_ERROR and not self.retry_user_errors:
            return FailDecision(failure, "an exception in the training code is not retried "
                                         "(failure.retry_user_errors=false)")
        if self.max_failures >= 0 and self.failures > self.max_failures:
            kinds = ", ".join(f.kind.value for f in self.history)
            return FailDecision(failure, f"failure budget exhausted "
                                         f"(failure.max_failures={self.max_failures}; "
                                         f"failures: {kinds})")
        delay = 0.0
        if self.backoff_s > 0:
            # The exponent is capped first: 2 ** 1024 overflows a float on a long streak.
            delay = min(self.MAX_DELAY_S, self.backoff_s * 2.0 ** min(self.consecutive - 1, 64))
        return RetryDecision(failure, attempt=self.failures, delay_s=delay)
