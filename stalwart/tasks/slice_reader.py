"""Reading a rank's slices of safetensors files straight into its shards, for DCP.

DCP's Hugging Face reader maps each file and copies every slice twice (into a new tensor,
then into the shard). Mapped pages around a slice stay in the rank's RSS, up to a whole
multi-GB file. Here a file is opened plainly and its header parsed once. A slice of whole
rows in the shard's own dtype is read with pread(2) into the shard's memory: one pass,
nothing mapped. Other slices (a column split, another dtype) go through safetensors with
its pread backend and one converting copy.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
from typing import Any

import torch
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.futures import Future

from stalwart.core.errors import TaskError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
MAX_HEADER = 100 * 2**20  # safetensors' own bound on a header


class SliceReader(HuggingFaceStorageReader):
    def read_data(self, plan: Any, planner: Any) -> Future:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        for name, items in per_file.items():
            _read_file(name, items, planner)
        done: Future = Future()
        done.set_result(None)
        return done


def _read_file(name: str, items: list[Any], planner: Any) -> None:
    with contextlib.ExitStack() as stack:
        f = stack.enter_context(open(name, "rb", buffering=0))
        header, base = _header(f, name)
        size = os.fstat(f.fileno()).st_size
        fallback = None
        for req in items:
            dest = planner.resolve_tensor(req).detach()
            span = _row_span(header.get(req.storage_index.fqn), req, dest, base)
            if span is not None:
                start, length = span
                if start + length > size:
                    raise TaskError(f"task.args.model: {name} is truncated: tensor "
                                    f"{req.storage_index.fqn!r} ends past the file's end")
                _pread_into(f.fileno(), dest, start, name)
            else:  # a column slice or another dtype: safetensors reads, copy_ converts
                if fallback is None:
                    from safetensors import safe_open

                    fallback = stack.enter_context(
                        safe_open(name, framework="pt", backend="pread"))
                slices = tuple(slice(o, o + n)
                               for o, n in zip(req.storage_offsets, req.lengths, strict=True))
                dest.copy_(fallback.get_slice(req.storage_index.fqn)[slices])
            planner.commit_tensor(req, dest)


def _header(f: Any, name: str) -> tuple[dict[str, Any], int]:
    """The file's tensor table and where its data starts."""
    raw = f.read(8)
    (length,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
    if not 0 < length <= MAX_HEADER:
        raise TaskError(f"task.args.model: {name} is not a safetensors file (bad header)")
    try:
        header = json.loads(f.read(length))
    except ValueError:
        raise TaskError(f"task.args.model: {name} has a damaged safetensors header") from None
    return header, 8 + length


def _row_span(meta: Any, req: Any, dest: torch.Tensor, base: int) -> tuple[int, int] | None:
    """(file offset, bytes) of a slice of whole rows stored in `dest`'s dtype, which can be
    read straight into `dest`; None for any other slice."""
    if not isinstance(meta, dict) or DTYPES.get(meta.get("dtype")) != dest.dtype:
        return None
    shape, offsets = meta.get("shape"), meta.get("data_offsets")
    if not dest.is_contiguous() or not isinstance(shape, list) or not shape \
            or not isinstance(offsets, list) or len(offsets) != 2:
        return None
    if list(req.lengths[1:]) != shape[1:] or any(req.storage_offsets[1:]):
        return None
    row = math.prod(shape[1:]) * dest.element_size()
    start = base + offsets[0] + req.storage_offsets[0] * row
    length = req.lengths[0] * row
    if length != dest.numel() * dest.element_size() or offsets[0] + (
            req.storage_offsets[0] + req.lengths[0]) * row > offsets[1]:
        return None
    return start, length


def _pread_into(fd: int, dest: torch.Tensor, start: int, name: str) -> None:
    view = memoryview(dest.view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], start + done)
        if got == 0:
            raise TaskError(f"task.args.model: {name} ended while being read (truncated?)")
        done += got
