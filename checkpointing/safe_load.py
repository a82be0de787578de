"""Loading a DCP checkpoint without running code from it.

DCP reads `.metadata` with `pickle.load` and byte items with `torch.load(weights_only=False)`:
either runs whatever a crafted file asks for. Here `.metadata` is unpickled by an
unpickler that knows only DCP's metadata classes, torch dtypes and layouts, and only once
its bytes match the sha256 that the signed manifest gives; byte items (the scalars of a
checkpoint: step, LR schedule, optimizer settings) load with `weights_only=True`.
"""

from __future__ import annotations

import functools
import hashlib
import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from stalwart.checkpointing.errors import CheckpointError

_DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by name (torch.strided, ...)
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # a checkpoint_id written by FileSystemWriter
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _DCP_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None),
                                            torch.dtype | torch.layout | torch.memory_format):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint's metadata")


def load_metadata(data: bytes, where: str) -> Metadata:
    """A `.metadata` file's content as DCP's Metadata, refusing anything else."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # UnpicklingError, EOFError, a class refused above, ...
        raise CheckpointError(f"{where}: .metadata is not DCP metadata "
                              f"({type(exc).__name__}: {exc}); not loaded") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where}: .metadata holds a {type(metadata).__name__}, not "
                              f"DCP metadata; not loaded")
    return metadata


class VerifiedReader(FsspecReader):
    """DCP's fsspec reader, with `.metadata` checked against the manifest's sha256 and
    read by the restricted unpickler (nothing is read twice: the bytes checked are the
    bytes loaded)."""

    def __init__(self, path: str, *, metadata_sha256: str) -> None:
        super().__init__(path)
        self._expected = metadata_sha256
        self._where = f"checkpoint {path!r}"

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: not what stalwart writes
            raise CheckpointError(f"{self._where}: per-rank metadata is not supported")
        with self.fs.create_stream(self._get_metadata_path(), "rb") as f:
            data = f.read()
        if hashlib.sha256(data).hexdigest() != self._expected:
            raise CheckpointError(f"{self._where}: .metadata differs from the manifest's "
                                  f"sha256 (changed after it was verified); not loaded")
        metadata = load_metadata(data, self._where)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


@functools.cache
def _numpy_scalar_globals() -> list[Any]:
    """What a numpy scalar in a scheduler's or optimizer's state pickles as: numpy's scalar
    constructor (from raw bytes) and its dtypes, nothing that runs other code."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    return [core.multiarray.scalar, np.dtype,
            *(getattr(np.dtypes, n) for n in dir(np.dtypes) if n.endswith("DType"))]


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, with byte items loaded as data only (weights_only, plus
    numpy scalars)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        with torch.serialization.safe_globals(_numpy_scalar_globals()):
            loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                        loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
