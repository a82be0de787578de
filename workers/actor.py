"""TrainWorker: the Ray actor of one rank, a shell around a Worker (workers/worker.py).

Ray imports an actor's class in every process that deserializes a handle to it: each node's
agent, which polls the ranks, and the driver. This module imports neither torch nor the
engine, so a handle costs those processes nothing; the Worker and everything it needs are
imported in the rank's own process, when the actor is built. Each method forwards to the
Worker's method of the same name and signature (tests/unit/test_actor_shell.py checks it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stalwart.checkpointing.memory.store import Inventory
    from stalwart.checkpointing.snapshot import ShardLayout
    from stalwart.checkpointing.storage.signing import CheckpointTrust
    from stalwart.core.config import FaultSpec
    from stalwart.core.events import WorkerPlace
    from stalwart.core.task import TaskLike
    from stalwart.parallel.distributed import RendezvousAddress
    from stalwart.workers.reports import LeaveReport, MemoryRestoreReport, WorkerStatus


class TrainWorker:
    def __init__(self, config: dict[str, Any], storage_url: str, number: int = 0, *,
                 driver_beacon: Any = None, task: TaskLike | bytes | None = None,
                 import_paths: Sequence[str] = ()) -> None:
        from stalwart.workers.worker import Worker

        self.worker = Worker(config, storage_url, number, driver_beacon=driver_beacon,
                             task=task, import_paths=import_paths)

    def __repr__(self) -> str:
        """Ray shows the Worker's name (its log prefix, the dashboard's Repr)."""
        return repr(self.worker)

    def warm_up(self) -> WorkerPlace:
        return self.worker.warm_up()

    def rendezvous_address(self) -> RendezvousAddress:
        return self.worker.rendezvous_address()

    def describe(self) -> WorkerPlace:
        return self.worker.describe()

    def setup(self, rank: int, world_size: int, rdzv: RendezvousAddress, generation: int,
              faults: Sequence[FaultSpec], nodes: list[str], *,
              signing: CheckpointTrust | None) -> None:
        self.worker.setup(rank, world_size, rdzv, generation, faults, nodes, signing=signing)

    def restore(self, path: str, files: dict[str, Any]) -> int:
        return self.worker.restore(path, files)

    def restore_memory(self, generation: int, step: int, layouts: dict[int, ShardLayout],
                       sources: dict[int, Any]) -> MemoryRestoreReport:
        return self.worker.restore_memory(generation, step, layouts, sources)

    def memory_inventory(self) -> Inventory:
        return self.worker.memory_inventory()

    def export_snapshot(self, generation: int, source: int, step: int
                        ) -> tuple[Any, Any, int | None]:
        return self.worker.export_snapshot(generation, source, step)

    def forget_snapshots(self, before_generation: int) -> None:
        self.worker.forget_snapshots(before_generation)

    def start(self, *, restored: bool = False) -> None:
        self.worker.start(restored=restored)

    def ack_faults(self) -> None:
        self.worker.ack_faults()

    def request_stop(self) -> None:
        self.worker.request_stop()

    def poll(self, generation: int | None = None) -> WorkerStatus:
        return self.worker.poll(generation)

    def leave(self, timeout_s: float, after_step: int | None = None) -> LeaveReport:
        return self.worker.leave(timeout_s, after_step)

    def shutdown(self) -> None:
        self.worker.shutdown()
