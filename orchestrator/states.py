"""Controller states: small classes that carry their data, and the one table of transitions.

    SCHEDULING -> RENDEZVOUS -> RESTORING -> RUNNING -> FINISHED
        ^                                      |  \\-> STOPPED   (user asked; step checkpointed)
        |                                      |--> RESIZING    (planned: grow, preemption)
        |                                      v
        +---- RECOVERING <---------- (any live state)            or -> FAILED
        +---- RESIZING

Every change goes through `check_transition`, so a transition the table does not list is a
bug that surfaces at once rather than a run in a state nobody designed for.
"""

from __future__ import annotations

from dataclasses import dataclass

from stalwart.checkpointing.memory.catalog import MemoryChoice
from stalwart.checkpointing.storage.catalog import CheckpointInfo
from stalwart.orchestrator.errors import InvalidTransition
from stalwart.orchestrator.failures import WorkerFailure


@dataclass(frozen=True)
class State:
    @property
    def name(self) -> str:
        return type(self).__name__.upper()

    @property
    def terminal(self) -> bool:
        return not TRANSITIONS[type(self)]


@dataclass(frozen=True)
class Scheduling(State):
    generation: int
    """Counts worlds: 0 for the first, +1 for each recovery or resize."""
    since: float = 0.0
    """time.time() when the wait for workers began."""


@dataclass(frozen=True)
class Rendezvous(State):
    generation: int
    world_size: int


@dataclass(frozen=True)
class Restoring(State):
    generation: int
    checkpoint: CheckpointInfo | None
    """The storage checkpoint to load (or to fall back on); None: freshly initialised."""
    memory: MemoryChoice | None = None
    """The in-memory snapshot to load instead, when it is at least as new as `checkpoint`."""


@dataclass(frozen=True)
class Running(State):
    generation: int
    start_step: int


@dataclass(frozen=True)
class Recovering(State):
    generation: int
    failure: WorkerFailure


@dataclass(frozen=True)
class Resizing(State):
    """A planned change of world: every rank stopped after the same step and checkpointed it."""

    generation: int
    reason: str
    """grow, preempted (SIGTERM) or drain (Ray is draining a node)."""
    leaving: tuple[int, ...] = ()
    """Ranks that must go (their node is being preempted)."""


@dataclass(frozen=True)
class Finished(State):
    step: int


@dataclass(frozen=True)
class Stopped(State):
    step: int
    """The last completed step, which was checkpointed before stopping."""


@dataclass(frozen=True)
class Failed(State):
    reason: str


TRANSITIONS: dict[type[State], frozenset[type[State]]] = {
    Scheduling: frozenset({Rendezvous, Recovering, Stopped, Failed}),
    Rendezvous: frozenset({Restoring, Recovering, Failed}),
    Restoring: frozenset({Running, Recovering, Failed}),
    Running: frozenset({Finished, Stopped, Recovering, Resizing, Failed}),
    Recovering: frozenset({Scheduling, Failed}),
    Resizing: frozenset({Scheduling, Recovering, Failed}),
    Finished: frozenset(),
    Stopped: frozenset(),
    Failed: frozenset(),
}


def check_transition(old: State, new: State) -> None:
    if type(new) not in TRANSITIONS[type(old)]:
        raise InvalidTransition(f"controller transition {old.name} -> {new.name} is not allowed; "
                                f"from {old.name}: "
                                f"{sorted(t.__name__.upper() for t in TRANSITIONS[type(old)])}")
