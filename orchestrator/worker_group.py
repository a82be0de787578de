"""ElasticGroup: the run's worker actors, across every generation of the world.

The controller sees a small interface (orchestrator/group.py: views of the pool and of a
poll; top_up, refresh, pick, form, restore, launch, request_stop, remove, disband, shutdown),
so it can be tested step by step with a fake group. Actors are placed one at a time, not as one placement group: a world that loses a
node must keep the rest and shrink, and an actor that cannot be placed yet (its node is
gone) simply waits in Ray's queue until the cluster has room again: that is how a run grows
back. Actors are in one of three pools:

  starting  created, warming up (importing the task, preparing data) or waiting for room
  idle      warm and ready to join a world: warm spares, survivors between generations
  members   the ranks of the current world, in rank order

Every method turns Ray's errors into a WorkerFailure naming the rank, rather than letting
them escape.
"""

from __future__ import annotations

import heapq
import os
import signal
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray import cloudpickle
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.memory.catalog import MemoryChoice
from stalwart.checkpointing.memory.store import Inventory
from stalwart.checkpointing.storage.catalog import CheckpointInfo
from stalwart.checkpointing.storage.signing import CheckpointTrust
from stalwart.core.config import FaultSpec, JobConfig
from stalwart.core.events import WorkerPlace
from stalwart.core.ray_private import actor_row
from stalwart.core.task import TaskLike
from stalwart.orchestrator import classify
from stalwart.orchestrator.driver_loss import run_namespace, start_beacon
from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.orchestrator.group import Disbanded, PollView, PoolView, WorkerGroup
from stalwart.orchestrator.node_health import NodeHealth
from stalwart.orchestrator.node_polls import NodePolls
from stalwart.workers.actor import TrainWorker
from stalwart.workers.reports import (
    LeaveReport,
    MemoryRestoreReport,
    StepReport,
)

# The label Ray gives every node: its id (what a label selector can keep workers off).
NODE_ID_LABEL = "ray.io/node-id"


class GroupFailed(Exception):
    def __init__(self, failure: WorkerFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


@dataclass
class Worker:
    key: str
    """The actor's name: names the worker in memory-tier inventories."""
    actor: Any
    warm: Any
    """ObjectRef of warm_up(): ready when the actor can join a world."""
    place: WorkerPlace | None = None
    """Where it runs (its pid, node_ip, node_id), once warm."""


@ray.remote(num_cpus=0, max_retries=0)
def _sigkill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _failure_from(exc: BaseException, rank: int | None, default: FailureKind) -> WorkerFailure:
    """A call to `rank` raised `exc`: a death when Ray says the actor died, else `default`."""
    now = time.time()
    if isinstance(exc, RayActorError):
        return classify.actor_died(rank, str(exc), now)
    if isinstance(exc, RayTaskError):
        return classify.call_failed(rank, str(exc.cause if exc.cause else exc), now,
                                    kind=default)
    return classify.call_failed(rank, f"{type(exc).__name__}: {exc}", now, kind=default)


def _error_of(ref: Any) -> BaseException | None:
    """The exception a finished call raised, None if it returned."""
    try:
        ray.get(ref, timeout=0)
    except Exception as exc:
        return exc
    return None


def _answers(refs: list[Any], *, timeout: float) -> list[Any]:
    """Each call's result, or None for one that failed or did not answer within `timeout`."""
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout)[0])
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref) if ref in ready else None)
        except Exception:
            out.append(None)
    return out


def spread_first(taken: Sequence[str], idle: Sequence[Worker],
                 node_of: Callable[[Worker], str]) -> list[Worker]:
    """`idle` in the order that spreads a world over the most nodes: each next worker from the
    node that holds the fewest of the world so far (`taken`: the survivors' nodes), ties to
    the node whose first worker warmed first; one node's workers keep their warm order.

    Ray's SPREAD places actors one at a time and only as far as it can: with more workers
    than nodes (the spares count), some node holds two. The ranks are taken from idle in this
    order, so the spares are the workers left on the nodes that hold the most."""
    by_node: dict[str, deque[Worker]] = {}
    for w in idle:
        by_node.setdefault(node_of(w), deque()).append(w)
    counts = Counter(taken)
    heap = [(counts[node], i, node) for i, node in enumerate(by_node)]
    heapq.heapify(heap)
    order: list[Worker] = []
    while heap:
        count, first, node = heapq.heappop(heap)
        workers = by_node[node]
        order.append(workers.popleft())
        if workers:
            heapq.heappush(heap, (count + 1, first, node))
    return order


