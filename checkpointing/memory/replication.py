"""Peer replication: each rank's staged snapshot is copied to holders on other nodes.

Holders form a ring over nodes (`holders_for`): replica k of a rank on node i goes to a rank
on node i+k, so losing any `replicas` nodes at once loses no shard. On one node the ring is
over processes instead, which still survives the loss of a process.

The copy runs on a background thread over a gloo process group of its own (never the
training group: its point-to-point traffic must not interleave with the step's
collectives). One exchange per snapshot: every rank sends a header (step, sizes) then its
buffer and a JSON message (its CRC32, layout and values: memory/wire.py) to its holders,
and receives the same from the ranks it holds for. A received snapshot enters the store only
once it is complete and checked: its step is the one being exchanged, it is the sender's own
shard, and its layout claims no chunk that another rank declared when the world formed.
Anything else is refused (SnapshotRefused, raised by `wait` once the others are stored).

Ordering, which makes some step always complete somewhere: a rank waits for its previous
exchange (`wait`) before the all-reduce that ends the next step. So once any rank is past
step t's all-reduce, every exchange of step t-1 is complete on every rank, and staging step
t may overwrite step t-2's buffers. With an auto schedule (checkpointing/snapshot_schedule.py)
the same holds between snapshots rather than steps: with snapshots at s1 < s2 < s3, every
rank waits for s2's exchange before the all-reduce that ends step s3, so staging s3 (which
overwrites s1's buffers) finds s2 complete everywhere; a snapshot outside the plan (a stop)
first waits for its exchange and meets every rank in a barrier on this group.

An exchange may carry figures (the schedule's window): they are MAX all-reduced on this
group, on the exchange's thread, before the headers, and kept as `agreed` for the training
thread to read once the exchange is done. Every rank passes figures to the same exchanges,
so the collective pairs up. Each exchange's thread CPU time (`busy_s`), wall time
(`exchange_s`) and end (`finished_at`) are kept for the schedule too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from typing import Any

import torch
import torch.distributed as dist

from stalwart.checkpointing.errors import SnapshotRefused
from stalwart.checkpointing.memory.catalog import describe, foreign_claims
from stalwart.checkpointing.memory.store import MemoryStore
from stalwart.checkpointing.memory.wire import (
    MAX_CLAIMS_BYTES,
    MAX_MESSAGE_BYTES,
    SnapshotMessage,
    claims,
    decode_claims,
    decode_message,
    encode_claims,
    encode_message,
)
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


def check_announced_length(rank: int, n: int, limit: int, what: str, *, minimum: int = 0
                           ) -> None:
    """Refuse (SnapshotRefused) a length rank `rank` announced for `what` that is negative,
    under `minimum` or over `limit`: called before anything is allocated to that size."""
    if not minimum <= n <= limit:
        raise SnapshotRefused(f"rank {rank} announces {what} of {n} bytes; from {minimum} to "
                              f"{limit} are accepted")


def all_gather_bytes(data: bytes, group: Any, *, limit: int, what: str) -> list[bytes]:
    """Every rank's `data`, by rank: the lengths first, then the bytes padded to the longest
    (tensors only: no Python object travels). Every rank allocates the world's size times the
    longest, so a length over `limit` is refused first: by every rank alike, since all see the
    same lengths, and none goes on to the second all-gather."""
    world = dist.get_world_size(group)
    lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64), group=group)
    for rank, n in enumerate(lengths):
        check_announced_length(rank, int(n), limit, what)
    longest = max(1, max(int(n) for n in lengths))
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return [g[:int(n)].numpy().tobytes() for g, n in zip(gathered, lengths, strict=True)]


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
                 store: MemoryStore, replica_class: list[Any] | None = None,
                 max_bytes: int = 1 << 62) -> None:
        self.rank = rank
        self.max_bytes = max_bytes
        """The largest snapshot buffer accepted from a peer (the tier's memory limit)."""
        self.generation = generation
        self.store = store
        self.sends_to, self.receives_from = exchanges(rank, holders, replica_class)
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replicate")
        self._pending: Future[None] | None = None
        self._layouts_sent: set[tuple[int, str]] = set()  # (holder, layout key)
        self._layouts_seen: dict[tuple[int, str], ShardLayout] = {}
        self._abandoned = threading.Event()
        self._claims_shared = False
        self.agreed: list[float] | None = None
        """The figures the last exchange all-reduced (MAX over ranks), until read."""
        self.busy_s = 0.0
        """CPU seconds of the last exchange's thread."""
        self.exchange_s = 0.0
        """Wall seconds of the last exchange."""
        self.finished_at = 0.0
        """When the last exchange ended (time.perf_counter)."""

    def replicate(self, shard: Shard, before_payload: Callable[[], None] | None = None, *,
                  figures: list[float] | None = None,
                  sending: Callable[[int], None] | None = None) -> None:
        """Start copying `shard` to this rank's holders (and receiving its sources').

        `before_payload` runs on the exchange's thread once the headers are exchanged,
        before the payload is sent (a test, or a fault injected mid-exchange); `sending` is
        told the bytes about to be sent then (a link throttled for a test). `figures` are
        all-reduced with the exchange (module docstring); every rank must pass them to the
        same exchanges."""
        self.wait()
        if self.group is not None:
            self._pending = self._executor.submit(self._exchange, shard, before_payload,
                                                  figures, sending)
        else:
            shard.seal()  # no peers (a single process): the snapshot still gets its CRC
            self.agreed = figures

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
            except BaseException:
                self._pending = None  # that exchange is over (a refusal): the next may start
                raise
        else:
            raise ReplicationAbandoned("the snapshot exchange was abandoned: leaving the world")
        self._pending = None

    def abandon(self) -> None:
        self._abandoned.set()

    def _share_claims(self, layout: ShardLayout) -> None:
        """Once per world: every rank learns what every rank's shard holds (its claims), so
        that a shard lost with all its copies is known to be missing (a pipeline stage's
        layers are in no other shard), and a layout that later claims another rank's chunks
        is refused. The first snapshot is taken at the same step everywhere."""
        shared = all_gather_bytes(encode_claims(layout), self.group, limit=MAX_CLAIMS_BYTES,
                                  what="its shard's claims")
        self.store.set_claims(self.generation, {r: decode_claims(b) for r, b in enumerate(shared)})
        self._claims_shared = True

    def _message(self, shard: Shard, with_layout: bool) -> bytes:
        assert shard.crc is not None
        return encode_message(SnapshotMessage(
            generation=self.generation, source=self.rank, step=shard.step,
            nbytes=shard.layout.nbytes, crc=shard.crc, layout_key=shard.layout.key,
            layout=shard.layout if with_layout else None, values=shard.values))

    def _exchange(self, shard: Shard, before_payload: Callable[[], None] | None,
                  figures: list[float] | None = None,
                  sending: Callable[[int], None] | None = None) -> None:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            if figures is not None:
                self.agreed = self._agree(figures)
            self._send_and_receive(shard, before_payload, sending)
        finally:
            self.busy_s = time.thread_time() - cpu
            self.finished_at = time.perf_counter()
            self.exchange_s = self.finished_at - started

    def _agree(self, figures: list[float]) -> list[float]:
        """The most any rank measured, figure by figure (one small all-reduce)."""
        values = torch.tensor(figures, dtype=torch.float64)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        return values.tolist()

    def _send_and_receive(self, shard: Shard, before_payload: Callable[[], None] | None,
                          sending: Callable[[int], None] | None) -> None:
        shard.seal()  # the CRC its holders keep, checked before a restore uses the bytes
        group = self.group
        if not self._claims_shared:
            self._share_claims(shard.layout)
        # The layout goes with the first snapshot that uses it; later ones name it by key.
        encoded: dict[bool, bytes] = {}
        payloads = {}
        for h in self.sends_to:
            send_layout = (h, shard.layout.key) not in self._layouts_sent
            if send_layout not in encoded:
                encoded[send_layout] = self._message(shard, send_layout)
            payloads[h] = encoded[send_layout]
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
        if sending is not None and self.sends_to:
            sending(sum(shard.layout.nbytes + len(payloads[h]) for h in self.sends_to))
        ops, incoming = [], {}
        for h in self.sends_to:
            ops.append(dist.P2POp(dist.isend, shard.buffer, group=group, group_peer=h))
            ops.append(dist.P2POp(dist.isend, torch.frombuffer(bytearray(payloads[h]),
                                                               dtype=torch.uint8),
                                  group=group, group_peer=h))
        self._check_headers(headers)  # nothing too large (or negative) is allocated
        for q in self.receives_from:
            step, nbytes, nmessage = (int(x) for x in headers[q].tolist())
            buf = self.store.reusable_buffer(self.generation, q, nbytes)
            if buf is None:
                buf = torch.empty(nbytes, dtype=torch.uint8)
            message = torch.empty(nmessage, dtype=torch.uint8)
            incoming[q] = (step, buf, message)
            ops.append(dist.P2POp(dist.irecv, buf, group=group, group_peer=q))
            ops.append(dist.P2POp(dist.irecv, message, group=group, group_peer=q))
        self._run(ops)
        for h in self.sends_to:
            self._layouts_sent.add((h, shard.layout.key))
        refused = []
        for q, (step, buf, message) in incoming.items():
            try:
                self._accept(q, step, buf, message.numpy().tobytes(), exchanging=shard.step)
            except SnapshotRefused as exc:  # the others' snapshots are still taken
                refused.append(str(exc))
        if refused:
            raise SnapshotRefused("; ".join(refused))

    def _check_headers(self, headers: dict[int, torch.Tensor]) -> None:
        """Refuse the exchange (SnapshotRefused) before any buffer is allocated if a header
        announces a buffer or message out of bounds, or buffers that together exceed the
        tier's limit on this worker (the most it may hold, so the most honest peers send)."""
        total = 0
        for q, header in headers.items():
            _step, nbytes, nmessage = (int(x) for x in header.tolist())
            check_announced_length(q, nbytes, self.max_bytes, "a snapshot buffer")
            check_announced_length(q, nmessage, MAX_MESSAGE_BYTES, "a snapshot message",
                                   minimum=1)
            total += nbytes
        if total > self.max_bytes:
            raise SnapshotRefused(
                f"ranks {sorted(headers)} announce snapshot buffers of {total} bytes in all; "
                f"at most {self.max_bytes} (the tier's limit on this worker) are accepted")

    def _accept(self, q: int, step: int, buf: torch.Tensor, data: bytes, *,
                exchanging: int) -> None:
        """Check what rank `q` sent, then store it; raises SnapshotRefused (nothing stored)."""
        msg = decode_message(data)
        refuse = f"refused rank {q}'s snapshot: "
        if step != exchanging or msg.step != exchanging:
            raise SnapshotRefused(refuse + f"it is for step {msg.step} (header {step}), but "
                                  f"step {exchanging} is being exchanged")
        if msg.source != q or q not in self.receives_from:
            raise SnapshotRefused(refuse + f"it says it is rank {msg.source}'s shard; this "
                                  f"rank holds for ranks {self.receives_from}")
        if msg.generation != self.generation:
            raise SnapshotRefused(refuse + f"it is of generation {msg.generation}, not "
                                  f"{self.generation}")
        if msg.nbytes != buf.numel():
            raise SnapshotRefused(refuse + f"its message says {msg.nbytes} bytes, its header "
                                  f"{buf.numel()}")
        layout = msg.layout or self._layouts_seen.get((q, msg.layout_key))
        if layout is None or layout.nbytes != msg.nbytes:
            raise SnapshotRefused(refuse + f"it names layout {msg.layout_key!r}, which it "
                                  f"never sent (or of another size)")
        foreign = foreign_claims(q, claims(layout), self.store.claims(self.generation))
        if foreign:
            raise SnapshotRefused(refuse + f"its layout claims chunks of other ranks: "
                                  f"{describe(foreign)}")
        self._layouts_seen[(q, layout.key)] = layout
        self.store.put(self.generation, q, Shard(step=step, layout=layout, buffer=buf,
                                                 values=msg.values, crc=msg.crc))

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
