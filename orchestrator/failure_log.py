"""Failures as the controller records them: the policy's decision on each, written as a
`failure` event with the ranks, nodes and pids it hit and how long detection took.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from stalwart.core import events as ev
from stalwart.orchestrator.failures import (
    FailDecision,
    FailureKind,
    FailurePolicy,
    RetryDecision,
    WorkerFailure,
)

if TYPE_CHECKING:
    from stalwart.core.run_logs import EventLog


class FailureLog:
    def __init__(self, policy: FailurePolicy, events: EventLog) -> None:
        self.policy, self.events = policy, events

    def decide(self, failure: WorkerFailure, *, workers: Sequence[ev.WorkerPlace],
               members: Sequence[ev.WorkerPlace], step: int) -> RetryDecision | FailDecision:
        """The policy's decision on a failure at `step` of the world `workers`, logged.
        `members`: where the group's members run now, the forming world's included."""
        decision = self.policy.make_decision(failure)
        detection = (None if failure.last_seen is None else
                     round(max(0.0, failure.detected_at - failure.last_seen), 3))
        # Ranks are looked up among the group's members, not `workers`: a world that failed
        # while forming never became the running world, and its ranks are not the last's.
        failed = ([p for p in workers if p.pid in failure.pids] if failure.pids else
                  [p for p in members if p.rank in failure.failed_ranks])
        # A worker that never joined a world (its device failed its check) has no place in
        # one: the failure names its node and pid itself.
        pids = [p.pid for p in failed] or list(failure.pids)
        # A user error's message is its one-line summary, then the task's traceback.
        message, traceback = failure.message, ""
        if failure.kind is FailureKind.USER_ERROR:
            message, _, traceback = failure.message.partition("\n")
        self.events.emit(ev.Failure(failure_kind=failure.kind.value, rank=failure.rank,
                         ranks=list(failure.failed_ranks),
                         nodes=sorted({p.node_ip for p in failed} | set(failure.nodes)),
                         pids=pids,
                         message=message, traceback=traceback, step=step,
                         retry=not isinstance(decision, FailDecision),
                         detection_s=detection, attempt=self.policy.failures))
        return decision