def task_name(rank: int, generation: int) -> str:
    return f"stalwart-worker-r{rank}-g{generation}"


class ElasticGroup(WorkerGroup):
    # How long a survivor may take to unwind its training thread and leave its world.
    LEAVE_TIMEOUT_S = 10.0

    def __init__(self, config: JobConfig, storage_url: str, *, trust: CheckpointTrust,
                 import_paths: Sequence[str] = (),
                 outlive_driver: bool = False, task: TaskLike | None = None) -> None:
        """`trust`: the checkpoint key and what a load accepts, handed to rank 0 of each
        world as it forms (the key is never written to storage or the run dir). `import_paths`:
        put on each worker's sys.path before it imports the task. `outlive_driver`:
        detached workers that commit the step in flight if this driver is killed
        (workers/driver_watch.py); for a cluster that outlives the driver. `task`: a task
        class or instance handed to the Trainer, shipped to every worker by value (pickled
        here, so a worker loads it once `import_paths` can find its modules)."""
        self.config = config
        self.storage_url = storage_url
        self.trust = trust
        self.import_paths = list(import_paths)
        self.task = None if task is None else cloudpickle.dumps(task)
        self.driver_node_id = ray.get_runtime_context().get_node_id()
        self.members: list[Worker] = []
        self.idle: list[Worker] = []
        self.starting: list[Worker] = []
        self.generation = -1
        # Nodes no worker may be placed on (a device found faulty there).
        self.excluded: set[str] = set()
        # Workers dropped as their device failed its health check, until the controller asks.
        self.unhealthy: list[WorkerFailure] = []
        # Snapshots rescued from survivors that could not leave their world (killed since):
        # key -> (their inventory, ObjectRefs of every snapshot they held, owned here).
        self.rescued: dict[str, tuple[Inventory, dict[tuple[int, int, int], Any]]] = {}
        self._created = 0
        self._config_dict = config.to_dict()
        self._actor_class = ray.remote(TrainWorker)
        # The beacon of a driver whose workers outlive it (orchestrator/driver_loss.py).
        self._beacon = start_beacon(trust.run_id, self.driver_node_id) if outlive_driver else None
        self.nodes = NodeHealth()  # the one place that asks whether a node is up
        self.polls = NodePolls(self.nodes,
                               stopped_for_s=config.failure.stopped_timeout_s,
                               silent_for_s=config.failure.node_silent_timeout_s)
        # Agents first, on every node that can hold a worker: each starts (half a second of
        # imports) while the workers import torch, and answers from a world's first steps.
        self.polls.start(self.nodes.up_with_cpus())

    # ------------------------------------------------------------------ the pool

    def top_up(self, *, spares: bool = True) -> None:
        """Ask Ray for actors until there are enough for the largest world, plus the spares
        unless `spares` is False."""
        sc = self.config.scaling
        want = sc.ceiling + (sc.spare_workers if spares else 0)
        while len(self.members) + len(self.idle) + len(self.starting) < want:
            self.starting.append(self._create())

    def _create(self) -> Worker:
        sc = self.config.scaling
        self._created += 1
        name = f"stalwart-worker-{self._created}-{os.getpid()}"
        options: dict[str, Any] = dict(
            num_cpus=sc.cpus_per_worker, num_gpus=sc.gpus_per_worker, max_restarts=0,
            name=name,
            scheduling_strategy="SPREAD" if sc.placement_strategy == "SPREAD" else "DEFAULT",
        )
        if self.excluded:  # every node carries its id as the label ray.io/node-id
            options["label_selector"] = {NODE_ID_LABEL: f"!in({','.join(sorted(self.excluded))})"}
        if self._beacon is not None:  # found again by the run's next driver
            options.update(lifetime="detached", namespace=run_namespace(self.trust.run_id))
        actor = self._actor_class.options(**options).remote(
            self._config_dict, self.storage_url, self._created, driver_beacon=self._beacon, task=self.task, import_paths=self.import_paths)
        return Worker(key=name, actor=actor, warm=actor.warm_up.remote())

    def refresh(self, timeout: float = 0.0) -> None:
        """Move actors that finished warming up to the idle pool; drop those that died."""
        if not self.starting:
            return
        refs = [w.warm for w in self.starting]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        done_set = set(done)
        still = []
        for w in self.starting:
            if w.warm not in done_set:
                still.append(w)
                continue
            try:
                w.place = ray.get(w.warm)
                if w.place.node_id in self.excluded:  # asked for before the exclusion
                    self._kill(w)
                    continue
                self.idle.append(w)
                self.polls.start({w.place.node_id})  # warm before a world runs there
            except RayActorError:
                pass  # its node went away while it started; top_up asks for another
            except RayTaskError as exc:
                self._kill(w)
                failure = classify.warm_up_failed(exc.cause if exc.cause else exc, time.time())
                if failure.kind is FailureKind.NODE_DIED:  # its GPU failed the health check
                    self.unhealthy.append(failure)
                    continue
                # The task cannot load on this worker: not transient.
                self.starting = [s for s in self.starting if s is not w]
                raise GroupFailed(failure) from exc
        self.starting = still

    def take_unhealthy(self) -> list[WorkerFailure]:
        found, self.unhealthy = self.unhealthy, []
        return found

    def pool_view(self) -> PoolView:
        return PoolView(available=self.available(), placed_starting=self.placed_starting(),
                        best_world=self.best_world())

    def draining_nodes(self) -> frozenset[str]:
        return self.nodes.draining()

    def placed_starting(self) -> int:
        """Starting actors that Ray has placed on a live node (the rest wait for room)."""
        # The GCS actor table is the only way to tell an actor that is starting from one that
        # waits for room, without the dashboard's state API.
        placed = 0
        for w in self.starting:
            try:
                row = actor_row(w.actor)
            except Exception:
                placed += 1  # cannot tell: assume it is coming
                continue
            # A worker process is leased to the actor once Ray has found it room.
            if int(row.get("Pid") or 0) > 0:
                # Placed just before its node died (Ray notices seconds after us): it is
                # not coming; Ray reports it dead soon and top_up asks for another.
                node = (row.get("Address") or {}).get("NodeID")
                placed += not node or self.nodes.alive({node})
        return placed

    def available(self) -> int:
        return len(self.members) + len(self.idle)

    def best_world(self) -> int:
        """The largest valid world size the warm actors can make (0 if none)."""
        return self.config.largest_world(min(self.config.scaling.ceiling, self.available()))

    # ------------------------------------------------------------------ one generation

    def pick(self, world_size: int, generation: int) -> list[WorkerPlace]:
        """Choose a world of `world_size` ranks: survivors keep their order, then idle actors
        (under SPREAD, those on the nodes the world has least of first). Returns where each
        member runs, in rank order."""
        idle = self.idle
        if self.config.scaling.placement_strategy == "SPREAD":
            idle = spread_first([self._place(w).node_id for w in self.members], idle,
                                lambda w: self._place(w).node_id)
        pool = self.members + idle
        self.members, self.idle = pool[:world_size], pool[world_size:]
        self.generation = generation
        return self.places()

    def form(self, armed: Mapping[int, Sequence[FaultSpec]]) -> None:
        """Set the picked members up as a world at rank 0's store; `armed` holds the faults
        each rank must inject in this generation."""
        timeout = self.config.scaling.start_timeout_s
        (rdzv,) = self._get([self.members[0].actor.rendezvous_address.remote()],
                            timeout=timeout)
        nodes = [self._place(w).node_id for w in self.members]
        world_size, generation = len(self.members), self.generation
        # Named by rank and generation: the Ray Dashboard's task list tells which actor is
        # which rank of which world (an actor's own name and repr are fixed at its creation).
        # Only rank 0 gets the key: it signs the commits. The others load with the file
        # table the driver verified (restore) and never sign.
        self._get([w.actor.setup.options(name=f"{task_name(rank, generation)}.setup").remote(
                       rank, world_size, rdzv, generation, tuple(armed.get(rank, ())), nodes,
                       signing=self.trust if rank == 0 else None)
                   for rank, w in enumerate(self.members)], timeout=timeout)

    def places(self) -> list[WorkerPlace]:
        return [replace(self._place(w), rank=r) for r, w in enumerate(self.members)]

    @staticmethod
    def _place(w: Worker) -> WorkerPlace:
        assert w.place is not None, f"{w.key} is not warm: it cannot join a world"
        return w.place

    def restore(self, checkpoint: CheckpointInfo) -> int:
        files = checkpoint.manifest["files"]
        refs = [w.actor.restore.remote(checkpoint.path, files) for w in self.members]
        try:
            steps = self._get(refs)
        except GroupFailed as exc:
            cause = getattr(exc.__cause__, "cause", exc.__cause__)  # RayTaskError's cause
            if not isinstance(cause, CheckpointError):
                raise
            # DCP's load is collective and fails on every rank together; once every rank
            # is done with this attempt, the world can load another checkpoint. A rank
            # still busy (or gone) means the world itself is broken.
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.LEAVE_TIMEOUT_S)
            if len(ready) < len(refs) or any(
                    not isinstance(getattr(e, "cause", e), CheckpointError)
                    for e in map(_error_of, refs) if e is not None):
                raise
            raise CheckpointError(str(cause)) from None
        return steps[0]

    # ------------------------------------------------------------------ the memory tier

    def memory_inventory(self) -> dict[str, Inventory]:
        """What each live warm worker holds in memory (workers that do not answer hold
        nothing usable)."""
        pool = self.members + self.idle
        answers = _answers([w.actor.memory_inventory.remote() for w in pool],
                           timeout=self.LEAVE_TIMEOUT_S)
        out = {key: inventory for key, (inventory, _) in self.rescued.items()}
        out.update({w.key: inv for w, inv in zip(pool, answers, strict=True) if inv is not None})
        return out

    def restore_memory(self, choice: MemoryChoice) -> tuple[int, list[list[int]]]:
        """Every member loads `choice` from the memory tier, resharded to this world.

        One holder of each source shard exports it to Ray's object store (owned by the
        driver, so it outlives the holder); members read only the shards they do not hold.
        Returns the step and, per rank, the source ranks it fetched from peers.
        """
        by_key = {w.key: w for w in self.members + self.idle}
        member_keys = {w.key for w in self.members}
        sources = {}
        for src, keys in choice.holders.items():
            snapshot = (choice.generation, src, choice.step)
            rescued = [self.rescued[k][1][snapshot] for k in keys if k in self.rescued]
            live = [by_key[k] for k in keys if k in by_key]
            if live:
                # Prefer a holder outside the world: its actor is idle, the export runs now.
                holder = next((w for w in live if w.key not in member_keys), live[0])
                sources[src] = holder.actor.export_snapshot.remote(*snapshot)
            elif rescued:
                sources[src] = rescued[0]
            else:
                raise GroupFailed(classify.start_error(
                    f"no live holder of rank {src}'s snapshot", time.time()))
        out: list[MemoryRestoreReport] = self._get(
            [w.actor.restore_memory.remote(choice.generation, choice.step, choice.layouts,
                                           sources)
             for w in self.members], kind=FailureKind.COLLECTIVE_ERROR)
        return out[0].step, [list(o.fetched) for o in out]

    def launch(self, *, restored: bool) -> None:
        self._get([w.actor.start.options(name=f"{task_name(r, self.generation)}.train").remote(
                   restored=restored) for r, w in enumerate(self.members)])

    def settle(self) -> None:
        """Idle workers forget older generations' snapshots (each member dropped its own
        after the first step); so does the driver's store of exports rescued from leavers."""
        self.rescued = {}
        for w in self.idle:
            w.actor.forget_snapshots.remote(self.generation)

    def poll(self, wait_s: float) -> PollView:
        """Statuses of the ranks that answered, and the ranks found dead or stopped: one
        call per node, answered within `wait_s` or as soon as a node sees a process exit or
        stop (orchestrator/node_polls.py). The nodes under the ranks found are looked at
        here, once: which of them are gone."""
        places = [self._place(w) for w in self.members]
        answered, dead = self.polls.poll(
            [(w.actor, p) for w, p in zip(self.members, places, strict=True)],
            self.generation, wait_s)
        nodes = {places[r].node_id for f in dead for r in f.failed_ranks if r < len(places)}
        return PollView(answered=answered, dead=tuple(dead), lost_nodes=self.nodes.lost(nodes))

    def ack_faults(self, rank: int) -> None:
        self.members[rank].actor.ack_faults.remote()

    def request_stop(self) -> None:
        for w in self.members:
            w.actor.request_stop.remote()

    def remove(self, ranks: tuple[int, ...]) -> None:
        """Kill these members (dead, hung or on a lost node) and drop them from the world;
        so are the idle workers of silent nodes: they would not answer the next world."""
        for rank in ranks:
            if 0 <= rank < len(self.members):
                self._kill(self.members[rank])
        self.members = [w for r, w in enumerate(self.members) if r not in set(ranks)]
        silent = self.nodes.silent.keys()
        for w in [w for w in self.idle if w.place is not None and w.place.node_id in silent]:
            self._kill(w)
            self.idle.remove(w)

    def exclude_nodes(self, node_ids: frozenset[str]) -> None:
        self.excluded |= node_ids
        for w in [w for w in self.idle if w.place is not None and w.place.node_id in node_ids]:
            self._kill(w)
            self.idle.remove(w)

    def disband(self, after_step: int) -> Disbanded:
        """Every member leaves its world; survivors go back to the idle pool.

        Rank 0 also returns its commits and its steps after `after_step` that no poll
        reported. A member that did not answer at all (a stopped or dead process) is a
        failure of its own, which the controller records. A member that cannot leave (stuck
        thread, dead process) is killed.
        """
        answers: list[LeaveReport | None] = _answers(
            [w.actor.leave.remote(self.LEAVE_TIMEOUT_S, after_step) for w in self.members],
            timeout=self.LEAVE_TIMEOUT_S + 5)
        steps, survivors, commits, silent = [], [], [], []
        late: list[StepReport] = []
        self.polls.forget()
        for rank, (w, ok) in enumerate(zip(self.members, answers, strict=True)):
            if rank == 0 and ok is not None:
                late = list(ok.steps)
            if ok is not None and ok.left:
                survivors.append(w)
                steps.append(ok.step)
                if rank == 0:
                    commits = list(ok.commits)
            else:
                if ok is not None:  # it answers, but its training thread is stuck
                    self._rescue(w)
                elif w.place is not None:
                    silent.append(w.place.pid)
                self._kill(w)
        # Survivors first, in their old rank order: rank 0 usually stays rank 0.
        self.members, self.idle = [], survivors + self.idle
        return Disbanded(survivor_steps=steps, commits=commits, steps=late, silent=silent)

    def _rescue(self, w: Worker) -> None:
        """Copy what a worker about to be killed holds in memory to the object store.

        A survivor whose training thread cannot unwind (stuck in a collective) is replaced,
        but its snapshots (its own and its peers' replicas) may be the only copies of a
        shard: they are exported before the kill and served from here at the restore.
        """
        try:
            inventory = ray.get(w.actor.memory_inventory.remote(), timeout=self.LEAVE_TIMEOUT_S)
            refs = {(h.generation, h.source, h.step):
                    w.actor.export_snapshot.remote(h.generation, h.source, h.step)
                    for h in inventory.holdings}
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.LEAVE_TIMEOUT_S,
                     fetch_local=False)
        except Exception:
            return  # nothing rescued: the restore uses what the others hold
        self.rescued[w.key] = (inventory, refs)

    # ------------------------------------------------------------------ teardown

    def _kill(self, w: Worker) -> None:
        """SIGKILL the actor's process (at once, even when SIGSTOPped), then forget the actor.

        ray.kill alone waits for a stopped process to answer before it escalates (5 s here);
        a process that is gone also closes its sockets, so its peers' collectives fail now.
        On another node the kill is a tiny task pinned there, not waited for; on a node that
        is gone there is nothing left to kill.
        """
        pid, node_id = (w.place.pid, w.place.node_id) if w.place else (None, None)
        if pid is not None and node_id == self.driver_node_id:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        elif pid is not None and node_id and self.nodes.alive({node_id}):
            _sigkill.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
                node_id, soft=False)).remote(pid)
        ray.kill(w.actor, no_restart=True)

    def shutdown(self, *, graceful: bool) -> None:
        """Leave the process group cleanly when asked and able; then kill every actor."""
        if graceful and self.members:
            try:
                self._get([w.actor.shutdown.remote() for w in self.members], timeout=60)
            except GroupFailed:
                pass  # the actors are killed below either way
        for w in self.members + self.idle + self.starting:
            ray.kill(w.actor, no_restart=True)
        self.members, self.idle, self.starting = [], [], []
        self.polls.shutdown()
        if self._beacon is not None:  # after the workers: they must not take it for a loss
            ray.kill(self._beacon, no_restart=True)
            self._beacon = None

    def _get(self, refs: list[Any], *, timeout: float | None = None,
             kind: FailureKind = FailureKind.START_ERROR) -> list[Any]:
        """ray.get each rank's result; the first error becomes a GroupFailed naming the rank."""
        out = []
        deadline = None if timeout is None else time.monotonic() + timeout
        for rank, ref in enumerate(refs):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out.append(ray.get(ref, timeout=left))
            except GetTimeoutError:
                raise GroupFailed(classify.no_answer(rank, timeout, time.time())) from None
            except Exception as exc:
                raise GroupFailed(_failure_from(exc, rank, kind)) from exc
        return out
