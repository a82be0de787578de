"""Snapshots: one rank's shard of the training state, staged into preallocated CPU memory.

A shard is described once by DCP's own save planner (the WriteItems a `dcp.save` of this
rank would write, with each tensor's chunk of the global tensor), so a snapshot can be read
back through DCP and resharded to any world, exactly like a storage checkpoint. Its tensors
live back to back in one flat uint8 buffer (`ShardLayout.slots` says where), which is at once
the staged copy, the payload sent to peers and what the storage tier persists. Its
non-tensor leaves (LR schedule, step, data position, optimizer hyperparameters) are kept as
plain values by their flattened DCP name.

Staging copies the live tensors into the older of two buffers, which are reused between
snapshots: the copy is the only work on the training thread. On a GPU the copy is a
device-to-host copy into pinned memory on a stream of its own; `ready()` waits for it.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType
from torch.distributed.tensor import DTensor

try:  # ISA-L's CRC32: zlib's values, about 4x zlib's speed (15-20 GB/s a core), GIL released
    from isal.isal_zlib import crc32
except ImportError:  # a platform with no wheel of it
    from zlib import crc32


@dataclass(frozen=True)
class TensorSlot:
    offset: int
    """Byte offset of this tensor in the shard's flat buffer."""
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ShardLayout:
    """What one rank's shard holds, in DCP's terms, and where each tensor sits in the buffer."""

    items: tuple[WriteItem, ...]
    slots: dict[MetadataIndex, TensorSlot]
    planner_data: dict[str, Any]
    """DCP's flatten mapping (flattened name -> path in the nested state dict)."""
    nbytes: int
    key: str
    """A digest of the above: equal layouts have equal keys."""

    @property
    def value_names(self) -> list[str]:
        return [it.index.fqn for it in self.items if it.type == WriteItemType.BYTE_IO]


@dataclass
class Shard:
    """One rank's staged state at one step."""

    step: int
    layout: ShardLayout
    buffer: torch.Tensor
    """uint8, layout.nbytes long (pinned CPU memory when training on a GPU)."""
    values: dict[str, Any] = field(default_factory=dict)
    ready_event: Any = None
    """A CUDA event recorded after the device-to-host copy, or None when it is complete."""
    crc: int | None = None
    """CRC32 of `buffer`, computed by the shard's owner once staged (`seal`) and carried to
    its holders; checked before a restore uses the bytes. None: not sealed yet."""

    def tensor(self, index: MetadataIndex) -> torch.Tensor:
        """The slot's tensor over the buffer's memory, with a storage of exactly its own
        bytes rather than a view of the whole buffer's: DCP's writer clones a tensor whose
        storage is larger than it (a full extra copy of a persisted snapshot), and
        torch.save would write the whole storage."""
        slot = self.layout.slots[index]
        own = torch.from_numpy(self.buffer.numpy()[slot.offset:slot.offset + slot.nbytes])
        return own.view(slot.dtype).view(slot.shape)

    def ready(self) -> None:
        if self.ready_event is not None:
            self.ready_event.synchronize()
            self.ready_event = None

    def seal(self) -> int:
        """Wait for the staging copy, then record the buffer's CRC32 (off the training
        thread: the CRC32 releases the GIL)."""
        self.ready()
        self.crc = buffer_crc(self.buffer)
        return self.crc


