"""bench/scale.py's real-Ray part: the driver's time per polling interval, per rank or per node.

As many light actors as this machine holds (num_cpus=0, on a Ray started with explicit
num_cpus), 8 to a "node". Two ways of polling, timed by one function that takes "how to poll
one node" as a parameter: every actor's `poll()` once per interval (what ElasticGroup does
today), or one call per node to an aggregator actor that polls its 8 members and returns
their answers. The aggregator is the bench's own for now; the production per-node agent
(workers/node_agent.py) can take its place through the same parameter.

An answer is a plain dict of a WorkerStatus's size (a rank, a generation, one step report):
the actors import neither stalwart nor torch, so a hundred of them fit in this machine.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

PER_NODE = 8


@ray.remote(num_cpus=0)
class LightWorker:
    """Answers polls as a training rank would: the steps it completed since the last one."""

    def __init__(self, rank: int) -> None:
        self.rank, self.step = rank, 0

    def poll(self) -> dict[str, Any]:
        self.step += 1
        return {"rank": self.rank, "generation": 0, "done": False, "commits": [],
                "steps": [{"rank": self.rank, "step": self.step, "loss": 1.0, "lr": 1e-3,
                           "tokens": 4096, "step_time_s": 0.5, "time": time.time(),
                           "local_s": 0.25}]}


@ray.remote(num_cpus=0)
class NodeAggregator:
    """One node's poller: polls its members and returns their answers in one reply."""

    def __init__(self, members: list[Any]) -> None:
        self.members = members

    def poll(self) -> list[dict[str, Any]]:
        return ray.get([m.poll.remote() for m in self.members])


@dataclass(frozen=True)
class Node:
    members: list[Any]
    """Its LightWorker handles."""
    aggregator: Any
    """Its NodeAggregator handle."""


PollNode = Callable[[Node], list[Any]]
"""How to poll one node: the object refs whose answers make its ranks' statuses."""


def per_rank(node: Node) -> list[Any]:
    return [m.poll.remote() for m in node.members]


def per_node(node: Node) -> list[Any]:
    return [node.aggregator.poll.remote()]


def time_polling(nodes: list[Node], poll_node: PollNode, *, intervals: int) -> dict[str, float]:
    """The driver's wall and CPU per polling interval: every node polled, every answer got."""
    for _ in range(3):  # warm-up: first calls set up the actors' connections
        ray.get([ref for n in nodes for ref in poll_node(n)])
    walls, cpus, answers = [], [], 0
    for _ in range(intervals):
        wall, cpu = time.perf_counter(), time.process_time()
        got = ray.get([ref for n in nodes for ref in poll_node(n)])
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
        answers = sum(len(g) if isinstance(g, list) else 1 for g in got)
    return {"answers_per_interval": answers,
            "driver_wall_ms": round(1000 * statistics.median(walls), 2),
            "driver_cpu_ms": round(1000 * statistics.median(cpus), 2)}


def ray_polling(actors: int, *, intervals: int = 30) -> dict[str, Any]:
    """Start a local Ray, `actors` light workers in nodes of 8, time both ways of polling."""
    nodes_n = max(1, actors // PER_NODE)
    actors = nodes_n * PER_NODE
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # bench/ is not on the workers' path
    t = time.perf_counter()
    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        workers = [LightWorker.remote(r) for r in range(actors)]
        nodes = [Node(members=workers[i:i + PER_NODE],
                      aggregator=NodeAggregator.remote(workers[i:i + PER_NODE]))
                 for i in range(0, actors, PER_NODE)]
        ray.get([w.poll.remote() for w in workers])  # every actor is up
        ray.get([n.aggregator.poll.remote() for n in nodes])
        started_s = time.perf_counter() - t
        print(f"ray: {actors} light actors and {nodes_n} aggregators up in {started_s:.0f}s",
              flush=True)
        out: dict[str, Any] = {"actors": actors, "nodes": nodes_n,
                               "start_s": round(started_s, 1)}
        for name, how in (("per_rank", per_rank), ("per_node", per_node)):
            out[name] = time_polling(nodes, how, intervals=intervals)
            print(f"ray: {name:<8}: {out[name]['driver_wall_ms']:.1f} ms wall, "
                  f"{out[name]['driver_cpu_ms']:.1f} ms driver CPU per interval "
                  f"({out[name]['answers_per_interval']} answers)", flush=True)
        return out
    finally:
        ray.shutdown()
