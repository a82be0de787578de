"""A dataset streamed from files: read a unit at a time, in the order of stalwart.data.order.

Memory stays flat as the dataset grows: a rank holds the units its lanes' current windows
need (an LRU of `lanes x window + window` units) and the files' indexes, never the data.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from stalwart.core.batch import Batch
from stalwart.core.errors import DataError, DataUnavailable
from stalwart.core.stream import SampleIds
from stalwart.data.order import StreamOrder, default_lanes
from stalwart.data.sources import FileInfo, Format, Unit, list_files

Transform = Callable[[dict[str, Any]], Batch]
"""Turns one batch of rows (column name -> numpy array, or list for strings) into a batch
for the task's loss. Runs on the reading thread, ahead of the step."""

_READERS = 4  # units read at once (I/O and decoding release the GIL)
# Decoded units outlive an engine: a survivor of a failure builds a new stream for its next
# world and finds what it had read here, keyed by all the units' contents depend on. Two
# streams' worth: a training and a validation stream.
_SHARED: OrderedDict[str, tuple[OrderedDict[int, pa.Table], threading.Lock]] = OrderedDict()
_SHARED_LOCK = threading.Lock()
_SHARED_STREAMS = 2
_INDEXERS = 8  # files indexed at once (one footer request each)


class FileStream:
    """Rows of parquet, Arrow IPC, JSON-lines or text files, in a seeded, resumable order."""

    def __init__(self, fmt: Format, paths: str | Sequence[str], *,
                 columns: Sequence[str] | None = None, transform: Transform | None = None,
                 shuffle: bool = True, window: int = 2, lanes: int | None = None,
                 what: str = "stream", files: Sequence[FileInfo] | None = None) -> None:
        """`files`, when given, are the stream's files as its source names them (a Ray Data
        pipeline's inputs), and `paths` only what the user gave, for the manifest."""
        if window < 1:
            raise DataError(f"{what}: window = {window} must be >= 1 unit")
        if lanes is not None and lanes < 1:
            raise DataError(f"{what}: lanes = {lanes} must be >= 1")
        if transform is not None and not callable(transform):
            raise DataError(f"{what}: transform must be a function of a dict of columns, "
                            f"got {type(transform).__name__}")
        self.fmt, self.what = fmt, what
        self.patterns = [paths] if isinstance(paths, str) else [str(p) for p in paths]
        self.files: list[FileInfo] = (list(files) if files is not None
                                      else list_files(self.patterns, fmt.suffixes, what=what))
        self.columns = list(columns) if columns is not None else None
        self.transform = transform
        self.shuffle, self.window, self.lanes = shuffle, window, lanes
        self.units: list[Unit] | None = None
        self.expected_rows: int | None = None
        """Rows the files must hold, when the caller knows (a Hugging Face dataset)."""
        self.schema: pa.Schema | None = None
        self.order: StreamOrder | None = None
        self._cache: OrderedDict[int, pa.Table] = OrderedDict()
        self._capacity = 2 * window + 2
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ set-up

    def bind(self, *, seed: int, global_batch: int, cache_dir: str) -> None:
        units = self._index(cache_dir)
        total = sum(u.rows for u in units)
        if global_batch > total:
            raise DataError(f"{self.what}: the global batch ({global_batch}) is larger than the "
                            f"dataset ({total} rows in {len(self.files)} file(s)); lower "
                            f"train.global_batch_size or add data")
        # Unshuffled, the rows come in file order unless lanes are asked for.
        lanes = self.lanes or (default_lanes(global_batch, len(units), self.window)
                               if self.shuffle else 1)
        if global_batch % lanes:
            raise DataError(f"{self.what}: lanes = {lanes} must divide the global batch "
                            f"({global_batch})")
        self.order = StreamOrder([u.rows for u in units], seed=seed, global_batch=global_batch,
                                 lanes=lanes, window=self.window, shuffle=self.shuffle)
        self._capacity = lanes * self.window + self.window + 2
        self._cache, self._lock = _shared_cache(
            json.dumps([self.identity(), self.columns], sort_keys=True, default=str))

    def _index(self, cache_dir: str | None = None) -> list[Unit]:
        if self.units is not None:
            return self.units
        if hasattr(self.fmt, "cache_dir") and cache_dir:
            self.fmt.cache_dir = cache_dir
        with ThreadPoolExecutor(min(_INDEXERS, len(self.files))) as pool:
            found = list(pool.map(self._file_units, range(len(self.files))))
        # A file with no rows (a pipeline may filter all of them out) has no schema to match.
        first = next((i for i, (units, _) in enumerate(found) if units), 0)
        schema = found[first][1]
        for (units, other), info in zip(found, self.files, strict=True):
            if units and not _same_fields(other, schema):
                raise DataError(f"{self.what}: {info.url} has schema {_fields(other)}, but "
                                f"{self.files[first].url} has {_fields(schema)}: every file of a "
                                f"stream must have the same columns and types")
        self.schema = schema
        if self.columns:
            missing = [c for c in self.columns if c not in schema.names]
            if missing:
                raise DataError(f"{self.what}: columns {missing} are not in the data; it has "
                                f"{schema.names}")
        self.units = [u for units, _ in found for u in units]
        total = sum(u.rows for u in self.units)
        if self.expected_rows is not None and total != self.expected_rows:
            raise DataError(f"{self.what}: the dataset has {self.expected_rows} rows but its "
                            f"files hold {total}: it is a slice of them (select, shard, "
                            f"train_test_split); save it with save_to_disk and load_from_disk, "
                            f"or call flatten_indices() first")
        if not any(u.rows for u in self.units):
            raise DataError(f"{self.what}: the dataset is empty (0 rows in "
                            f"{len(self.files)} file(s): {self.files[0].url}, ...)")
        return self.units

    def _file_units(self, i: int) -> tuple[list[Unit], pa.Schema]:
        info = self.files[i]
        try:
            return self.fmt.units(i, info)
        except DataError:
            raise
        except (pa.ArrowException, ValueError, OSError, UnicodeDecodeError) as e:
            raise DataError(f"{self.what}: {info.url} is not a readable {self.fmt.name} file: "
                            f"{type(e).__name__}: {e}") from e

    def __len__(self) -> int:
        return sum(u.rows for u in self._index())

    def identity(self) -> dict[str, Any]:
        order = self.order
        return {"data": {
            "format": self.fmt.name, "patterns": self.patterns,
            "files": [[f.url, f.size, f.version] for f in self.files],
            "shuffle": self.shuffle, "window": self.window,
            "lanes": order.lanes if order is not None else self.lanes}}

    # ------------------------------------------------------------------ reading

    def read(self, start: int, count: int) -> tuple[Batch, SampleIds]:
        if self.order is None:
            raise DataError(f"{self.what}: read before bind(); the engine binds a stream to "
                            f"the run's seed and global batch first")
        epochs, units, rows = self.order.locate(np.arange(start, start + count))
        table = self._rows(units, rows)
        assert self.units is not None
        files = np.array([self.units[u].file for u in units.tolist()], dtype=np.int64)
        first = np.array([self.units[u].first_row for u in units.tolist()], dtype=np.int64)
        ids = SampleIds(epoch=epochs, file=files, row=first + rows,
                        files=tuple(f.url for f in self.files))
        return self._batch(table), ids

    def get_batch(self, indices: Any) -> Batch:
        """Rows by their index in file order, for a fixed validation set."""
        units = self._index()
        idx = np.asarray(indices, dtype=np.int64)
        cum = np.cumsum([0] + [u.rows for u in units])
        at = np.searchsorted(cum, idx, side="right") - 1
        return self._batch(self._rows(at, idx - cum[at]))

    def _rows(self, units: np.ndarray, rows: np.ndarray) -> pa.Table:
        """The rows (unit, row in unit), in the order given, from the cache or the files."""
        needed = list(dict.fromkeys(units.tolist()))
        tables = self._tables(needed)
        order = np.argsort(units, kind="stable")
        parts, bounds = [], np.searchsorted(units[order], needed, side="left")
        sorted_rows = rows[order]
        pieces = []
        for u, lo in zip(needed, bounds.tolist(), strict=True):
            hi = lo + int((units == u).sum())
            pieces.append(tables[u].take(pa.array(sorted_rows[lo:hi])))
            parts.append(order[lo:hi])
        inverse = np.empty(len(units), dtype=np.int64)
        inverse[np.concatenate(parts)] = np.arange(len(units))
        return pa.concat_tables(pieces).take(pa.array(inverse))

    def _tables(self, needed: list[int]) -> dict[int, pa.Table]:
        with self._lock:
            have = {u: self._cache[u] for u in needed if u in self._cache}
            for u in have:
                self._cache.move_to_end(u)
        missing = [u for u in needed if u not in have]
        if len(missing) > 1:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(_READERS, thread_name_prefix="stalwart-read")
            have.update(zip(missing, self._pool.map(self._read_unit, missing), strict=True))
        elif missing:
            have[missing[0]] = self._read_unit(missing[0])
        with self._lock:
            for u in missing:
                self._cache[u] = have[u]
            while len(self._cache) > max(self._capacity, len(needed)):
                self._cache.popitem(last=False)
        return have

    def _read_unit(self, u: int) -> pa.Table:
        assert self.units is not None and self.schema is not None
        unit = self.units[u]
        info = self.files[unit.file]
        try:
            table = self.fmt.read(info, unit, self.columns, self.schema)
        except (DataError, DataUnavailable):
            raise
        except FileNotFoundError as e:
            raise DataUnavailable(f"data file {info.url} is gone: {e}") from e
        except (pa.ArrowException, ValueError, OSError, EOFError) as e:
            raise DataUnavailable(
                f"data file {info.url}, {_part_name(self.fmt.name)} {unit.part} (rows "
                f"{unit.first_row}-{unit.first_row + unit.rows - 1}) cannot be read: "
                f"{type(e).__name__}: {e}") from e
        if table.num_rows != unit.rows:
            raise DataUnavailable(f"data file {info.url}, {_part_name(self.fmt.name)} "
                                  f"{unit.part}: {table.num_rows} rows where the index has "
                                  f"{unit.rows}: the file changed since the run started")
        return table

    def _batch(self, table: pa.Table) -> Batch:
        if self.transform is not None:
            return self.transform(columns_of(table))
        return numeric_batch(table, self.what)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_cache=OrderedDict(), _lock=None, _pool=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _shared_cache(key: str) -> tuple[OrderedDict[int, pa.Table], threading.Lock]:
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None:
            entry = _SHARED[key] = (OrderedDict(), threading.Lock())
            while len(_SHARED) > _SHARED_STREAMS:
                _SHARED.popitem(last=False)
        else:
            _SHARED.move_to_end(key)
        return entry


