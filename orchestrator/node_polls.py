"""NodePolls: the driver's side of the node agents (workers/node_agent.py).

One agent per node that holds ranks, started when a world first forms there (it warms up
while the world restores) and kept across worlds. The driver keeps one poll in flight per
node and acts on the first answer: an agent answers at once when it sees a process exit or
stop, so a death on a live node reaches the controller in tens of milliseconds, not at the
next poll. Its other answers come when the interval ends, which paces the loop.

Until a node's agent has answered once (its process may take seconds to start on a busy
node), the driver polls that node's ranks itself, one call per rank, as it would without
agents: no heartbeat waits for an agent.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.workers.node_agent import NodeAgent, NodeReport, collect_polls

if TYPE_CHECKING:
    from stalwart.events import WorkerPlace
    from stalwart.workers.reports import WorkerStatus


@dataclass
class _Agent:
    actor: Any
    ref: Any = None
    """Its poll in flight: an agent that has not answered is not asked again."""
    told: int = -1
    """The generation whose ranks it was last sent."""
    ready: bool = False
    """It has answered: its node's ranks are polled through it alone."""
    broken: bool = False
    """Its poll raised: its node's ranks are polled directly for the rest of the run."""


class NodePolls:
    # An agent answers when the interval ends; beyond this, its node is late.
    LATE_S = 0.5
    # After the first answer, the other nodes' answers of the same interval are gathered
    # for this long, so one interval is one pass of the controller.
    GATHER_S = 0.05

    def __init__(self, runtime_env: dict[str, Any] | None,
                 nodes_alive: Callable[[set[str]], bool], *, stopped_for_s: float) -> None:
        self.runtime_env = runtime_env
        self.stopped_for_s = stopped_for_s  # failure.stopped_timeout_s
        self.nodes_alive = nodes_alive
        self._agents: dict[str, _Agent] = {}
        self._actor_class = ray.remote(NodeAgent)
        # Ranks polled directly (their agent is not up yet): each one's poll in flight.
        self._direct: dict[int, Any] = {}

    def start(self, node_ids: set[str]) -> None:
        """Start an agent on each of these nodes that has none."""
        for node_id in node_ids - self._agents.keys():
            options: dict[str, Any] = dict(
                num_cpus=0, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
            if self.runtime_env:
                options["runtime_env"] = self.runtime_env
            self._agents[node_id] = _Agent(
                actor=self._actor_class.options(**options).remote(self.stopped_for_s))

    def poll(self, members: list[tuple[Any, WorkerPlace]], generation: int, wait_s: float
             ) -> tuple[dict[int, WorkerStatus], list[WorkerFailure]]:
        """Statuses of the ranks that answered, and the ranks found dead or stopped, from the
        nodes that answered within `wait_s` (sooner when one sees a process exit or stop)."""
        by_node: dict[str, dict[int, tuple[Any, int]]] = {}
        for rank, (actor, place) in enumerate(members):
            by_node.setdefault(place.node_id, {})[rank] = (actor, place.pid)
        self.start(set(by_node))
        for node_id, ranks in by_node.items():
            agent = self._agents[node_id]
            if agent.ref is None and not agent.broken:
                agent.ref = agent.actor.poll.remote(
                    generation, wait_s, ranks if agent.told != generation else None)
                agent.told = generation
            if not agent.ready:
                for rank, (actor, _) in ranks.items():
                    if rank not in self._direct:
                        self._direct[rank] = actor.poll.remote(generation)
        asked = {self._agents[n].ref: n for n in by_node if self._agents[n].ref is not None}
        refs = list(asked)
        if any(self._agents[n].ready for n in by_node):
            ready, rest = ray.wait(refs, num_returns=1, timeout=wait_s + self.LATE_S)
            if ready and rest:
                ready += ray.wait(rest, num_returns=len(rest), timeout=self.GATHER_S)[0]
        else:  # no agent up yet: the direct polls are paced here
            time.sleep(wait_s)
            ready = ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else []
        answered: dict[int, WorkerStatus] = {}
        found: list[WorkerFailure] = []
        for ref in ready:
            node_id = asked[ref]
            agent = self._agents[node_id]
            agent.ref = None
            try:
                report: NodeReport = ray.get(ref)
            except RayActorError:
                found += self._agent_lost(node_id, by_node[node_id])
                continue
            except Exception as exc:  # a bug in the agent: poll that node's ranks directly
                print(f"stalwart: the node agent on {node_id} failed ({exc}); its ranks are "
                      f"polled directly from now on", file=sys.stderr, flush=True)
                agent.broken, agent.ready = True, False
                continue
            agent.ready = True
            for rank, status in report.statuses.items():
                answered[rank] = merge(answered[rank], status) if rank in answered else status
            found += _failures(report, by_node[node_id])
        self._collect_direct(answered, found, generation)
        return answered, found

    def _collect_direct(self, answered: dict[int, WorkerStatus], found: list[WorkerFailure],
                        generation: int) -> None:
        """The direct polls that have answered (a failed one: the rank died)."""
        statuses, errors = collect_polls(self._direct, generation, timeout=self.GATHER_S)
        for rank, status in statuses.items():
            answered[rank] = merge(answered[rank], status) if rank in answered else status
        found += _died(errors, time.time())

    def _agent_lost(self, node_id: str, ranks: dict[int, tuple[Any, int]]
                    ) -> list[WorkerFailure]:
        """An agent died: with its node (every rank there is lost), or alone (it is started
        again at the next poll and its ranks are none the worse)."""
        del self._agents[node_id]
        if self.nodes_alive({node_id}):
            return []
        now = time.time()
        return [WorkerFailure(kind=FailureKind.WORKER_DIED, rank=rank, ranks=(rank,),
                              message=f"worker rank {rank} died: its node {node_id} is gone",
                              detected_at=now) for rank in ranks]

    def forget(self) -> None:
        """A world ended: answers still in flight are about it, and are dropped."""
        for agent in self._agents.values():
            agent.ref = None
        self._direct = {}

    def shutdown(self) -> None:
        for agent in self._agents.values():
            ray.kill(agent.actor, no_restart=True)
        self._agents = {}


def _died(errors: dict[int, str], now: float) -> list[WorkerFailure]:
    """Ranks whose poll failed with Ray's error."""
    return [WorkerFailure(kind=FailureKind.WORKER_DIED, rank=rank, ranks=(rank,),
                          message=message, detected_at=now) for rank, message in errors.items()]


def _failures(report: NodeReport, ranks: dict[int, tuple[Any, int]]) -> list[WorkerFailure]:
    now = time.time()
    out = _died({r: m for r, m in report.errors.items() if r not in report.exited}, now)
    out += [WorkerFailure(kind=FailureKind.WORKER_DIED, rank=rank, ranks=(rank,),
                          message=f"worker rank {rank} (pid {ranks[rank][1]}) exited",
                          detected_at=now, last_seen=alive_at, pids=(ranks[rank][1],))
            for rank, alive_at in report.exited.items()]
    out += [WorkerFailure(kind=FailureKind.HANG, rank=rank, ranks=(rank,),
                          message=f"worker rank {rank} (pid {ranks[rank][1]}) is stopped "
                                  f"(SIGSTOP or a frozen process) since "
                                  f"{now - since:.2f}s: it cannot take part in its world",
                          detected_at=now, last_seen=since, pids=(ranks[rank][1],))
            for rank, since in report.stopped.items()]
    return out


def merge(a: WorkerStatus, b: WorkerStatus) -> WorkerStatus:
    """One rank's two answers of one pass (its own poll and its agent's, while the agent
    starts): each drained part of its reports, so both parts are kept, in step order."""
    return replace(
        a, steps=sorted([*a.steps, *b.steps], key=lambda r: r.step),
        commits=sorted([*a.commits, *b.commits], key=lambda c: c.step),
        faults=[*a.faults, *b.faults], profiles=[*a.profiles, *b.profiles],
        done=a.done or b.done, stopped_early=a.stopped_early or b.stopped_early,
        error=a.error or b.error, error_kind=a.error_kind or b.error_kind,
        preempted=a.preempted or b.preempted,
        snapshot_bytes=max(a.snapshot_bytes, b.snapshot_bytes),
        tier_limit=a.tier_limit or b.tier_limit, busy=a.busy and b.busy)
