"""The scaling policy: how big a world to form, when to give up waiting, when to resize.

Decisions are plain data (Ray Train v2's `ScalingPolicy -> NoopDecision | ResizeDecision`);
the controller carries them out. Between worlds the policy answers form / wait / give up
from a view of the pool; while a world runs it answers no-op or a planned resize: grow (the
cluster has room), drain (Ray is draining a node under some ranks) or preempted (ranks got
SIGTERM). To know whether there is room to grow, it asks the controller to ask the cluster
for actors (NeedRoomDecision) and decides on the pool they make. A planned resize stops
every rank after the same step, checkpoints it and forms the next world.

The policy is pure: it is given views and times, never the group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stalwart.core.config import ScalingConfig
    from stalwart.core.events import WorkerPlace
    from stalwart.orchestrator.group import PoolView


@dataclass(frozen=True, kw_only=True)
class NoopDecision:
    """Keep the world as it is."""


@dataclass(frozen=True, kw_only=True)
class ResizeDecision:
    """Stop every rank after the same step, checkpoint it, then form a new world."""

    reason: str
    """grow, preempted (SIGTERM) or drain (Ray is draining a node)."""
    leaving: tuple[int, ...] = ()
    """Ranks that must go."""

    @property
    def message(self) -> str:
        what = f"rank(s) {list(self.leaving)} leaving" if self.leaving else "room for more workers"
        return f"planned resize ({self.reason}, {what}): checkpointing the next step"


@dataclass(frozen=True, kw_only=True)
class NeedRoomDecision:
    """Ask the cluster for actors up to scaling.ceiling, then grow if the warm ones make a
    world larger than `world_size` (ScalingPolicy.grow decides, given the pool)."""

    world_size: int


@dataclass(frozen=True, kw_only=True)
class FormDecision:
    """Form a world of this size now."""

    world_size: int


@dataclass(frozen=True, kw_only=True)
class WaitDecision:
    """Not enough warm workers yet: wait for more."""


@dataclass(frozen=True, kw_only=True)
class GiveUpDecision:
    """Waited too long for enough workers: the run fails."""

    reason: str


class ScalingPolicy:
    """Back to the size the run had (or scaling.num_workers), never below scaling.floor."""

    def __init__(self, scaling: ScalingConfig, *, storage_url: str) -> None:
        self.scaling = scaling
        self.storage_url = storage_url
        self._next_check = 0.0

    # ------------------------------------------------------------------ between worlds

    def target(self, world_size: int) -> int:
        """The world size to wait for: the size the run had, or scaling.num_workers."""
        return max(world_size or self.scaling.num_workers, self.scaling.floor)

    def schedule(self, pool: PoolView, *, generation: int, world_size: int,
                 waited: float) -> FormDecision | WaitDecision | GiveUpDecision:
        """Whether the warm workers make a world big enough, or the wait is over."""
        sc = self.scaling
        best = pool.best_world
        # At the start, workers Ray has placed are coming (the rest wait for room that may
        # never come): the first world waits for them. After a failure the warm survivors
        # train on at once, smaller: a new actor's cold start (a Ray worker, torch's import,
        # the task) takes seconds to tens of seconds, while a shrink now and a planned grow
        # once it is warm (scaling.resize_check_s) cost a step's restore each.
        coming = pool.placed_starting > 0 and waited <= sc.start_timeout_s
        if best >= self.target(world_size) or (best >= sc.floor and (
                generation > 0 or not coming)):
            return FormDecision(world_size=best)
        key = "start_timeout_s" if generation == 0 else "wait_for_workers_s"
        limit = getattr(sc, key)
        if waited <= limit:
            return WaitDecision()
        floor = (f"scaling.min_workers={sc.min_workers}" if sc.min_workers else
                 f"scaling.num_workers={sc.num_workers} (no scaling.min_workers set)")
        return GiveUpDecision(reason=(
            f"only {pool.available} workers could be started, {floor} are needed; "
            f"waited {waited:.1f}s (scaling.{key}={limit:g}); checkpoints are intact "
            f"under {self.storage_url}"))

    @staticmethod
    def resize_reason(old_world: int, new_world: int, planned: ResizeDecision | None
                      ) -> str | None:
        """Why the world changed size at a rendezvous (None: it did not)."""
        if not old_world or (old_world == new_world and planned is None):
            return None
        if planned is not None:
            return planned.reason
        return "shrink" if new_world < old_world else "grow"

    # ------------------------------------------------------------------ while a world runs

    def world_started(self, now: float) -> None:
        """A world launched: its first resize check is one interval away."""
        self._next_check = now + self.scaling.resize_check_s

    def checkpoint_committed(self) -> None:
        """A checkpoint boundary: look for room at the next check."""
        self._next_check = 0.0

    def resize_due(self, now: float) -> bool:
        """Whether a resize check is due: every scaling.resize_check_s, and at once after a
        commit (the cluster is asked about draining nodes only then)."""
        return now >= self._next_check

    def make_decision(self, now: float, *, world_size: int, workers: Sequence[WorkerPlace],
                      draining: frozenset[str]
                      ) -> NoopDecision | ResizeDecision | NeedRoomDecision:
        """Every scaling.resize_check_s: ranks on a node being drained (`draining`: node
        ids) leave; else, below the ceiling, look for room to grow."""
        if not self.resize_due(now):
            return NoopDecision()
        self._next_check = now + self.scaling.resize_check_s
        leaving = tuple(r for r, w in enumerate(workers) if w.node_id in draining)
        if leaving:
            return ResizeDecision(reason="drain", leaving=leaving)
        if world_size < self.scaling.ceiling:
            return NeedRoomDecision(world_size=world_size)
        return NoopDecision()

    @staticmethod
    def grow(pool: PoolView, *, world_size: int) -> NoopDecision | ResizeDecision:
        """After a NeedRoomDecision: grow when the warm actors make a larger world."""
        if pool.best_world > world_size:
            return ResizeDecision(reason="grow")
        return NoopDecision()

    @staticmethod
    def preempted(planned: ResizeDecision | None, rank: int) -> ResizeDecision:
        """Every preempted rank leaves, also one preempted during another planned resize."""
        if planned is None:
            return ResizeDecision(reason="preempted", leaving=(rank,))
        if rank in planned.leaving:
            return planned
        return ResizeDecision(reason="preempted", leaving=(*planned.leaving, rank))
