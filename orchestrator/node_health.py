"""Whether the run's nodes are up (and which Ray drains): the one place that asks. The worker
group owns it.

A node is up when its raylet accepts a connection and its agent has not gone silent (a
frozen raylet's socket still accepts one: orchestrator/node_polls.py decides silence). It
is asked when workers die, and a lost node's ranks are told from a lost worker's by it: Ray's
GCS takes seconds to declare a node dead, while a raylet that is gone refuses connections at
once. The group reports what it found to the controller as data (a poll's `lost_nodes`);
nothing else probes.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

import ray

from stalwart.core import ray_private


class NodeHealth:
    # How long a raylet may take to accept a connection before its node counts as gone.
    CONNECT_TIMEOUT_S = 1.0

    def __init__(self) -> None:
        self.silent: dict[str, float] = {}
        """Nodes whose agent went silent, and when it last answered (time.time()); kept
        by the node polls until the agent answers again."""

    def draining(self) -> frozenset[str]:
        """The nodes Ray is draining (preemption, autoscaler scale-down): up, but leaving."""
        return frozenset(ray_private.draining_nodes())

    def up_with_cpus(self) -> set[str]:
        """The nodes Ray has alive with CPUs: those that can hold a worker."""
        return {n["NodeID"] for n in ray.nodes()
                if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0}

    def alive(self, node_ids: Iterable[str]) -> bool:
        """Whether every one of these nodes is up."""
        node_ids = set(node_ids)
        return not (node_ids & self.silent.keys()) and not self.lost(node_ids)

    def lost(self, node_ids: Iterable[str]) -> frozenset[str]:
        """Those of these nodes that are not up: silent, dead to Ray, or refusing connections."""
        node_ids = set(node_ids)
        if not node_ids:
            return frozenset()
        lost = node_ids & self.silent.keys()
        nodes = {n["NodeID"]: n for n in ray.nodes()}
        for node_id in sorted(node_ids - lost):
            node = nodes.get(node_id)
            if node is None or not node.get("Alive") or not _accepts(node):
                lost.add(node_id)
        return frozenset(lost)


def _accepts(node: dict) -> bool:
    """Whether the node's raylet accepts a connection."""
    try:
        socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]),
                                 timeout=NodeHealth.CONNECT_TIMEOUT_S).close()
    except OSError:
        return False
    return True
