"""The memory tier's wire format: what peers send each other, as plain data only.

A snapshot travels as a fixed header (three int64: step, buffer bytes, message bytes), then
its raw buffer, then one UTF-8 JSON message: generation, sender rank, step, CRC32 of the
buffer, the layout's key, the layout itself (the first time a holder gets it) and the
shard's plain values. Values that JSON cannot hold (tuples, dicts with other keys, bytes,
small tensors, dtypes, numpy scalars, non-finite floats) carry an explicit tag: {"$": kind}.

Decoding is strict: any wrong type, shape or size raises SnapshotFormatError, naming what
was wrong, before the snapshot can enter the store. A decoded layout must hash to the key it
came with (`layout_key`), and every tensor slot must lie inside the buffer. Before any JSON is
parsed, its length and nesting depth are bounded (`MAX_MESSAGE_BYTES`, `MAX_DEPTH`; the
claims: `MAX_CLAIMS_BYTES`, `CLAIMS_DEPTH`): no peer's bytes reach a recursion limit here or
in the code that later copies the values.
"""

from __future__ import annotations

import base64
import json
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from stalwart.checkpointing.errors import SnapshotFormatError
from stalwart.checkpointing.memory.store import Claim
from stalwart.checkpointing.snapshot import ShardLayout, TensorSlot, layout_key

VERSION = 1
TAG = "$"

MAX_MESSAGE_BYTES = 1 << 28
"""The largest snapshot message (layout and values, JSON) accepted from a peer."""
MAX_CLAIMS_BYTES = 1 << 26
"""The largest claims (JSON) a rank may announce when a world forms. A claim is a chunk's
name and offsets, about 100 bytes: 64 MiB is over half a million chunks, far more than the
largest models have tensors, however sharded. Every rank allocates the world's size times the
longest claims announced, so this cap is what bounds that."""
MAX_DEPTH = 64
"""The deepest nesting of JSON arrays and objects accepted in a message. The message's own
schema needs 5 (message, layout, items, item, slot). A value adds its own nesting, and a
tagged tuple or dict 2 or 3 levels per level of Python: 64 leaves room for any state dict's
plain values, and keeps every walk of a decoded value far from Python's recursion limit."""
CLAIMS_DEPTH = 3
"""The claims' schema, exactly: a list of [name, offsets] pairs, offsets a list."""
INT64_MAX = (1 << 63) - 1

_ITEM_TYPES = {"tensor": WriteItemType.TENSOR, "shard": WriteItemType.SHARD,
               "bytes": WriteItemType.BYTE_IO}
_ITEM_NAMES = {v: k for k, v in _ITEM_TYPES.items()}


def _fail(what: str) -> SnapshotFormatError:
    return SnapshotFormatError(f"malformed snapshot message: {what}")


# ---------------------------------------------------------------------------- checked reads


def _get(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise _fail(f"{where} has no {key!r}")
    value = obj[key]
    # bool is an int in Python: a count given as true is still refused.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (
            kind if isinstance(kind, tuple) else (kind,))):
        raise _fail(f"{where}.{key} is a {type(value).__name__}")
    return value


def _ints(value: Any, where: str, *, minimum: int = 0) -> tuple[int, ...]:
    # Sizes and offsets become torch.Size entries: int64, or torch raises its own error.
    if not isinstance(value, list) or any(
            isinstance(v, bool) or not isinstance(v, int) or not minimum <= v <= INT64_MAX
            for v in value):
        raise _fail(f"{where} is not a list of integers from {minimum} to {INT64_MAX}")
    return tuple(value)


