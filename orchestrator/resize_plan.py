"""The planned resize under way while a world runs, which the controller carries out.

The scaling policy decides (grow, drain, preempted); this holds the decision until every
rank has stopped after the same step and checkpointed it, then records the `resized` event
when the next world forms. A failure meanwhile replaces the plan with a recovery.

It never acts on the group: it returns what the controller must do. A plan that starts is
returned (the controller asks every rank to stop after the step in flight); a look for room
to grow is returned as a NeedRoomDecision (the controller asks the cluster for actors and
hands the pool they make to `room`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from stalwart.core import events as ev
from stalwart.orchestrator.scaling import (
    NeedRoomDecision,
    NoopDecision,
    ResizeDecision,
    ScalingPolicy,
)

if TYPE_CHECKING:
    from stalwart.core.run_logs import EventLog
    from stalwart.orchestrator.group import PoolView
    from stalwart.orchestrator.observers import Display


class ResizePlan:
    def __init__(self, scaling: ScalingPolicy, events: EventLog, display: Display) -> None:
        self.scaling, self.events, self.display = scaling, events, display
        self.decision: ResizeDecision | None = None  # waiting for every rank to stop

    def due(self, now: float) -> bool:
        """Whether to look now: no resize is planned, and the policy's check is due."""
        return self.decision is None and self.scaling.resize_due(now)

    def consider(self, now: float, *, world_size: int, workers: Sequence[ev.WorkerPlace],
                 draining: frozenset[str]) -> NoopDecision | ResizeDecision | NeedRoomDecision:
        """The policy's decision at a check that is due (`draining`: the nodes Ray drains);
        a ResizeDecision returned has started."""
        decision = self.scaling.make_decision(now, world_size=world_size, workers=workers,
                                              draining=draining)
        if isinstance(decision, ResizeDecision):
            self._start(decision)
        return decision

    def room(self, pool: PoolView, *, world_size: int) -> NoopDecision | ResizeDecision:
        """After a NeedRoomDecision, the pool the cluster's new actors make: grow or not. A
        ResizeDecision returned has started."""
        decision = self.scaling.grow(pool, world_size=world_size)
        if isinstance(decision, ResizeDecision):
            self._start(decision)
        return decision

    def preempted(self, rank: int) -> ResizeDecision | None:
        """A rank got SIGTERM: it leaves, with any others already leaving. Returns the plan
        when it starts now (None: one was under way, and goes on with this rank too)."""
        decision = self.scaling.preempted(self.decision, rank)
        started = self.decision is None
        if started:
            self._start(decision)
        self.decision = decision
        return decision if started else None

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

    def _start(self, decision: ResizeDecision) -> None:
        """The plan starts: every rank is to stop after the same step and checkpoint it."""
        self.decision = decision
        self.display.log(decision.message)
