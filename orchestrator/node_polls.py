"""NodePolls: the driver's side of the node agents (workers/node_agent.py).

One agent per node that holds ranks, started when a world first forms there (it warms up
while the world restores) and kept across worlds. The driver keeps one poll in flight per
node and acts on the first answer: an agent answers at once when it sees a process exit or
stop, so a death on a live node reaches the controller in tens of milliseconds, not at the
next poll. A rank whose collective failed is answered at once too; the driver then asks
whether the other nodes' raylets still accept connections, so a lost node is found in tens of
milliseconds, not when its agent's answer is late. Its other answers come when the interval
ends, which paces the loop.

Until a node's agent has answered once (its process may take seconds to start on a busy
node), the driver polls that node's ranks itself, one call per rank, as it would without
agents: no heartbeat waits for an agent.

When every rank is on the driver's own node (one machine, the common case), the driver
watches them itself: it runs the agent's poll in its own process, and no agent actor starts.

A node whose agent stops answering while the other nodes' agents answer is silent: frozen
(every process stopped), powered off or cut off. Its raylet may still accept connections
(a stopped process's socket does) and Ray's health check takes tens of seconds, so its
ranks are reported hung once the agent's answer is `silent_for_s` late
(failure.node_silent_timeout_s). The node stays silent until its agent answers again.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from stalwart.orchestrator import classify
from stalwart.workers.node_agent import NodeAgent, NodeReport, collect_polls

if TYPE_CHECKING:
    from stalwart.core.events import WorkerPlace
    from stalwart.orchestrator.failures import WorkerFailure
    from stalwart.orchestrator.node_health import NodeHealth
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
    asked_at: float = 0.0
    """time.monotonic() when its poll in flight was sent."""
    due_s: float = 0.0
    """That poll's interval: its answer is due at asked_at + due_s."""
    answered_at: float = 0.0
    """time.monotonic() when its last answer reached the driver."""
    seen_at: float = 0.0
    """time.time() of that answer: the last moment its node was known to be well."""

    @property
    def due_at(self) -> float:
        """time.monotonic() when its poll in flight should have been answered."""
        return self.asked_at + self.due_s


