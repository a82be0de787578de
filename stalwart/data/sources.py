"""Streamed files: which files a pattern names, each file's units, and reading one unit.

A unit is the smallest piece a stream reads at once: a parquet row group, an Arrow IPC record
batch, or a chunk of JSON or text lines. Each file's units (their row counts, and byte ranges
for line files) come from its footer, or from one scan that is cached under `data.cache_dir`
keyed by the file's URL, size and version, so a restart never scans again.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa

from stalwart.core.errors import DataError, DataUnavailable

# A chunk of lines ends after this many rows or bytes, whichever comes first.
LINES_PER_UNIT = 8192
BYTES_PER_UNIT = 16 << 20
_SCAN_BLOCK = 16 << 20


@dataclass(frozen=True)
class FileInfo:
    url: str
    size: int
    version: str
    """The store's ETag or modification time: a file rewritten in place changes it."""

    def key(self) -> str:
        return hashlib.sha256(f"{self.url}|{self.size}|{self.version}".encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Unit:
    file: int
    """Index into the stream's file list."""
    part: int
    """Row group, record batch or chunk number inside the file."""
    first_row: int
    """The unit's first row, counted from the file's start."""
    rows: int
    start: int = 0
    end: int = 0
    """Byte range (line files and Arrow streams); 0, 0 for formats with a footer."""


def list_files(patterns: str | Sequence[str], suffixes: tuple[str, ...], *, what: str
               ) -> list[FileInfo]:
    """The files `patterns` name, sorted by URL: files, directories (every matching file
    below them) or globs, local or any fsspec URL. Every named file must exist."""
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [os.fspath(patterns)]
    if not patterns:
        raise DataError(f"{what}: no paths given; give files, directories or globs of "
                        f"{', '.join(suffixes)} files")
    found: dict[str, FileInfo] = {}
    for pattern in patterns:
        pattern = os.fspath(pattern)
        try:
            fs, _, paths = fsspec.core.get_fs_token_paths(pattern)
        except (ValueError, ImportError, OSError) as e:
            raise DataError(f"{what}: {pattern!r} cannot be opened: {e}") from e
        if not paths and not any(c in pattern for c in "*?["):
            raise DataError(f"{what}: {pattern!r} does not exist")
        for path in paths:
            try:
                details = _details(fs, path, suffixes)
            except FileNotFoundError:
                raise DataError(f"{what}: {pattern!r} does not exist") from None
            if not details and not fs.isdir(path) and not path.endswith(suffixes):
                raise DataError(f"{what}: {path!r} is not a {' / '.join(suffixes)} file")
            for p, info in details.items():
                url = url_of(fs, p)
                found[url] = FileInfo(url, int(info.get("size") or 0), version_of(info))
    if not found:
        raise DataError(f"{what}: {list(patterns)} match no {' / '.join(suffixes)} file")
    return [found[u] for u in sorted(found)]


def _details(fs: Any, path: str, suffixes: tuple[str, ...]) -> dict[str, dict]:
    info = fs.info(path)
    if info.get("type") == "directory":
        return {p: i for p, i in fs.find(path, detail=True).items()
                if i.get("type") != "directory" and p.endswith(suffixes)
                and not any(part.startswith((".", "_")) for part in p.split("/")[-1:])}
    return {path: info} if path.endswith(suffixes) else {}


def version_of(info: dict) -> str:
    """A file's version as its store reports it: ETag, generation or modification time."""
    for key in ("ETag", "etag", "md5Hash", "generation", "mtime", "LastModified", "created"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


def stat_file(url: str) -> tuple[int, str] | None:
    """(size, version) of the file at `url`, None when it cannot be found."""
    try:
        fs, path = fsspec.core.url_to_fs(url)
        info = fs.info(path)
    except (FileNotFoundError, OSError):
        return None
    return int(info.get("size") or 0), version_of(info)


def url_of(fs: Any, path: str) -> str:
    """A listed path as stalwart names files: a plain path on this machine, else a URL."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return path if "file" in protocols or "local" in protocols else fs.unstrip_protocol(path)


def local_path(url: str) -> str | None:
    """The path of a file on this machine's file system, None for any other URL."""
    if url.startswith("file://"):
        return url[len("file://"):]
    return None if "://" in url else url


def open_file(url: str) -> Any:
    """A binary file object, or DataUnavailable naming the file."""
    try:
        return fsspec.open(url, "rb").open()
    except (FileNotFoundError, PermissionError, OSError) as e:
        raise DataUnavailable(f"data file {url} cannot be read: {type(e).__name__}: {e}") from e


class Format(ABC):
    """How one kind of file is split into units and read."""

    name = ""
    suffixes: tuple[str, ...] = ()

    @abstractmethod
    def units(self, file: int, info: FileInfo) -> tuple[list[Unit], pa.Schema]:
        """The file's units and its schema."""

    @abstractmethod
    def read(self, info: FileInfo, unit: Unit, columns: list[str] | None,
             schema: pa.Schema) -> pa.Table:
        """One unit's rows."""


class ParquetFormat(Format):
    name, suffixes = "parquet", (".parquet", ".parq", ".pq")

    def __init__(self) -> None:
        self._meta: dict[str, Any] = {}  # url -> FileMetaData, kept from the index
        self._lock = threading.Lock()

    def units(self, file: int, info: FileInfo) -> tuple[list[Unit], pa.Schema]:
        import pyarrow.parquet as pq

        with open_file(info.url) as f:
            meta = pq.ParquetFile(f).metadata
        with self._lock:
            self._meta[info.url] = meta
        units, first = [], 0
        for i in range(meta.num_row_groups):
            rows = meta.row_group(i).num_rows
            units.append(Unit(file, i, first, rows))
            first += rows
        return units, meta.schema.to_arrow_schema()

    def read(self, info: FileInfo, unit: Unit, columns: list[str] | None,
             schema: pa.Schema) -> pa.Table:
        import pyarrow.parquet as pq

        with self._lock:
            meta = self._meta.get(info.url)
        local = local_path(info.url)
        if local is not None:  # Arrow's own file reader: a quarter faster than a Python file
            try:
                return pq.ParquetFile(local, metadata=meta).read_row_group(unit.part,
                                                                           columns=columns)
            except FileNotFoundError as e:
                raise DataUnavailable(f"data file {info.url} cannot be read: "
                                      f"FileNotFoundError: {e}") from e
        with open_file(info.url) as f:
            return pq.ParquetFile(f, metadata=meta).read_row_group(unit.part, columns=columns)


class ArrowFormat(Format):
    """Arrow IPC: the file format (a footer lists the record batches) or the stream format
    (Hugging Face `datasets` cache files), whose batches are found by one scan."""

    name, suffixes = "arrow", (".arrow", ".feather", ".ipc", ".arrows")

    def units(self, file: int, info: FileInfo) -> tuple[list[Unit], pa.Schema]:
        with open_file(info.url) as f:
            try:
                reader = pa.ipc.open_file(f)
            except pa.ArrowInvalid:
                f.seek(0)
                return self._stream_units(file, f)
            units, first = [], 0
            for i in range(reader.num_record_batches):
                rows = reader.get_batch(i).num_rows
                units.append(Unit(file, i, first, rows))
                first += rows
            return units, reader.schema

    def _stream_units(self, file: int, f: Any) -> tuple[list[Unit], pa.Schema]:
        reader = pa.ipc.open_stream(f)
        schema_end = f.tell()
        units, first, start = [], 0, schema_end
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            end = f.tell()
            units.append(Unit(file, len(units), first, batch.num_rows, start, end))
            first += batch.num_rows
            start = end
        return units, reader.schema

    def read(self, info: FileInfo, unit: Unit, columns: list[str] | None,
             schema: pa.Schema) -> pa.Table:
        with open_file(info.url) as f:
            if unit.end == 0:
                table = pa.Table.from_batches([pa.ipc.open_file(f).get_batch(unit.part)])
            else:
                head = f.read(_schema_length(f))
                f.seek(unit.start)
                body = f.read(unit.end - unit.start)
                table = pa.ipc.open_stream(io.BytesIO(head + body)).read_all()
        return table.select(columns) if columns else table


def _schema_length(f: Any) -> int:
    f.seek(0)
    reader = pa.ipc.open_stream(f)
    del reader
    end = f.tell()
    f.seek(0)
    return end


class LinesFormat(Format):
    """JSON lines (`json`) or plain text (`text`, one row {"text": line} per line). Blank
    lines are skipped; a row's number counts the rows before it in its file."""

    def __init__(self, kind: str, cache_dir: str | None = None) -> None:
        self.name = kind
        self.suffixes = (".jsonl", ".json", ".ndjson") if kind == "json" else (".txt",)
        self.cache_dir = cache_dir

    def units(self, file: int, info: FileInfo) -> tuple[list[Unit], pa.Schema]:
        cached = load_index(self.cache_dir, info)
        if cached is None:
            cached = self._scan(info)
            store_index(self.cache_dir, info, cached)
        units = [Unit(file, i, first, rows, start, end)
                 for i, (first, rows, start, end) in enumerate(cached["units"])]
        if self.name == "text":
            return units, pa.schema([("text", pa.string())])
        schema = self._read_lines(info, units[0], None) if units else None
        return units, schema.schema if schema is not None else pa.schema([])

    def _scan(self, info: FileInfo) -> dict[str, Any]:
        """Every chunk's first row, rows and byte range: one pass of newline search."""
        units: list[list[int]] = []
        rows = first = start = offset = 0
        carry = b""
        with open_file(info.url) as f:
            while True:
                block = f.read(_SCAN_BLOCK)
                if not block:
                    break
                data = carry + block
                base = offset - len(carry)
                ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 10)
                line_start = 0
                for e in ends.tolist():
                    if data[line_start:e].strip():
                        rows += 1
                    line_start = e + 1
                    here = base + line_start
                    if rows >= LINES_PER_UNIT or (rows and here - start >= BYTES_PER_UNIT):
                        units.append([first, rows, start, here])
                        first, rows, start = first + rows, 0, here
                carry = data[line_start:]
                offset += len(block)
        if carry.strip():
            rows += 1
        if rows:
            units.append([first, rows, start, offset])
        return {"units": units}

    def read(self, info: FileInfo, unit: Unit, columns: list[str] | None,
             schema: pa.Schema) -> pa.Table:
        table = self._read_lines(info, unit, schema if self.name == "json" else None)
        if table.num_rows != unit.rows:
            raise DataError(f"data file {info.url}, rows {unit.first_row}-"
                            f"{unit.first_row + unit.rows - 1}: read {table.num_rows} rows where "
                            f"the index has {unit.rows}: the file changed since it was indexed")
        return table.select(columns) if columns else table

    def _read_lines(self, info: FileInfo, unit: Unit, schema: pa.Schema | None) -> pa.Table:
        with open_file(info.url) as f:
            f.seek(unit.start)
            data = f.read(unit.end - unit.start)
        if self.name == "text":
            lines = [s for s in data.decode("utf-8-sig" if unit.start == 0 else "utf-8")
                     .splitlines() if s.strip()]
            return pa.table({"text": pa.array(lines, pa.string())})
        import pyarrow.json as pj

        options = pj.ParseOptions(explicit_schema=schema) if schema is not None else None
        return pj.read_json(io.BytesIO(data), parse_options=options,
                            read_options=pj.ReadOptions(block_size=max(1 << 20, len(data) + 1)))


def _index_path(cache_dir: str | None, info: FileInfo) -> str | None:
    if not cache_dir:
        return None
    return os.path.join(os.path.expanduser(cache_dir), "stream-index", info.key() + ".json")


def load_index(cache_dir: str | None, info: FileInfo) -> dict[str, Any] | None:
    path = _index_path(cache_dir, info)
    try:
        with open(path) as f:  # type: ignore[arg-type]
            data = json.load(f)
        return data if data.get("url") == info.url else None
    except (TypeError, OSError, ValueError):
        return None


def store_index(cache_dir: str | None, info: FileInfo, index: dict[str, Any]) -> None:
    path = _index_path(cache_dir, info)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"url": info.url, **index}, f)
        os.replace(tmp, path)  # several ranks of a node may index the same file at once
    except OSError:
        pass  # a cache that cannot be written only costs the next start a scan
