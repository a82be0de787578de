"""What watches the controller: a typed observer interface with no-op hooks.

The controller decides; observers keep accounts and report (orchestrator/accounting.py,
orchestrator/reporting.py, orchestrator/detection.py, orchestrator/fault_watch.py). Each hook
is called at one point of a transition or of a poll, in the order the observers were given,
so the events they write keep one order. Hooks return nothing; the controller asks the
few observers it needs an answer from (failure detector, straggler reporter) directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from stalwart.core.events import WorkerPlace
    from stalwart.orchestrator.failures import WorkerFailure
    from stalwart.orchestrator.states import Running, State
    from stalwart.workers.reports import StepReport, WorkerStatus


class Display(Protocol):
    """Progress for humans (stalwart/progress.py)."""

    def update(self, report: StepReport, tokens_per_s: float | None) -> None: ...
    def log(self, message: str) -> None: ...


@dataclass(frozen=True, kw_only=True)
class Restored:
    """What a new world restored, handed to `after_restore`."""

    generation: int
    world_size: int
    start_step: int
    source: str
    """memory, storage or none."""
    peer_fetches: int
    """Shards the memory restore fetched from peers."""
    last_step: int
    """The newest step the run had reported before this restore."""


class ControllerObserver:
    """Hooks, in the order a run calls them; each does nothing unless overridden."""

    def before_form(self, generation: int, now: float) -> None:
        """Warm workers are enough: the world is about to form."""

    def after_form(self, generation: int, workers: list[WorkerPlace], now: float) -> None:
        """The world formed (workers: pid, node_ip, node_id, rank, in rank order)."""

    def after_restore(self, restored: Restored, now: float) -> None:
        """The world restored its state; its training loops are not launched yet."""

    def after_launch(self, generation: int, world_size: int, now: float) -> None:
        """The world's training loops started: per-world accounts start afresh."""

    def on_status(self, rank: int, status: WorkerStatus, now: float) -> None:
        """A rank answered a poll (before its commits and steps are taken in)."""

    def on_step(self, report: StepReport) -> None:
        """A step completed (rank 0's report: the loss is the global mean)."""

    def on_commit(self, step: int) -> None:
        """Rank 0 reported storage checkpoints committed, the newest at `step` (in a poll,
        before that poll's steps are taken in; as a world ends, after them)."""

    def after_poll(self, state: Running, last_step: int, now: float) -> None:
        """Every answering rank of a poll was taken in."""

    def before_recovery(self, failure: WorkerFailure) -> None:
        """Recovery from `failure` begins: failed ranks are about to be removed."""

    def after_recovery_teardown(self, survivor_steps: list[int], now: float) -> None:
        """The survivors left their world (survivor_steps: their engine steps)."""

    def on_end(self, state: State) -> None:
        """The run ended in `state`: a terminal one, or the state it was in when an
        exception (a second Ctrl-C, Tune stopping a trial) ended it. The workers are gone."""
