"""Reading snapshots back through DCP: the memory tier's storage reader.

`build_metadata` merges the layouts of one step's source shards into the global DCP
Metadata a storage checkpoint of that step would have had (each chunk of each tensor, each
value), recording which source ranks hold each chunk. `MemoryReader` then serves a normal
`dcp.load`: DCP's load planner works out which chunks (and which parts of them) this rank's
new shard needs, so a snapshot taken by one world and layout loads into any other, exactly
as a storage checkpoint does. Each source shard is fetched at most once, and only if needed:
a shard this worker holds itself is read in place.

Every shard is checked against the CRC32 its owner computed before any of its bytes are
used: a copy held here that fails is fetched from its holder instead; a fetched copy that
fails ends the restore with SnapshotCorrupt.
"""

from __future__ import annotations

import io
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from stalwart.checkpointing.errors import SnapshotCorrupt
from stalwart.checkpointing.snapshot import Shard, ShardLayout, buffer_crc


def build_metadata(layouts: dict[int, ShardLayout]) -> Metadata:
    """The global Metadata of a step whose shards, by source rank, have these layouts.

    storage_data maps each chunk (MetadataIndex) to the source ranks that hold it, in
    order; replicated chunks (data parallelism) have several.
    """
    state: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    where: dict[MetadataIndex, list[int]] = {}
    planner_data: dict[str, Any] = {}
    for src in sorted(layouts):
        layout = layouts[src]
        planner_data.update(layout.planner_data)
        for item in layout.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                state.setdefault(fqn, BytesStorageMetadata())
                where.setdefault(MetadataIndex(fqn), []).append(src)
                continue
            td = item.tensor_data
            md = state.setdefault(fqn, TensorStorageMetadata(properties=td.properties,
                                                             size=td.size, chunks=[]))
            index = MetadataIndex(fqn, td.chunk.offsets)
            if index not in where:
                assert isinstance(md, TensorStorageMetadata)
                md.chunks.append(td.chunk)
                where[index] = []
            where[index].append(src)
    return Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=where)


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths, strict=True)):
        tensor = tensor.narrow(dim, start, length)
    return tensor


def damage(src: int, shard: Shard) -> str | None:
    """Why `shard`'s bytes must not be used (None: they match their CRC32)."""
    shard.ready()
    if shard.crc is None:
        return f"rank {src}'s snapshot of step {shard.step} has no checksum"
    # A restore is all this rank does meanwhile: its torch threads (its share of the
    # node's CPUs) check the shard's parts at once.
    crc = buffer_crc(shard.buffer, threads=torch.get_num_threads())
    if crc != shard.crc:
        return (f"rank {src}'s snapshot of step {shard.step} is damaged: its bytes have CRC32 "
                f"{crc:08x}, its owner computed {shard.crc:08x}")
    return None


class MemoryReader(StorageReader):
    """A DCP StorageReader over snapshots held in memory (here or by peers)."""

    def __init__(self, metadata: Metadata, *, local: Callable[[int], Shard | None],
                 fetch: Callable[[int], Shard]) -> None:
        super().__init__()
        self.metadata = metadata
        self._local = local
        self._fetch = fetch
        self._shards: dict[int, Shard] = {}
        self.fetched: list[int] = []
        """Source ranks whose shards had to be fetched from a peer (for the event log)."""

    def shard_for(self, sources: list[int]) -> Shard:
        """One of these source ranks' shards, CRC-checked: one held here first, else fetched."""
        for src in sources:  # one already here, or this worker's own
            if src in self._shards:
                return self._shards[src]
        damaged = []
        for src in sources:
            shard = self._local(src)
            if shard is not None:
                why = damage(src, shard)
                if why is None:
                    self._shards[src] = shard
                    return shard
                damaged.append(why + " (the copy held here; fetching it instead)")
                print(f"stalwart memory tier: {damaged[-1]}", file=sys.stderr, flush=True)
        src = sources[0]
        shard = self._fetch(src)
        why = damage(src, shard)
        if why is not None:
            raise SnapshotCorrupt("; ".join([*damaged, why]))
        self._shards[src] = shard
        self.fetched.append(src)
        return shard

    # -- StorageReader
    def reset(self, checkpoint_id: Any = None) -> None:
        self._shards = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool,
                              *args: Any, **kwargs: Any) -> None:
        self.metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        where = self.metadata.storage_data
        for req in plan.items:
            shard = self.shard_for(where[req.storage_index])
            if req.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(shard.values[req.storage_index.fqn], buf)
                buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            src = _narrow(shard.tensor(req.storage_index), req.storage_offsets, req.lengths)
            target = planner.resolve_tensor(req).detach()
            target.copy_(src)
            planner.commit_tensor(req, target)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False
