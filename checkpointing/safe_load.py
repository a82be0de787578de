"""Loading a DCP checkpoint without running code from it, and only bytes the manifest signed.

DCP reads `.metadata` with `pickle.load` and byte items with `torch.load(weights_only=False)`:
either runs whatever a crafted file asks for. Here `.metadata` is unpickled by an
unpickler that knows only DCP's metadata classes, torch dtypes and layouts; byte items (the
scalars of a checkpoint: step, LR schedule, optimizer settings) load with `weights_only=True`.

Every file is checked as it is read, by the process that loads it: read whole, its size and
sha256 compared with the signed manifest's, and only then handed to DCP (the bytes checked
are the bytes loaded). A file changed after the driver chose the checkpoint is never loaded.
`.metadata` may point only at files the manifest lists, and only inside them.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import os
import pickle
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.layout import METADATA

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


FileTable = dict[str, dict[str, Any]]
"""A signed manifest's `files`: name -> {"size", "sha256"}."""


class VerifiedReader(FsspecReader):
    """DCP's fsspec reader that reads only files the signed manifest lists, each checked
    against its size and sha256 before any of it is used (see the module docstring).

    A file is held in memory while DCP reads from it: one file at a time, the size of one
    rank's shard."""

    def __init__(self, path: str, *, files: FileTable) -> None:
        super().__init__(path)
        self.fs = VerifyingFileSystem(self.fs, path=str(self.path), files=files)
        self._files = files
        self._where = f"checkpoint {path!r}"

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: not what stalwart writes
            raise CheckpointError(f"{self._where}: per-rank metadata is not supported")
        with self.fs.create_stream(self._get_metadata_path(), "rb") as f:
            metadata = load_metadata(f.read(), self._where)
        check_storage_data(metadata, self._files, self._where)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_storage_data(metadata: Metadata, files: FileTable, where: str) -> None:
    """Every place `.metadata` says an item is stored lies inside a file the manifest lists:
    a crafted `relative_path` (`../other_step/...`) or an offset past the end would read
    what no signature covers."""
    for index, info in (metadata.storage_data or {}).items():
        name = getattr(info, "relative_path", None)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        listed = files.get(name) if isinstance(name, str) else None
        if listed is None or name == METADATA:
            raise CheckpointError(f"{where}: .metadata stores {index.fqn!r} in {name!r}, "
                                  f"which is not one of the checkpoint's data files; not "
                                  f"loaded")
        if (not isinstance(offset, int) or not isinstance(length, int) or offset < 0
                or length < 0 or offset + length > listed["size"]):
            raise CheckpointError(f"{where}: .metadata stores {index.fqn!r} at bytes "
                                  f"{offset}+{length} of {name}, which holds "
                                  f"{listed['size']}; not loaded")


class VerifyingFileSystem:
    """A DCP filesystem whose read streams hold a whole file, checked against the manifest
    first. Only files directly in the step directory and listed there can be opened."""

    def __init__(self, inner: Any, *, path: str, files: FileTable) -> None:
        self._inner = inner
        self._root = path.rstrip("/")
        self._files = files

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.BytesIO]:
        if mode != "rb":
            raise CheckpointError(f"checkpoint {self._root!r}: opened for {mode!r} by a load")
        parent, _, name = os.fspath(path).rstrip("/").rpartition("/")
        expected = self._files.get(name)
        where = f"checkpoint {self._root!r}: file {name}"
        if parent.rstrip("/") != self._root or expected is None:
            raise CheckpointError(f"{where} is not listed in its signed manifest; not loaded")
        with self._inner.create_stream(path, "rb") as raw:
            data = raw.read(expected["size"] + 1)
        yield io.BytesIO(checked(data, expected, where))


def checked(data: bytes, expected: dict[str, Any], where: str) -> bytes:
    """`data`, once its size and sha256 are the manifest's (`expected`)."""
    if len(data) != expected["size"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"{where} is damaged: its size or sha256 differs from the "
                              f"signed manifest (changed after it was written); not loaded")
    return data


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