class NodePolls:
    # An agent answers when the interval ends; beyond this, its node is late.
    LATE_S = 0.5
    # After the first answer, the other nodes' answers of the same interval are gathered
    # for this long, so one interval is one pass of the controller.
    GATHER_S = 0.05

    def __init__(self, nodes: NodeHealth, *, stopped_for_s: float,
                 silent_for_s: float = 0.4) -> None:
        self.stopped_for_s = stopped_for_s  # failure.stopped_timeout_s
        self.silent_for_s = silent_for_s  # failure.node_silent_timeout_s
        # The group's node health: it says whether a node is up; the silent nodes found
        # here are kept in it (`nodes.silent`: node -> when its agent last answered).
        self.nodes = nodes
        self._agents: dict[str, _Agent] = {}
        self._actor_class = ray.remote(NodeAgent)
        # The driver's own node, and the agent that runs here for it.
        self._here = ray.get_runtime_context().get_node_id()
        self._local: NodeAgent | None = None
        self._local_broken = False
        # Ranks polled directly (their agent is not up yet): each one's poll in flight.
        self._direct: dict[int, Any] = {}

    def start(self, node_ids: set[str]) -> None:
        """Start an agent on each of these nodes that has none. The driver's node alone needs
        none: the driver watches its ranks itself."""
        if self._watched_here(node_ids):
            return
        for node_id in node_ids - self._agents.keys():
            options: dict[str, Any] = dict(
                num_cpus=0, max_restarts=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
            self._agents[node_id] = _Agent(
                actor=self._actor_class.options(**options).remote(self.stopped_for_s))

    def poll(self, members: list[tuple[Any, WorkerPlace]], generation: int, wait_s: float
             ) -> tuple[dict[int, WorkerStatus], list[WorkerFailure]]:
        """Statuses of the ranks that answered, and the ranks found dead or stopped, from the
        nodes that answered within `wait_s` (sooner when one sees a process exit or stop)."""
        by_node: dict[str, dict[int, tuple[Any, int]]] = {}
        for rank, (actor, place) in enumerate(members):
            by_node.setdefault(place.node_id, {})[rank] = (actor, place.pid)
        if self._watched_here(set(by_node)):
            self._look_at_silent()
            return self._poll_here(by_node[self._here], generation, wait_s)
        self.start(set(by_node))
        self._look_at_silent()
        for node_id, ranks in by_node.items():
            agent = self._agents[node_id]
            if agent.ref is None and not agent.broken:
                agent.ref = agent.actor.poll.remote(
                    generation, wait_s, ranks if agent.told != generation else None)
                agent.told, agent.asked_at, agent.due_s = generation, time.monotonic(), wait_s
            if not agent.ready:
                for rank, (actor, _) in ranks.items():
                    if rank not in self._direct:
                        self._direct[rank] = actor.poll.remote(generation)
        asked = {self._agents[n].ref: n for n in by_node
                 if self._agents[n].ref is not None and n not in self.nodes.silent}
        refs = list(asked)
        if any(self._agents[n].ready for n in by_node):
            # Wake when an agent's answer becomes late enough to make its node silent.
            timeout = min(wait_s + self.LATE_S, self._until_silent({n: self._agents[n]
                                                                    for n in by_node}))
            if not refs:  # every node with ranks is silent: their hangs are reported
                time.sleep(wait_s)
            ready, rest = ray.wait(refs, num_returns=1, timeout=timeout) if refs else ([], [])
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
            agent.ready, agent.answered_at, agent.seen_at = True, time.monotonic(), time.time()
            for rank, status in report.statuses.items():
                answered[rank] = merge(answered[rank], status) if rank in answered else status
            found += _failures(report, by_node[node_id])
        found += self._silent_ranks(by_node)
        self._collect_direct(answered, found, generation)
        if any(st.error_kind == "collective" for st in answered.values()):
            found += self._lost_peers(by_node)
        return answered, found

    def _lost_peers(self, by_node: dict[str, dict[int, tuple[Any, int]]]
                    ) -> list[WorkerFailure]:
        """A rank's collective failed: a peer, or its whole node, may be gone. A lost
        node's raylet refuses connections at once, while its agent's poll fails only when
        it is due (or Ray notices, seconds later): ask now."""
        others = set(by_node) - {self._here} - set(self.nodes.silent)
        lost = self.nodes.lost(others) if others else frozenset()
        return [f for node_id in sorted(lost) for f in self._agent_lost(node_id, by_node[node_id])]

    def _watched_here(self, node_ids: set[str]) -> bool:
        """These nodes' ranks are watched by the driver itself: the driver's node alone."""
        return node_ids == {self._here} and not self._local_broken

    def _poll_here(self, ranks: dict[int, tuple[Any, int]], generation: int, wait_s: float
                   ) -> tuple[dict[int, WorkerStatus], list[WorkerFailure]]:
        """Every rank is on the driver's node: the agent's poll, run in this process."""
        if self._local is None:
            self._local = NodeAgent(self.stopped_for_s)
        try:
            report = self._local.poll(generation, wait_s, ranks)
        except Exception as exc:  # a bug in the agent: an agent actor takes over
            print(f"stalwart: watching this node's ranks failed ({exc}); a node agent "
                  f"polls them from now on", file=sys.stderr, flush=True)
            self._local_broken = True
            return {}, []
        return dict(report.statuses), _failures(report, ranks)

    def _until_silent(self, agents: dict[str, _Agent]) -> float:
        """Seconds until the next agent in flight would be late enough to be silent."""
        now = time.monotonic()
        waits = [a.due_at + self.silent_for_s - now for a in agents.values()
                 if a.ready and a.ref is not None]
        waits = [w for w in waits if w > 0]  # those late already do not shorten the wait
        return min(waits, default=float("inf")) + 0.01

    def _silent_ranks(self, by_node: dict[str, dict[int, tuple[Any, int]]]
                      ) -> list[WorkerFailure]:
        """Hangs for the ranks of nodes that have just gone silent."""
        agents = {n: self._agents[n] for n in by_node if n not in self.nodes.silent}
        found = []
        now = time.time()
        for node_id, late_s in silent_nodes(agents, time.monotonic(),
                                            self.silent_for_s).items():
            if not self.nodes.alive({node_id}):  # its raylet is gone too: a lost node
                found += self._agent_lost(node_id, by_node[node_id])
                continue
            agent = self._agents[node_id]
            self.nodes.silent[node_id] = agent.seen_at
            found += [classify.node_silent(rank, pid, node_id, late_s, agent.seen_at, now)
                      for rank, (_, pid) in by_node[node_id].items()]
        return found

    def _look_at_silent(self) -> None:
        """A silent node whose agent has answered at last is well again; one whose agent
        died is gone (Ray says so, in time)."""
        for node_id in list(self.nodes.silent):
            agent = self._agents.get(node_id)
            if agent is None or agent.ref is None:
                del self.nodes.silent[node_id]
                continue
            if not ray.wait([agent.ref], timeout=0)[0]:
                continue
            del self.nodes.silent[node_id]
            try:
                ray.get(agent.ref)
                agent.ref, agent.answered_at, agent.seen_at = None, time.monotonic(), time.time()
            except Exception:
                del self._agents[node_id]  # started again if its node holds ranks again

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
        self._agents.pop(node_id, None)
        if self.nodes.alive({node_id}):
            return []
        now = time.time()
        return [classify.node_gone(rank, node_id, now) for rank in ranks]

    def forget(self) -> None:
        """A world ended: answers still in flight are about it, and are dropped (a silent
        node's is kept: when it comes, the node is well again)."""
        for node_id, agent in self._agents.items():
            if node_id not in self.nodes.silent:
                agent.ref = None
        self._direct = {}

    def shutdown(self) -> None:
        for agent in self._agents.values():
            ray.kill(agent.actor, no_restart=True)
        self._agents = {}
        if self._local is not None:
            self._local.close()
            self._local = None


def silent_nodes(agents: dict[str, _Agent], now: float, silent_for_s: float
                 ) -> dict[str, float]:
    """Nodes whose agent's answer is more than `silent_for_s` late (`now` is monotonic),
    with how late, when another of these agents has answered since that answer was due: the
    driver hears from the cluster, so the lateness is the node's own."""
    out = {}
    for node_id, agent in agents.items():
        if not agent.ready or agent.ref is None:
            continue
        due = agent.due_at
        if now - due <= silent_for_s:
            continue
        if any(other.answered_at > due for n, other in agents.items() if n != node_id):
            out[node_id] = now - due
    return out


def _died(errors: dict[int, str], now: float) -> list[WorkerFailure]:
    """Ranks whose poll failed with Ray's error."""
    return [classify.poll_failed(rank, message, now) for rank, message in errors.items()]


def _failures(report: NodeReport, ranks: dict[int, tuple[Any, int]]) -> list[WorkerFailure]:
    now = time.time()
    out = _died({r: m for r, m in report.errors.items() if r not in report.exited}, now)
    out += [classify.process_exited(rank, ranks[rank][1], alive_at, now)
            for rank, alive_at in report.exited.items()]
    out += [classify.process_stopped(rank, ranks[rank][1], since, now)
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
