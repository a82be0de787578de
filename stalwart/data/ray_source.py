"""A Ray Data pipeline as a stream's format: one unit per input file, read by running the
pipeline on that file alone (stalwart owns the order, Ray Data runs the transforms).

A unit's row count is the pipeline's output for its file, which a filter or flat_map may
change, so each file is run once to count it (the index pass, files in parallel). The counts
are cached under `data.cache_dir`, keyed by the file's URL, size and version and by the
pipeline's fingerprint: a restart does not run the pipeline to count again.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa

from stalwart.core.errors import DataError, DataUnavailable
from stalwart.data.ray_plan import WHAT, RayPlan, SourceFile
from stalwart.data.sources import FileInfo, Format, Unit, load_index, stat_file, store_index
from stalwart.data.stream import FileStream, Transform

_STATS = 16  # files stat'ed at once (one metadata request each)


class RayFormat(Format):
    """Units and reads of a checked Ray Data pipeline (stalwart.data.ray_plan)."""

    name, suffixes = "ray", ()

    def __init__(self, plan: RayPlan, files: Sequence[SourceFile]) -> None:
        self.plan = plan
        self.sources = {f.url: f for f in files}
        self.cache_dir: str | None = None
        self.plan_key = hashlib.sha256(plan.fingerprint.encode()).hexdigest()[:16]

    def units(self, file: int, info: FileInfo) -> tuple[list[Unit], pa.Schema]:
        key = self._key(info)
        cached = _cached(load_index(self.cache_dir, key))
        if cached is None:
            cached = self.plan.count(self.sources[info.url])
            store_index(self.cache_dir, key, {"rows": cached[0],
                                               "schema": _encode(cached[1])})
        rows, schema = cached
        return ([Unit(file, 0, 0, rows)] if rows else []), schema or pa.schema([])

    def _key(self, info: FileInfo) -> FileInfo:
        """The file's index key with the pipeline in it: another pipeline counts again."""
        return FileInfo(info.url, info.size, f"{info.version}|ray-plan:{self.plan_key}")

    def read(self, info: FileInfo, unit: Unit, columns: list[str] | None,
             schema: pa.Schema) -> pa.Table:
        table = self.plan.read(self.sources[info.url])
        if table.num_rows != unit.rows:
            raise DataUnavailable(
                f"{WHAT}: the pipeline gave {table.num_rows} rows for {info.url} where the "
                f"index pass counted {unit.rows}: the pipeline is not deterministic or the "
                f"file changed since it was indexed")
        table = _conform(table, schema, info.url)
        return table.select(columns) if columns else table


class RayStream(FileStream):
    """A FileStream over a Ray Data pipeline's input files; its identity names the pipeline."""

    fmt: RayFormat

    def identity(self) -> dict[str, Any]:
        out = super().identity()
        out["data"]["plan"] = self.fmt.plan_key
        return out


def ray_stream(dataset: Any, *, columns: Sequence[str] | None, transform: Transform | None,
               shuffle: bool, window: int, lanes: int | None) -> RayStream:
    plan = RayPlan(dataset)
    files = plan.files()
    fmt = RayFormat(plan, files)
    return RayStream(fmt, plan.source_paths() or [f.url for f in files], columns=columns,
                     transform=transform, shuffle=shuffle, window=window, lanes=lanes,
                     what=WHAT, files=_infos(files))


def _infos(files: Sequence[SourceFile]) -> list[FileInfo]:
    """Each file's size and version, as the resume check reads them (fsspec)."""
    with ThreadPoolExecutor(min(_STATS, len(files))) as pool:
        stats = list(pool.map(lambda f: stat_file(f.url), files))
    missing = [f.url for f, s in zip(files, stats, strict=True) if s is None]
    if missing:
        raise DataError(f"{WHAT}: {len(missing)} of the dataset's files cannot be stat'ed "
                        f"through fsspec ({', '.join(missing[:3])}): check that they exist "
                        f"and that fsspec's filesystem for their scheme is installed")
    return [FileInfo(f.url, size, version)
            for f, (size, version) in zip(files, stats, strict=True)]  # type: ignore[misc]


def _conform(table: pa.Table, schema: pa.Schema, url: str) -> pa.Table:
    """The table in the index's schema: units of one stream are concatenated together."""
    if table.schema.equals(schema, check_metadata=True):
        return table
    if table.num_rows == 0 and not table.num_columns:
        return schema.empty_table()
    try:
        return table.select(schema.names).cast(schema)
    except (KeyError, pa.ArrowException, ValueError) as e:
        raise DataUnavailable(
            f"{WHAT}: the pipeline's output for {url} has columns "
            f"{dict(zip(table.column_names, map(str, table.schema.types), strict=True))} where "
            f"the index pass found {dict(zip(schema.names, map(str, schema.types), strict=True))}: "
            f"the pipeline is not deterministic or the file changed ({e})") from e


def _cached(index: dict[str, Any] | None) -> tuple[int, pa.Schema | None] | None:
    """(rows, schema) from a cached index entry, or None if it is missing or unreadable."""
    if index is None or not isinstance(index.get("rows"), int):
        return None
    try:
        return index["rows"], _decode(index.get("schema"))
    except (ValueError, pa.ArrowException):
        return None


def _encode(schema: pa.Schema | None) -> str | None:
    return None if schema is None else base64.b64encode(
        schema.serialize().to_pybytes()).decode()


def _decode(text: str | None) -> pa.Schema | None:
    if not text:
        return None
    return pa.ipc.read_schema(pa.py_buffer(base64.b64decode(text)))