def buffer_crc(buffer: torch.Tensor, threads: int = 1) -> int:
    """CRC32 of a flat uint8 CPU buffer, over up to `threads` parts at once (the CRC32
    releases the GIL), the parts' CRCs then combined: the same value as one pass."""
    data = buffer.numpy()
    parts = max(1, min(threads, len(data) // CRC_PART_MIN))
    if parts == 1:
        return crc32(data)
    bounds = [len(data) * i // parts for i in range(parts + 1)]
    with ThreadPoolExecutor(parts, thread_name_prefix="stalwart-crc") as pool:
        crcs = list(pool.map(lambda i: crc32(data[bounds[i]:bounds[i + 1]]),
                             range(parts)))
    crc = crcs[0]
    for i in range(1, parts):
        crc = crc32_combine(crc, crcs[i], bounds[i + 1] - bounds[i])
    return crc


CRC_PART_MIN = 1 << 24
"""The smallest part of a buffer worth a thread of its own (16 MiB: about 1 ms of CRC32)."""
_CRC_POLY = 0xEDB88320  # CRC-32's polynomial, bit-reflected, as zlib has it


def _multmodp(a: int, b: int) -> int:
    """a times b modulo the CRC-32 polynomial (zlib's multmodp; `a` is never 0 here)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _CRC_POLY if b & 1 else b >> 1


_X2N = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31 (zlib's x2n_table)
for _ in range(31):
    _X2N.append(_multmodp(_X2N[-1], _X2N[-1]))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC32 of A followed by B, from A's CRC32, B's and B's length (zlib's
    crc32_combine, which Python's zlib does not expose): A's CRC shifted by len2 bytes."""
    p, n, k = 1 << 31, len2, 3  # p = x^0; each set bit of n multiplies by x^(8 * 2^bit)
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


def layout_key(items: tuple[WriteItem, ...], slots: dict[MetadataIndex, TensorSlot]) -> str:
    """A digest of a layout's items and tensor slots: equal layouts have equal keys (and a
    layout received from a peer must match the key it came with)."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(repr((item.index.fqn, item.index.offset, item.type)).encode())
        if item.type != WriteItemType.BYTE_IO:
            slot = slots[item.index]
            digest.update(repr((slot.shape, slot.dtype)).encode())
    return digest.hexdigest()[:16]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def build_layout(state_dict: dict[str, Any]) -> tuple[ShardLayout, list[tuple[TensorSlot,
                                                                          torch.Tensor]]]:
    """Describe a rank's state dict as DCP would save it; also return each tensor slot's source.

    The sources are the live tensors (detached views of parameters and optimizer state),
    so later snapshots copy from them without asking the model for its state dict again.
    """
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, storage_meta=None, is_coordinator=False)
    plan = planner.create_local_plan()
    slots: dict[MetadataIndex, TensorSlot] = {}
    sources: list[tuple[TensorSlot, torch.Tensor]] = []
    offset = 0
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        src = planner.resolve_data(item)
        assert isinstance(src, torch.Tensor)
        src = _local(src).detach()
        shape = tuple(item.tensor_data.chunk.sizes)
        nbytes = math.prod(shape) * src.element_size()
        # Align every tensor to 64 bytes so that each view is aligned for any dtype.
        offset = (offset + 63) // 64 * 64
        slot = TensorSlot(offset=offset, nbytes=nbytes, dtype=src.dtype, shape=shape)
        slots[item.index] = slot
        sources.append((slot, src))
        offset += nbytes
    items = tuple(plan.items)
    layout = ShardLayout(items=items, slots=slots, planner_data=dict(plan.planner_data),
                         nbytes=offset, key=layout_key(items, slots))
    return layout, sources


class SnapshotStager:
    """Stages a rank's state into `buffers` reusable buffers (two by default: the newest
    complete snapshot and the one being written; more keep older steps to roll back to). `state_dict` gives the full DCP state (used when the layout is built
    or has changed), `scalar_state` the non-tensor leaves (cheap; asked at every snapshot),
    `signature` something that changes when the set or the storage of state tensors does
    (an optimizer creating its state lazily)."""

    def __init__(self, *, state_dict: Callable[[], dict[str, Any]],
                 scalar_state: Callable[[], dict[str, Any]],
                 signature: Callable[[], Any], device: torch.device,
                 on_layout: Callable[[ShardLayout], None] | None = None,
                 buffers: int = 2) -> None:
        self._state_dict = state_dict
        self._count = buffers
        self._on_layout = on_layout  # told of each new layout before its buffers exist
        self._scalar_state = scalar_state
        self._signature = signature
        self.device = device
        self.layout: ShardLayout | None = None
        self._sources: list[tuple[TensorSlot, torch.Tensor]] = []
        self._constant_values: dict[str, Any] = {}
        self._sig: Any = None
        self._buffers: list[torch.Tensor] = []
        self._next = 0
        self._stream = (torch.cuda.Stream(device) if device.type == "cuda" else None)
        self.lock = threading.Lock()

    @property
    def buffers(self) -> list[torch.Tensor]:
        return list(self._buffers)

    def _refresh_layout(self) -> None:
        sig = self._signature()
        if self.layout is not None and sig == self._sig:
            return
        state = self._state_dict()
        self.adopt(state, *build_layout(state), signature=sig)

    def adopt(self, state: dict[str, Any], layout: ShardLayout,
              sources: list[tuple[TensorSlot, torch.Tensor]], *, signature: Any) -> None:
        """Take `layout` and `sources` (build_layout(state)) as the state's description.
        A restore that built them hands them over: the world's first snapshot (the restored
        step, staged in its first step) then asks for neither again. `signature` is the
        state's when `state` was taken: if the optimizer's tensors changed since (a load that
        replaced them), the next snapshot describes the state again."""
        flat, _ = flatten_state_dict(state)
        scalars, _ = flatten_state_dict(self._scalar_state())
        # Values the scalar state does not carry (the parameter names of each optimizer
        # param group) do not change between steps: keep them from the full state dict.
        self._constant_values = {name: flat[name] for name in layout.value_names
                                 if name not in scalars}
        if self._on_layout is not None:
            self._on_layout(layout)
        if self.layout is None or layout.nbytes != self.layout.nbytes:
            pin = self.device.type == "cuda"
            self._buffers = [torch.empty(layout.nbytes, dtype=torch.uint8, pin_memory=pin)
                             for _ in range(self._count)]
        self.layout, self._sources, self._sig = layout, sources, signature

    def stage(self, step: int, mid_copy: Callable[[], None] | None = None,
              before_overwrite: Callable[[torch.Tensor], None] | None = None) -> Shard:
        """Copy the live state into the older buffer; returns the new snapshot.

        `before_overwrite` is told which buffer is about to be overwritten (so that the
        store forgets the snapshot in it first); `mid_copy` runs after half of the tensors
        are copied (a test, or a fault injected while a snapshot is being staged).
        """
        self._refresh_layout()
        assert self.layout is not None
        values = self._values()
        if set(self.layout.value_names) - set(values):
            # A new kind of value appeared: describe the state again.
            self._sig = None
            self._refresh_layout()
            values = self._values()
        buffer = self._buffers[self._next]
        self._next = (self._next + 1) % len(self._buffers)
        if before_overwrite is not None:
            before_overwrite(buffer)
        shard = Shard(step=step, layout=self.layout, buffer=buffer,
                      values={k: values[k] for k in self.layout.value_names})
        half = len(self._sources) // 2
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                self._copy(shard, half, mid_copy, non_blocking=True)
                shard.ready_event = torch.cuda.Event()
                shard.ready_event.record(self._stream)
        else:
            self._copy(shard, half, mid_copy, non_blocking=False)
        return shard

    def _values(self) -> dict[str, Any]:
        """The non-tensor leaves now, by flattened name (the constant ones kept from the
        layout's full state dict)."""
        return {**self._constant_values, **flatten_state_dict(self._scalar_state())[0]}

    def _copy(self, shard: Shard, half: int, mid_copy: Callable[[], None] | None, *,
              non_blocking: bool) -> None:
        for i, (slot, src) in enumerate(self._sources):
            if i == half and mid_copy is not None:
                mid_copy()
            view = shard.buffer[slot.offset:slot.offset + slot.nbytes].view(slot.dtype)
            view.view(slot.shape).copy_(src, non_blocking=non_blocking)

    def wait_copy_done(self) -> None:
        """Make the compute stream wait for the staging copy before the state changes (GPU)."""
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
