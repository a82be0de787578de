"""Each rank hashes the files it writes as the bytes go out, so the commit never reads a
checkpoint back.

`HashingWriter` is DCP's fsspec writer with two additions:
- every file it opens for writing goes through a `HashingStream`, which feeds each write to
  sha256 and counts the bytes before passing them on;
- each rank's digests travel to the coordinator (rank 0) inside DCP's own gather of write
  results, and `finish` takes them out again before `.metadata` is written (so `.metadata` is
  byte for byte what plain DCP writes). After `finish`, the coordinator's `digests` name every
  file of the checkpoint, its own `.metadata` included.

Why these hooks: both are DCP's documented extension points, not its internals. Every file a
filesystem writer writes (data files and `.metadata`) is opened through
`FileSystemBase.create_stream`; `write_data` returns a future of `WriteResult`s that DCP
hands, uninterpreted, to the coordinator's `finish` (`storage_data: Any` is the storage's
own). Hooking `_write_files_from_queue` or `_write_item` would be simpler today but those are
private and change between torch releases. If a future torch stopped opening files through
`self.fs`, the digests would be missing, not wrong: the commit then fails loudly, naming the
files no writer hashed (`write_manifest` signs only what the writers wrote).
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from stalwart.checkpointing.storage.layout import base_name

DIGEST_FQN = "stalwart.file_digest"
"""The fqn of the write results that carry digests (never a state-dict key: they are taken
out before `.metadata` is written)."""


@dataclass(frozen=True, kw_only=True)
class FileDigest:
    """A file as its writer wrote it."""

    name: str
    """Its name in the step directory."""
    size: int
    sha256: str


class HashingStream:
    """A write stream that hashes and counts what passes through it, and otherwise behaves
    as the stream under it (close closes it: for an object store that is the upload).

    The digest is of the file only if it was written front to back; a seek elsewhere marks
    it `sequential = False` and the caller must not use it (DCP writes sequentially today)."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self._sha = hashlib.sha256()
        self.size = 0
        self.sequential = True

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return bool(self._raw.seekable())

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self._raw.write(view)
        n = len(view) if n is None else n  # a buffered stream takes all of it
        self._sha.update(view[:n])
        self.size += n
        return n

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        pos = self._raw.seek(offset, whence)
        if pos != self.size:  # anything but a no-op seek to the end written so far
            self.sequential = False
        return pos

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()  # DCP fsyncs through it

    def close(self) -> None:
        self._raw.close()

    @property
    def closed(self) -> bool:
        return bool(self._raw.closed)

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


class HashingFileSystem:
    """A DCP filesystem (`FileSystemBase`) whose write streams hash what they write.

    Delegates everything to the filesystem it wraps; records a digest per file name once its
    stream closed without error; a rename carries the digest along (`.metadata` is written
    as `.metadata.tmp` and renamed), a removal drops it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._lock = threading.Lock()  # DCP may write files from several threads
        self._digests: dict[str, FileDigest] = {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not set yet (a copy being built): no delegation loop
            raise AttributeError(name)
        return getattr(self._inner, name)

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[Any, None, None]:
        with self._inner.create_stream(path, mode) as stream:
            if not any(ch in mode for ch in "wax+"):
                yield stream
                return
            hashing = HashingStream(stream)
            yield hashing
        # Only a stream closed without error reaches here (on error the opener removes the
        # file, and no digest is recorded).
        if hashing.sequential:
            name = base_name(path)
            with self._lock:
                self._digests[name] = FileDigest(name=name, size=hashing.size,
                                                 sha256=hashing.hexdigest())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self._inner.rename(path, new_path)
        with self._lock:
            digest = self._digests.pop(base_name(path), None)
            self._digests.pop(base_name(new_path), None)
            if digest is not None:
                name = base_name(new_path)
                self._digests[name] = FileDigest(name=name, size=digest.size,
                                                 sha256=digest.sha256)

    def rm_file(self, path: str | os.PathLike) -> None:
        self._inner.rm_file(path)
        with self._lock:
            self._digests.pop(base_name(path), None)

    def take(self) -> list[FileDigest]:
        """The digests recorded since the last take."""
        with self._lock:
            out, self._digests = list(self._digests.values()), {}
        return out


class HashingWriter(FsspecWriter):
    """DCP's fsspec writer that hashes every file as it writes it (see the module docstring).

    One instance per save. On the coordinator, after the save: `digests`, name -> digest of
    every file the save wrote on any rank."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.fs = HashingFileSystem(self.fs)
        self.digests: dict[str, FileDigest] = {}

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.fs.take()  # nothing from an earlier use of this writer
        written = super().write_data(plan, planner)
        # `then`: read the digests when the write is complete, even if a future torch
        # completes this future later than it returns it.
        return written.then(lambda done: [*done.value(), *self._digest_results()])

    def _digest_results(self) -> list[WriteResult]:
        return [WriteResult(index=MetadataIndex(DIGEST_FQN, index=i), size_in_bytes=d.size,
                            storage_data=d) for i, d in enumerate(self.fs.take())]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        digests, plain = {}, []
        for rank_results in results:
            kept = []
            for result in rank_results:
                if isinstance(result.storage_data, FileDigest):
                    digests[result.storage_data.name] = result.storage_data
                else:
                    kept.append(result)
            plain.append(kept)
        super().finish(metadata, plain)
        digests.update({d.name: d for d in self.fs.take()})  # .metadata, written just now
        self.digests = digests
