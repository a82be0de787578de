"""The controller's side of fault injection, in one place: arm, hear, acknowledge, date.

At each world's forming the plan (orchestrator/faults.py) arms the ranks that must carry out
a fault; a fault that fired is logged as `fault_injected`, acknowledged to its rank and never
armed again; its time dates the failure it causes (detection latency).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stalwart.core import events as ev
from stalwart.orchestrator.faults import FaultPlan
from stalwart.orchestrator.observers import ControllerObserver

if TYPE_CHECKING:
    from stalwart.core.config import FaultSpec, JobConfig
    from stalwart.core.events import WorkerPlace
    from stalwart.core.run_logs import EventLog
    from stalwart.orchestrator.group import WorkerGroup
    from stalwart.workers.reports import WorkerStatus


class FaultWatch(ControllerObserver):
    def __init__(self, config: JobConfig, events: EventLog, group: WorkerGroup) -> None:
        self.plan = FaultPlan(config.faults)
        self.events = events
        self.group = group
        self._fault_times: dict[int, float] = {}  # rank -> when an injected fault hit it

    def arm(self, workers: list[WorkerPlace]) -> dict[int, list[FaultSpec]]:
        """What each rank of a forming world must carry out (group.form's `arm`)."""
        armed, unresolved = self.plan.arm(workers, self.group.driver_node_id)
        for message in unresolved:
            self.events.emit(ev.FaultSkipped(message=message))
        return armed

    def after_launch(self, generation: int, world_size: int, now: float) -> None:
        self._fault_times = {}  # ranks are renumbered: an old fault dates nothing new

    def on_status(self, rank: int, status: WorkerStatus, now: float) -> None:
        for fired in status.faults:
            self.plan.fired(fired.fault)
            self._fault_times[fired.rank] = now  # the fault happens when it is acknowledged
            self.events.emit(ev.FaultInjected(fault=str(fired.fault), rank=fired.rank,
                             step=fired.step))
        if status.faults:
            self.group.ack_faults(rank)

    def fired_at(self, ranks: tuple[int, ...]) -> float | None:
        """When an injected fault hit one of these ranks (the latest), if one did."""
        times = [self._fault_times[r] for r in ranks if r in self._fault_times]
        return max(times) if times else None
