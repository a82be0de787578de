"""The worker group's interface: what the controller asks of the run's workers.

The group answers questions with frozen views (what the pool holds, what a poll said, what
the memory tier holds) and carries out commands (start actors, pick and form a world,
restore, launch, stop, remove, disband). The controller hands the views to its policies,
which are pure, and carries out what they decide; nothing but the controller calls the group.

An abstract base class rather than a Protocol, so that every implementation (ElasticGroup on
Ray, the tests' fake group) breaks at once when a method changes. One group lives across
every generation of the world; a method that finds a worker failed raises the group's error
(the controller's `group_error`), which carries a WorkerFailure.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stalwart.checkpointing.memory.catalog import MemoryChoice
    from stalwart.checkpointing.memory.store import Inventory
    from stalwart.checkpointing.storage.catalog import CheckpointInfo
    from stalwart.core.config import FaultSpec
    from stalwart.core.events import WorkerPlace
    from stalwart.orchestrator.failures import WorkerFailure
    from stalwart.workers.reports import CommitReport, StepReport, WorkerStatus


@dataclass(frozen=True, kw_only=True)
class Disbanded:
    """What a world's members said as it ended (WorkerGroup.disband)."""

    survivor_steps: list[int]
    """Each survivor's engine step."""
    commits: list[CommitReport]
    """Rank 0's commits that no poll reported (a save that completed as the world ended)."""
    steps: list[StepReport]
    """Rank 0's steps after `after_step` that no poll brought to the controller: completed
    after the last poll, or in a poll's answer dropped as the world ended."""
    silent: list[int]
    """The pids of members that did not answer at all (stopped or dead), killed."""


@dataclass(frozen=True, kw_only=True)
class PoolView:
    """What the pool of actors holds now (WorkerGroup.pool_view)."""

    available: int
    """Warm actors: members and idle."""
    placed_starting: int
    """Actors Ray has placed that are still warming up (the rest wait for room)."""
    best_world: int
    """The largest valid world the warm actors can form (0: none)."""


@dataclass(frozen=True, kw_only=True)
class PollView:
    """What one poll said (WorkerGroup.poll)."""

    answered: Mapping[int, WorkerStatus]
    """Each answering rank's status."""
    dead: tuple[WorkerFailure, ...] = ()
    """The ranks found dead, stopped or on a silent node (kind HANG), a failure each."""
    lost_nodes: frozenset[str] = field(default_factory=frozenset)
    """Of the nodes under those ranks, the ones that are gone: the group's node health
    says so, and nothing else asks."""


class WorkerGroup(ABC):
    """The run's workers across generations (orchestrator/worker_group.py: ElasticGroup)."""

    driver_node_id: str
    """Ray's id of the driver's node (node 0 when faults are numbered by node)."""

    # -- the pool of actors
    @abstractmethod
    def top_up(self, *, spares: bool = True) -> None:
        """Ask Ray for actors up to scaling.ceiling, plus the warm spares unless `spares`
        is False (a recovery in progress: a spare's start would compete with it)."""

    @abstractmethod
    def refresh(self, timeout: float = 0.0) -> None:
        """Collect actors that finished warming up, waiting up to `timeout` seconds."""

    @abstractmethod
    def take_unhealthy(self) -> list[WorkerFailure]:
        """Workers dropped since the last call because their device failed its health check
        while warming up (a node failure each); each was killed and is never picked."""

    @abstractmethod
    def pool_view(self) -> PoolView:
        """What the pool holds now: warm actors, placed ones coming, the best world."""

    @abstractmethod
    def best_world(self) -> int:
        """The largest valid world the warm actors can form (0: none). Cheaper than
        pool_view, which asks Ray's GCS about every starting actor."""

    @abstractmethod
    def draining_nodes(self) -> frozenset[str]:
        """Ids of the nodes Ray is draining (preemption, autoscaler scale-down)."""

    # -- one generation of the world
    @abstractmethod
    def pick(self, world_size: int, generation: int) -> list[WorkerPlace]:
        """Choose a world's members (survivors first, then idle actors); returns where each
        runs (pid, node_ip, node_id, rank), in rank order. Nothing is asked of them yet."""

    @abstractmethod
    def form(self, armed: Mapping[int, Sequence[FaultSpec]]) -> None:
        """Set the picked members up as a world: a process group at rank 0's store, each
        rank armed with its faults (`armed`: rank -> faults)."""

    @abstractmethod
    def places(self) -> list[WorkerPlace]:
        """Where the current members run, in rank order: the world being formed as soon as
        `pick` chose it, so a failure while it forms names its processes."""

    @abstractmethod
    def restore(self, checkpoint: CheckpointInfo) -> int:
        """Load a storage checkpoint on every rank; returns its step. Each rank checks every
        file it reads against the manifest's table, which the driver verified. Raises
        CheckpointError when it fails to load on the ranks (each is then free to load
        another)."""

    @abstractmethod
    def memory_inventory(self) -> dict[str, Inventory]:
        """What each warm actor's memory tier holds."""

    @abstractmethod
    def restore_memory(self, choice: MemoryChoice) -> tuple[int, list[list[int]]]:
        """Load a step from the memory tier: (step, shards each rank fetched from peers)."""

    @abstractmethod
    def launch(self, *, restored: bool) -> None:
        """Start the training loops. `restored`: each rank first stages the restored step in
        this world (or, at step 0, drops older worlds' snapshots)."""

    @abstractmethod
    def settle(self) -> None:
        """The world trained its first step, so its restored step is on its holders: idle
        workers and the driver drop older worlds' snapshots."""

    @abstractmethod
    def poll(self, wait_s: float) -> PollView:
        """What the ranks answered, and the ranks found dead or stopped with the nodes of
        theirs that are gone. Blocks up to `wait_s`: it paces the controller's loop."""

    @abstractmethod
    def ack_faults(self, rank: int) -> None:
        """Tell a rank its fired faults were heard."""

    @abstractmethod
    def request_stop(self) -> None:
        """Every rank stops after the same step and checkpoints it."""

    @abstractmethod
    def remove(self, ranks: tuple[int, ...]) -> None:
        """Kill these ranks' actors."""

    @abstractmethod
    def exclude_nodes(self, node_ids: frozenset[str]) -> None:
        """Place no worker on these nodes again (faulty hardware): idle workers there go."""

    @abstractmethod
    def disband(self, after_step: int) -> Disbanded:
        """Survivors leave their world; what they say as they leave."""

    @abstractmethod
    def shutdown(self, *, graceful: bool) -> None:
        """End every actor (graceful: let them finish their checkpoints)."""
