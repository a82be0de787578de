"""Which rank carries out each injected fault in a generation of the world.

Faults are given by rank or by node (config.FaultSpec). Each fires once per run: a fault
the controller has heard fire is never armed again, even when the steps before it are
trained again after a restore. Nodes are numbered as the run sees them when the generation
forms: 0 is the driver's node, then the other nodes in the order of their lowest rank. A
node fault is carried out by the lowest rank on that node.
"""

from __future__ import annotations

from collections.abc import Sequence

from stalwart.core.config import FaultKind, FaultSpec
from stalwart.core.events import WorkerPlace


def number_nodes(workers: Sequence[WorkerPlace], driver_node_id: str) -> dict[str, int]:
    """node_id -> node number, for workers in rank order."""
    numbers = {driver_node_id: 0}
    for w in workers:
        numbers.setdefault(w.node_id, len(numbers))
    return numbers


class FaultPlan:
    """The run's faults not yet fired, and which rank carries out each in a world."""

    def __init__(self, faults: Sequence[FaultSpec]) -> None:
        self.pending = list(faults)

    def fired(self, fault: FaultSpec) -> None:
        """The controller heard `fault` fire (once or more): it is never armed again."""
        self.pending = [f for f in self.pending if f != fault]

    def arm(self, workers: Sequence[WorkerPlace], driver_node_id: str
            ) -> tuple[dict[int, list[FaultSpec]], list[str]]:
        """(rank -> its faults, messages for faults with no target in this world)."""
        nodes = number_nodes(workers, driver_node_id)
        lowest_rank: dict[int, int] = {}
        for rank, w in enumerate(workers):
            lowest_rank.setdefault(nodes[w.node_id], rank)
        armed: dict[int, list[FaultSpec]] = {}
        unresolved = []
        for f in self.pending:
            if FaultKind(f.kind).target == "rank":
                rank = f.rank if f.rank < len(workers) else None
                where = f"the world has {len(workers)} ranks"
            else:
                rank = lowest_rank.get(f.node)
                where = (f"the workers are on node(s) "
                         f"{sorted(set(lowest_rank)) or 'none'} (node 0: the driver's)")
            if rank is None:
                unresolved.append(f"fault {f} has no target now: {where}")
                continue
            armed.setdefault(rank, []).append(f)
        return armed, unresolved
