"""Peer replication: each rank's staged snapshot is copied to holders on other nodes.

Holders form a ring over nodes (`holders_for`): replica k of a rank on node i goes to a rank
on node i+k, so losing any `replicas` nodes at once loses no shard. On one node the ring is
over processes instead, which still survives the loss of a process.

The copy runs on a background thread over a gloo process group of its own (never the
training group: its point-to-point traffic must not interleave with the step's
collectives). One exchange per snapshot: every rank sends a header (step, sizes) then its
buffer and packed values to its holders, and receives the same from the ranks it holds for.
A received snapshot enters the store only once it is complete.

Ordering, which makes some step always complete somewhere: a rank waits for its previous
exchange (`wait`) before the all-reduce that ends the next step. So once any rank is past
step t's all-reduce, every exchange of step t-1 is complete on every rank, and staging step
t may overwrite step t-2's buffers.
"""

from __future__ import annotations

import pickle
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

import torch
import torch.distributed as dist

from stalwart.checkpointing.memory.store import MemoryStore
from stalwart.checkpointing.snapshot import Shard, ShardLayout


class ReplicationAbandoned(RuntimeError):
    """The world is being left while a snapshot exchange is still in flight."""


def holders_for(nodes: list[str], replicas: int) -> dict[int, list[int]]:
    """For each rank, the ranks that hold its replicas: a ring over nodes.

    `nodes` is each rank's node id. Replica k (1..replicas) of a rank with local index j on
    node i goes to local index j (mod size) of node i+k. With fewer nodes than replicas+1,
    the remaining replicas go to other processes on the ring of ranks.
    """
    order: list[str] = []
    for node in nodes:
        if node not in order:
            order.append(node)
    ranks_on = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    out: dict[int, list[int]] = {}
    world = len(nodes)
    for rank, node in enumerate(nodes):
        i, j = order.index(node), ranks_on[node].index(rank)
        chosen: list[int] = []
        for k in range(1, replicas + 1):
            if k < len(order):
                peers = ranks_on[order[(i + k) % len(order)]]
                chosen.append(peers[j % len(peers)])
                continue
            # Not enough nodes: the next ranks on the ring that are not yet holders.
            for step in range(1, world):
                cand = (rank + step) % world
                if cand != rank and cand not in chosen:
                    chosen.append(cand)
                    break
        out[rank] = chosen
    return out


def exchanges(rank: int, holders: dict[int, list[int]], replica_class: list[Any] | None = None
              ) -> tuple[list[int], list[int]]:
    """(ranks this rank sends its snapshot to, ranks it receives snapshots from).

    A holder that is a data-parallel replica of the rank (equal `replica_class`) already
    holds an identical snapshot of its own: nothing is sent to it. Data parallelism across
    nodes therefore replicates for free, and only sharded state (FSDP, TP, PP) is copied.
    """
    def twins(a: int, b: int) -> bool:
        return replica_class is not None and replica_class[a] == replica_class[b]

    sends = [h for h in holders.get(rank, []) if not twins(rank, h)]
    receives = sorted(q for q, hs in holders.items()
                      if rank in hs and q != rank and not twins(rank, q))
    return sends, receives


