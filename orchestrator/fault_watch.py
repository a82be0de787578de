"""The controller's side of fault injection, in one place: arm, hear, date.

Before a picked world forms, the plan (orchestrator/faults.py) arms the ranks that must carry
out a fault; a fault that fired is logged as `fault_injected` and never armed again (the
controller acknowledges it to its rank); its time dates the failure it causes (detection
latency).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from stalwart.core import events as ev
from stalwart.orchestrator.faults import FaultPlan
from stalwart.orchestrator.observers import ControllerObserver

if TYPE_CHECKING:
    from stalwart.core.config import FaultSpec, JobConfig
    from stalwart.core.events import WorkerPlace
    from stalwart.core.run_logs import EventLog
    from stalwart.workers.reports import WorkerStatus


class FaultWatch(ControllerObserver):
    def __init__(self, config: JobConfig, events: EventLog) -> None:
        self.plan = FaultPlan(config.faults)
        self.events = events
        self._fault_times: dict[int, float] = {}  # rank -> when an injected fault hit it

    def arm(self, workers: Sequence[WorkerPlace], driver_node_id: str
            ) -> dict[int, list[FaultSpec]]:
        """What each rank of a picked world must carry out; a fault with no target in it is
        logged as `fault_skipped` (it stays pending for a later world)."""
        armed, unresolved = self.plan.arm(workers, driver_node_id)
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

    def fault_times(self) -> Mapping[int, float]:
        """Rank -> when an injected fault hit it in this world (a read-only copy)."""
        return MappingProxyType(dict(self._fault_times))
