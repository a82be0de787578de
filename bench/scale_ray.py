"""bench/scale.py's real-Ray part: the driver's time per polling interval, three ways."""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from stalwart.workers.node_agent import NodeAgent, NodeReport
from stalwart.workers.reports import StepReport, WorkerStatus

PER_NODE = 8
GENERATION = 0
# The agent's wait per poll (production: 0.5 s) sets that way's wall, not its cost; with 0 a
# busy machine's answers slip to the next report, 50 ms gets them in.
AGENT_WAIT_S = 0.05


@ray.remote(num_cpus=0)
class LightWorker:
    """Answers polls as a training rank would: the steps it completed since the last one."""

    def __init__(self, rank: int) -> None:
        self.rank, self.step = rank, 0

    def pid(self) -> int:
        return os.getpid()  # the process the node agent watches

    def poll(self, generation: int) -> WorkerStatus:
        self.step += 1
        return WorkerStatus(
            rank=self.rank, generation=generation, commits=[], done=False,
            steps=[StepReport(rank=self.rank, step=self.step, loss=1.0, lr=1e-3, tokens=4096,
                              step_time_s=0.5, time=time.time(), local_s=0.25)])


@ray.remote(num_cpus=0)
class NodeAggregator:
    """One node's poller: polls its members and returns their answers in one reply."""

    def __init__(self, members: list[Any]) -> None:
        self.members = members

    def poll(self) -> list[WorkerStatus]:
        return ray.get([m.poll.remote(GENERATION) for m in self.members])


@dataclass(frozen=True)
class Node:
    members: list[Any]  # LightWorker handles
    aggregator: Any
    agent: Any  # a NodeAgent, already sent its members (ray_polling)


# How to poll one node: the object refs whose answers make its ranks' statuses. The agent is
# sent no members: it has this generation's, as after NodePolls' first poll.
WAYS: dict[str, Callable[[Node], list[Any]]] = {
    "per_rank": lambda node: [m.poll.remote(GENERATION) for m in node.members],
    "per_node": lambda node: [node.aggregator.poll.remote()],
    "per_node_agent": lambda node: [node.agent.poll.remote(GENERATION, AGENT_WAIT_S)],
}


def answers(reply: Any) -> int:
    """The ranks' statuses in one reply: a rank's own, an aggregator's list, an agent's report."""
    if isinstance(reply, NodeReport):
        return len(reply.statuses)
    return len(reply) if isinstance(reply, list) else 1


def time_polling(nodes: list[Node], poll_node: Callable[[Node], list[Any]], *,
                 intervals: int) -> dict[str, float]:
    """The driver's wall and CPU per polling interval: every node polled, every answer got."""
    for _ in range(3):  # warm-up: first calls set up the actors' connections
        ray.get([ref for n in nodes for ref in poll_node(n)])
    walls, cpus, counts = [], [], []
    for _ in range(intervals):
        wall, cpu = time.perf_counter(), time.process_time()
        got = ray.get([ref for n in nodes for ref in poll_node(n)])
        cpus.append(time.process_time() - cpu)
        walls.append(time.perf_counter() - wall)
        counts.append(sum(answers(g) for g in got))
    # An agent may answer before a member has: that answer goes into its next report, and
    # this interval counts one fewer.
    return {"answers_per_interval": round(statistics.median(counts)), "answers_min": min(counts),
            "driver_wall_ms": round(1000 * statistics.median(walls), 2),
            "driver_cpu_ms": round(1000 * statistics.median(cpus), 2)}


def ray_polling(actors: int, *, intervals: int = 30) -> dict[str, Any]:
    """Start a local Ray, `actors` light workers in nodes of 8, time the three ways of polling."""
    nodes_n = max(1, actors // PER_NODE)
    actors = nodes_n * PER_NODE
    # The actors travel by value: a worker need not have the repository on its path.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    t = time.perf_counter()
    ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        workers = [LightWorker.remote(r) for r in range(actors)]
        pids = ray.get([w.pid.remote() for w in workers])  # every actor is up
        agent_class = ray.remote(NodeAgent).options(num_cpus=0)
        nodes = [Node(members=workers[i:i + PER_NODE],
                      aggregator=NodeAggregator.remote(workers[i:i + PER_NODE]),
                      agent=agent_class.remote()) for i in range(0, actors, PER_NODE)]
        ray.get([n.aggregator.poll.remote() for n in nodes])
        # The generation's first poll sends each agent its members, rank -> (actor, pid).
        ray.get([n.agent.poll.remote(GENERATION, AGENT_WAIT_S,
                                     {r: (workers[r], pids[r])
                                      for r in range(k * PER_NODE, (k + 1) * PER_NODE)})
                 for k, n in enumerate(nodes)])
        started_s = time.perf_counter() - t
        print(f"ray: {actors} light actors, {nodes_n} aggregators and {nodes_n} node agents "
              f"up in {started_s:.0f}s", flush=True)
        out: dict[str, Any] = {"actors": actors, "nodes": nodes_n, "start_s": round(started_s, 1),
                               "agent_wait_ms": round(1000 * AGENT_WAIT_S)}
        for name, how in WAYS.items():
            out[name] = r = time_polling(nodes, how, intervals=intervals)
            waited = (f" ({out['agent_wait_ms']} ms of it the agent's wait)"
                      if name == "per_node_agent" else "")
            print(f"ray: {name:<14}: {r['driver_cpu_ms']:.1f} ms driver CPU, "
                  f"{r['driver_wall_ms']:.1f} ms wall{waited} per interval "
                  f"({r['answers_per_interval']} answers, fewest {r['answers_min']})", flush=True)
        return out
    finally:
        ray.shutdown()