class Replicator:
    def __init__(self, *, rank: int, generation: int, holders: dict[int, list[int]],
                 store: MemoryStore, replica_class: list[Any] | None = None) -> None:
        self.rank = rank
        self.generation = generation
        self.store = store
        self.sends_to, self.receives_from = exchanges(rank, holders, replica_class)
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replicate")
        self._pending: Future[None] | None = None
        self._layouts_sent: set[tuple[int, str]] = set()  # (holder, layout key)
        self._layouts_seen: dict[tuple[int, str], ShardLayout] = {}
        self._abandoned = threading.Event()
        self._names_shared = False

    def replicate(self, shard: Shard, before_payload: Callable[[], None] | None = None) -> None:
        """Start copying `shard` to this rank's holders (and receiving its sources').

        `before_payload` runs on the exchange's thread once the headers are exchanged,
        before the payload is sent (a test, or a fault injected mid-exchange)."""
        self.wait()
        if self.group is not None:
            self._pending = self._executor.submit(self._exchange, shard, before_payload)

    def wait(self) -> None:
        """Block until the exchange in flight is complete; re-raises its error, or raises
        ReplicationAbandoned once `abandon` is called."""
        pending = self._pending
        if pending is None:
            return
        while not self._abandoned.is_set():
            try:
                pending.result(timeout=0.05)
                break
            except FuturesTimeout:
                continue
        else:
            raise ReplicationAbandoned("the snapshot exchange was abandoned: leaving the world")
        self._pending = None

    def abandon(self) -> None:
        self._abandoned.set()

    def _share_names(self, layout: ShardLayout) -> None:
        """Once per world: every rank learns the names in every rank's shard, so that a
        shard lost with all its copies is known to be missing (a pipeline stage's layers
        are in no other shard). The first snapshot is taken at the same step everywhere."""
        names: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(names, sorted(it.index.fqn for it in layout.items),
                               group=self.group)
        self.store.set_names(self.generation, frozenset(n for ns in names for n in ns))
        self._names_shared = True

    def _exchange(self, shard: Shard, before_payload: Callable[[], None] | None) -> None:
        shard.ready()
        group = self.group
        if not self._names_shared:
            self._share_names(shard.layout)
        # The layout goes with the first snapshot that uses it; later ones name it by key.
        payloads = {}
        for h in self.sends_to:
            send_layout = (h, shard.layout.key) not in self._layouts_sent
            payloads[h] = pickle.dumps((shard.layout.key,
                                        shard.layout if send_layout else None, shard.values),
                                       protocol=pickle.HIGHEST_PROTOCOL)
        ops, headers = [], {}
        for h in self.sends_to:
            header = torch.tensor([shard.step, shard.layout.nbytes, len(payloads[h])],
                                  dtype=torch.int64)
            ops.append(dist.P2POp(dist.isend, header, group=group, group_peer=h))
        for q in self.receives_from:
            headers[q] = torch.zeros(3, dtype=torch.int64)
            ops.append(dist.P2POp(dist.irecv, headers[q], group=group, group_peer=q))
        self._run(ops)
        if before_payload is not None:
            before_payload()
        ops, incoming = [], {}
        for h in self.sends_to:
            ops.append(dist.P2POp(dist.isend, shard.buffer, group=group, group_peer=h))
            ops.append(dist.P2POp(dist.isend, torch.frombuffer(bytearray(payloads[h]),
                                                               dtype=torch.uint8),
                                  group=group, group_peer=h))
        for q in self.receives_from:
            step, nbytes, nvalues = (int(x) for x in headers[q].tolist())
            buf = self.store.reusable_buffer(self.generation, q, nbytes)
            if buf is None:
                buf = torch.empty(nbytes, dtype=torch.uint8)
            values = torch.empty(nvalues, dtype=torch.uint8)
            incoming[q] = (step, buf, values)
            ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=q))
            ops.append(dist.P2POp(dist.irecv, values, group=group, group_peer=q))
        self._run(ops)
        for h in self.sends_to:
            self._layouts_sent.add((h, shard.layout.key))
        for q, (step, buf, values) in incoming.items():
            key, layout, vals = pickle.loads(values.numpy().tobytes())
            if layout is not None:
                self._layouts_seen[(q, key)] = layout
            self.store.put(self.generation, q, Shard(step=step, layout=self._layouts_seen[(q, key)],
                                                     buffer=buf, values=vals))

    def _run(self, ops: list[Any]) -> None:
        if not ops:
            return
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def close(self) -> None:
        """Leave: wait for the exchange in flight unless abandoned. An exchange still stuck
        (on a peer that vanished) keeps its thread and group until the peer's connections
        fail or the group's timeout; destroying a group under a thread that is inside one of
        its operations is not safe."""
        try:
            self.wait()
        except Exception:
            pass  # an exchange that failed with its world; what is complete stays held
        pending = self._pending
        stuck = pending is not None and not pending.done()
        self._executor.shutdown(wait=not stuck)
        if self.group is not None and not stuck:
            try:
                dist.destroy_process_group(self.group)
            except Exception:
                pass
        self.group = None
