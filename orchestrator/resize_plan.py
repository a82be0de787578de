"""The planned resize under way while a world runs, which the controller carries out.

The scaling policy decides (grow, drain, preempted); this holds the decision until every
rank has stopped after the same step and checkpointed it, then records the `resized` event
when the next world forms. A failure meanwhile replaces the plan with a recovery.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from stalwart.core import events as ev
from stalwart.orchestrator.scaling import ResizeDecision, ScalingPolicy

if TYPE_CHECKING:
    from stalwart.core.run_logs import EventLog
    from stalwart.orchestrator.group import WorkerGroup
    from stalwart.orchestrator.observers import Display


class ResizePlan:
    def __init__(self, scaling: ScalingPolicy, group: WorkerGroup, events: EventLog,
                 display: Display) -> None:
        self.scaling, self.group, self.events, self.display = scaling, group, events, display
        self.decision: ResizeDecision | None = None  # waiting for every rank to stop

    def consider(self, now: float, *, world_size: int,
                 workers: Sequence[ev.WorkerPlace]) -> None:
        """Ask the policy (it checks every scaling.resize_check_s) unless a resize is planned."""
        if self.decision is not None:
            return
        decision = self.scaling.make_decision(now, world_size=world_size, workers=workers,
                                              room=self._room)
        if isinstance(decision, ResizeDecision):
            self._start(decision)

    def preempted(self, rank: int) -> None:
        """A rank got SIGTERM: it leaves, with any others already leaving."""
        decision = self.scaling.preempted(self.decision, rank)
        if self.decision is None:
            self._start(decision)
        self.decision = decision

    def cancel(self) -> None:
        self.decision = None

    def formed(self, *, old_world: int, old_layout: dict[str, int], new_world: int,
               new_layout: dict[str, int], step: int, generation: int) -> None:
        """A new world formed: a change of size is logged with its reason; the plan is done."""
        reason = self.scaling.resize_reason(old_world, new_world, self.decision)
        self.decision = None
        if reason is None:
            return
        self.events.emit(ev.Resized(old_world_size=old_world, new_world_size=new_world,
                                    old_layout=old_layout, new_layout=new_layout, reason=reason,
                                    step=step, generation=generation))
        self.display.log(f"world resized {old_world} -> {new_world} ({reason})")

    def _room(self) -> int:
        """Ask for actors up to the ceiling; the best world the warm ones make."""
        self.group.top_up()
        self.group.refresh()
        return self.group.best_world()

    def _start(self, decision: ResizeDecision) -> None:
        """Stop every rank after the same step, checkpoint it, then form a new world."""
        self.decision = decision
        self.display.log(decision.message)
        self.group.request_stop()