def _dtype(name: Any, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise _fail(f"{where} is not a torch dtype: {name!r}")
    return dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------- values


def encode_value(value: Any) -> Any:
    """A JSON-ready form of one value; raises SnapshotFormatError for a kind it cannot carry."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {TAG: "float", "v": repr(value)}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, tuple):
        return {TAG: "tuple", "v": [encode_value(v) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and TAG not in value:
            return {k: encode_value(v) for k, v in value.items()}
        return {TAG: "dict", "v": [[encode_value(k), encode_value(v)] for k, v in value.items()]}
    if isinstance(value, bytes):
        return {TAG: "bytes", "v": base64.b64encode(value).decode()}
    if isinstance(value, torch.dtype):
        return {TAG: "dtype", "v": _dtype_name(value)}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return {TAG: "tensor", "dtype": _dtype_name(t.dtype), "shape": list(t.shape),
                "v": base64.b64encode(t.view(-1).view(torch.uint8).numpy().tobytes()).decode()}
    if isinstance(value, np.generic) and value.dtype.kind in "biuf":
        return {TAG: "numpy", "dtype": value.dtype.str, "v": encode_value(value.item())}
    raise SnapshotFormatError(
        f"a snapshot value of type {type(value).__name__} cannot be sent to peers (allowed: "
        f"None, bool, int, float, str, list, tuple, dict, bytes, tensor, dtype, numpy scalar)")


def decode_value(obj: Any, where: str = "value") -> Any:
    """The value `encode_value` encoded; strict about every tag."""
    if obj is None or isinstance(obj, bool | str | int | float):
        return obj
    if isinstance(obj, list):
        return [decode_value(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if not isinstance(obj, dict):
        raise _fail(f"{where} is a {type(obj).__name__}")
    if TAG not in obj:
        return {k: decode_value(v, f"{where}.{k}") for k, v in obj.items()}
    kind = obj[TAG]
    if kind == "tuple":
        items = _get(obj, "v", list, where)
        return tuple(decode_value(v, f"{where}[{i}]") for i, v in enumerate(items))
    if kind == "dict":
        pairs = _get(obj, "v", list, where)
        if any(not isinstance(p, list) or len(p) != 2 for p in pairs):
            raise _fail(f"{where} is not a list of key-value pairs")
        out = {}
        for k, v in pairs:
            key = decode_value(k, f"{where} key")
            try:
                out[key] = decode_value(v, f"{where}[{key!r}]")
            except TypeError:
                raise _fail(f"{where} has an unhashable key") from None
        return out
    if kind == "float":
        text = _get(obj, "v", str, where)
        if text not in ("nan", "inf", "-inf"):
            raise _fail(f"{where} is not a non-finite float: {text!r}")
        return float(text)
    if kind == "bytes":
        return _b64(_get(obj, "v", str, where), where)
    if kind == "dtype":
        return _dtype(_get(obj, "v", str, where), where)
    if kind == "tensor":
        dtype = _dtype(_get(obj, "dtype", str, where), where)
        shape = _ints(_get(obj, "shape", list, where), f"{where}.shape")
        raw = _b64(_get(obj, "v", str, where), where)
        if len(raw) != math.prod(shape) * dtype.itemsize:
            raise _fail(f"{where} holds {len(raw)} bytes, not a {dtype} tensor of {shape}")
        if not raw:  # torch.frombuffer refuses an empty buffer
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(shape)
    if kind == "numpy":
        try:
            dtype = np.dtype(_get(obj, "dtype", str, where))
        except TypeError:
            raise _fail(f"{where} names no numpy dtype") from None
        if dtype.kind not in "biuf":
            raise _fail(f"{where} is a numpy {dtype}, not a number")
        value = decode_value(_get(obj, "v", (bool, int, float, dict), where), where)
        if not isinstance(value, bool | int | float):
            raise _fail(f"{where} is not a number")
        try:
            return dtype.type(value)
        except (OverflowError, ValueError):
            raise _fail(f"{where}: {value!r} does not fit a numpy {dtype}") from None
    raise _fail(f"{where} has an unknown tag {kind!r}")


def _b64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise _fail(f"{where} is not base64") from None


# ---------------------------------------------------------------------------- layouts


def encode_layout(layout: ShardLayout) -> dict[str, Any]:
    items = []
    for item in layout.items:
        idx = item.index
        out: dict[str, Any] = {
            "fqn": idx.fqn, "type": _ITEM_NAMES[item.type], "index": idx.index,
            "offset": None if idx.offset is None else list(idx.offset)}
        if item.bytes_io_data is not None:
            out["bytes"] = item.bytes_io_data.nbytes
        if item.tensor_data is not None:
            td, slot = item.tensor_data, layout.slots[idx]
            if td.properties.layout != torch.strided:
                raise SnapshotFormatError(f"{idx.fqn}: only strided tensors are sent to peers")
            out.update(dtype=_dtype_name(td.properties.dtype), size=list(td.size),
                       chunk_offsets=list(td.chunk.offsets), chunk_sizes=list(td.chunk.sizes),
                       slot=[slot.offset, slot.nbytes, _dtype_name(slot.dtype)])
        items.append(out)
    planner = {name: list(path) for name, path in layout.planner_data.items()}
    return {"key": layout.key, "nbytes": layout.nbytes, "items": items, "planner_data": planner}


def decode_layout(obj: Any) -> ShardLayout:
    """A ShardLayout from its JSON form: every field checked, every slot inside the buffer,
    and the whole hashing to its key."""
    nbytes = _get(obj, "nbytes", int, "layout")
    key = _get(obj, "key", str, "layout")
    if nbytes < 0:
        raise _fail("layout.nbytes is negative")
    items: list[WriteItem] = []
    slots: dict[MetadataIndex, TensorSlot] = {}
    for i, raw in enumerate(_get(obj, "items", list, "layout")):
        where = f"layout item {i}"
        fqn = _get(raw, "fqn", str, where)
        kind = _ITEM_TYPES.get(_get(raw, "type", str, where))
        if kind is None:
            raise _fail(f"{where} has an unknown type {raw['type']!r}")
        hint = _get(raw, "index", (int, type(None)), where)
        offset = _get(raw, "offset", (list, type(None)), where)
        index = MetadataIndex(fqn, None if offset is None else _ints(offset, f"{where}.offset"),
                              hint)
        bytes_io = None
        if "bytes" in raw:
            bytes_io = BytesIOWriteData(nbytes=_get(raw, "bytes", int, where))
        if kind == WriteItemType.BYTE_IO:
            items.append(WriteItem(index=index, type=kind, bytes_io_data=bytes_io))
            continue
        dtype = _dtype(_get(raw, "dtype", str, where), f"{where}.dtype")
        size = _ints(_get(raw, "size", list, where), f"{where}.size")
        offsets = _ints(_get(raw, "chunk_offsets", list, where), f"{where}.chunk_offsets")
        sizes = _ints(_get(raw, "chunk_sizes", list, where), f"{where}.chunk_sizes")
        if not len(size) == len(offsets) == len(sizes) or any(
                o + s > t for o, s, t in zip(offsets, sizes, size, strict=True)):
            raise _fail(f"{where}: chunk {offsets}+{sizes} does not fit the tensor {size}")
        if index.offset is None or tuple(index.offset) != offsets:
            raise _fail(f"{where}: its index does not name its chunk's offsets")
        slot_raw = _get(raw, "slot", list, where)
        if len(slot_raw) != 3:
            raise _fail(f"{where}.slot is not [offset, nbytes, dtype]")
        start, length = _ints(slot_raw[:2], f"{where}.slot")
        slot_dtype = _dtype(slot_raw[2], f"{where}.slot dtype")
        if length != math.prod(sizes) * slot_dtype.itemsize or start + length > nbytes:
            raise _fail(f"{where}: its slot ({start}, {length}) does not hold its chunk or lies "
                        f"outside the {nbytes}-byte buffer")
        if start % slot_dtype.itemsize:
            raise _fail(f"{where}: its slot is not aligned for {slot_dtype}")
        items.append(WriteItem(index=index, type=kind, bytes_io_data=bytes_io,
                               tensor_data=TensorWriteData(
                                   chunk=ChunkStorageMetadata(offsets=torch.Size(offsets),
                                                              sizes=torch.Size(sizes)),
                                   properties=TensorProperties(dtype=dtype),
                                   size=torch.Size(size))))
        if index in slots:
            raise _fail(f"{where}: chunk {fqn}{list(offsets)} is listed twice")
        slots[index] = TensorSlot(offset=start, nbytes=length, dtype=slot_dtype, shape=sizes)
    planner: dict[str, tuple[str | int, ...]] = {}
    for name, path in _get(obj, "planner_data", dict, "layout").items():
        if not isinstance(path, list) or any(isinstance(p, bool) or not isinstance(p, str | int)
                                             for p in path):
            raise _fail(f"layout.planner_data[{name!r}] is not a path of names and indices")
        planner[name] = tuple(path)
    layout = ShardLayout(items=tuple(items), slots=slots, planner_data=planner, nbytes=nbytes,
                         key=key)
    if layout_key(layout.items, layout.slots) != key:
        raise _fail(f"the layout does not match its key {key!r}")
    return layout


def claims(layout: ShardLayout) -> frozenset[Claim]:
    """What a layout says its shard holds."""
    return frozenset((it.index.fqn, None if it.type == WriteItemType.BYTE_IO
                      else tuple(it.tensor_data.chunk.offsets))  # type: ignore[union-attr]
                     for it in layout.items)


def encode_claims(layout: ShardLayout) -> bytes:
    return json.dumps(sorted([n, None if o is None else list(o)] for n, o in claims(layout)),
                      separators=(",", ":")).encode()


def decode_claims(data: bytes) -> frozenset[Claim]:
    obj = _json(data, "the claims", max_bytes=MAX_CLAIMS_BYTES, max_depth=CLAIMS_DEPTH)
    if not isinstance(obj, list):
        raise _fail("the shard's claims are not a list")
    out: set[Claim] = set()
    for i, pair in enumerate(obj):
        if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str):
            raise _fail(f"claim {i} is not [name, offsets]")
        out.add((pair[0], None if pair[1] is None else _ints(pair[1], f"claim {i}")))
    return frozenset(out)


# ---------------------------------------------------------------------------- messages


@dataclass(frozen=True, kw_only=True)
class SnapshotMessage:
    """Everything about one snapshot a peer sends, besides its raw buffer."""

    generation: int
    source: int
    """The sender's rank: whose shard this is."""
    step: int
    nbytes: int
    crc: int
    layout_key: str
    layout: ShardLayout | None
    """Sent with the first snapshot that uses it; later ones name it by key."""
    values: dict[str, Any]


def encode_message(msg: SnapshotMessage) -> bytes:
    obj = {"version": VERSION, "generation": msg.generation, "source": msg.source,
           "step": msg.step, "nbytes": msg.nbytes, "crc": msg.crc, "layout_key": msg.layout_key,
           "layout": None if msg.layout is None else encode_layout(msg.layout),
           "values": {k: encode_value(v) for k, v in msg.values.items()}}
    data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()
    # What the holders would refuse fails here, on the sender, saying why.
    why = out_of_bounds(data, "the snapshot message", MAX_MESSAGE_BYTES, MAX_DEPTH)
    if why is not None:
        raise SnapshotFormatError(f"this rank's snapshot cannot be sent to peers: {why}")
    return data


def decode_message(data: bytes) -> SnapshotMessage:
    obj = _json(data, "the message", max_bytes=MAX_MESSAGE_BYTES, max_depth=MAX_DEPTH)
    if _get(obj, "version", int, "message") != VERSION:
        raise _fail(f"version {obj['version']} is not {VERSION}")
    layout = obj.get("layout")
    msg = SnapshotMessage(
        generation=_get(obj, "generation", int, "message"),
        source=_get(obj, "source", int, "message"), step=_get(obj, "step", int, "message"),
        nbytes=_get(obj, "nbytes", int, "message"), crc=_get(obj, "crc", int, "message"),
        layout_key=_get(obj, "layout_key", str, "message"),
        layout=None if layout is None else decode_layout(layout),
        values={k: decode_value(v, k) for k, v in _get(obj, "values", dict, "message").items()})
    if msg.layout is not None and msg.layout.key != msg.layout_key:
        raise _fail(f"it names layout {msg.layout_key!r} but carries {msg.layout.key!r}")
    if msg.layout is not None and msg.layout.nbytes != msg.nbytes:
        raise _fail(f"its layout holds {msg.layout.nbytes} bytes, its buffer {msg.nbytes}")
    if not 0 <= msg.crc < 1 << 32:
        raise _fail(f"crc {msg.crc} is not a CRC32")
    return msg


def _reject_constant(name: str) -> Any:
    raise _fail(f"JSON constant {name} (non-finite floats travel tagged)")


# A JSON string, escapes included: its brackets are text, not nesting. An unterminated string
# runs to the end (a trailing backslash included), so every match succeeds where it starts and
# the scan stays linear: no retry from each escaped quote of a string that never closes.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_SCAN_CHUNK = 1 << 22  # bytes per numpy pass: bounds the scan's own memory


def nesting_depth(data: bytes) -> int:
    """How deep the arrays and objects of JSON `data` nest, read from its bytes without
    parsing them (no recursion: numpy over the bytes outside strings). Exact for valid JSON;
    for invalid JSON it is the depth up to where the parser will stop."""
    bare = np.frombuffer(_STRING.sub(b"", data), dtype=np.uint8)
    depth = deepest = 0
    for start in range(0, bare.size, _SCAN_CHUNK):
        part = bare[start:start + _SCAN_CHUNK]
        steps = ((part == ord("[")).astype(np.int8) + (part == ord("{"))
                 - (part == ord("]")) - (part == ord("}")))
        levels = np.cumsum(steps, dtype=np.int64) + depth
        deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


def out_of_bounds(data: bytes, what: str, max_bytes: int, max_depth: int) -> str | None:
    """Why JSON `data` is too big or too deep to accept (None: within both bounds)."""
    if len(data) > max_bytes:
        return f"{what}: {len(data)} bytes; at most {max_bytes} are accepted"
    depth = nesting_depth(data)
    if depth > max_depth:
        return f"{what}: {depth} levels of nesting; at most {max_depth} are accepted"
    return None


def _json(data: bytes, what: str, *, max_bytes: int, max_depth: int) -> Any:
    """Peer bytes as JSON, once their size and nesting are within bounds: nothing a peer
    sends reaches a recursion limit or a parse of unbounded size."""
    why = out_of_bounds(data, what, max_bytes, max_depth)
    if why is not None:
        raise _fail(why)
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    # ValueError: JSONDecodeError, and an integer of more digits than Python converts.
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _fail(f"not UTF-8 JSON ({exc})") from None