def columns_of(table: pa.Table) -> dict[str, Any]:
    """A table's columns for a transform: numpy arrays, lists for strings and nested values."""
    out: dict[str, Any] = {}
    for name, column in zip(table.column_names, table.columns, strict=True):
        kind = column.type
        if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
            out[name] = column.to_numpy()
        elif _is_numeric_list(kind):
            out[name] = _list_array(column)
        else:
            out[name] = column.to_pylist()
    return out


def numeric_batch(table: pa.Table, what: str) -> dict[str, torch.Tensor]:
    """The default batch: every numeric column (and list of numbers of one length) as a tensor."""
    out: dict[str, torch.Tensor] = {}
    for name, value in columns_of(table).items():
        if isinstance(value, np.ndarray):
            out[name] = torch.from_numpy(np.require(value, requirements=["C", "W"]))
    if not out:
        raise DataError(f"{what}: no numeric column to batch (columns: "
                        f"{', '.join(f'{n}: {t}' for n, t in zip(table.column_names, table.schema.types, strict=True))}); "
                        f"pass transform= to turn rows into tensors (docs/data.md)")
    return out


def _is_numeric_list(kind: pa.DataType) -> bool:
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)
            or pa.types.is_fixed_size_list(kind)):
        return False
    inner = kind.value_type
    return pa.types.is_integer(inner) or pa.types.is_floating(inner)


def _list_array(column: pa.ChunkedArray) -> np.ndarray | list:
    """Lists of one length as a 2-D array; ragged lists as a list of arrays."""
    array = column.combine_chunks()
    lengths = array.value_lengths().to_numpy(zero_copy_only=False)
    values = array.flatten().to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths == lengths[0]).all():
        return values.reshape(len(lengths), int(lengths[0]))
    return np.split(values, np.cumsum(lengths)[:-1])


def _same_fields(a: pa.Schema, b: pa.Schema) -> bool:
    return [(f.name, f.type) for f in a] == [(f.name, f.type) for f in b]


def _fields(schema: pa.Schema) -> str:
    return "{" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "}"


def _part_name(fmt: str) -> str:
    return {"parquet": "row group", "arrow": "record batch"}.get(fmt, "chunk")
