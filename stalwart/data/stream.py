"""A dataset streamed from files: read a unit at a time, in the order of stalwart.data.order.

Memory stays flat as the dataset grows: a rank holds the units its lanes' current windows
need (an LRU of `lanes x window + window` units) and the files' indexes, never the data.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from stalwart.core.batch import Batch
from stalwart.core.errors import DataError, DataUnavailable
from stalwart.core.stream import SampleIds
from stalwart.data.columns import (
    DecodedUnit,
    decode,
    gather,
    is_dense,
    is_number_list,
    numeric_batch,
)
from stalwart.data.order import StreamOrder, default_lanes
from stalwart.data.sources import FileInfo, Format, Unit, list_files

Transform = Callable[[dict[str, Any]], Batch]
"""Turns one batch of rows (column name -> numpy array, or list for strings) into a batch
for the task's loss. Runs on the reading thread, ahead of the step."""

_READERS = 4  # units read at once (I/O and decoding release the GIL)
# Decoded units outlive an engine: a survivor of a failure builds a new stream for its next
# world and finds what it had read here, keyed by all the units' contents depend on. Two
# streams' worth: a training and a validation stream.
_SHARED: OrderedDict[str, tuple[OrderedDict[int, DecodedUnit], threading.Lock]] = OrderedDict()
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
        self._cache: OrderedDict[int, DecodedUnit] = OrderedDict()
        self._ahead: dict[int, Future[DecodedUnit]] = {}
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
        # This window and the next of every lane, and the tail's.
        self._capacity = 2 * lanes * self.window + self.window + 2
        self._window_span = max(1, total * self.window * lanes // max(1, len(units)))
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
        self._unit_file = np.array([u.file for u in self.units], dtype=np.int64)
        self._unit_first = np.array([u.first_row for u in self.units], dtype=np.int64)
        self._file_urls = tuple(f.url for f in self.files)
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
        columns, entered = self._rows(units, rows)
        if entered:
            # This read entered units it had not held: read the same rows one window further
            # on, so a lane's next window is read while this one trains, not all lanes' at
            # once when they switch.
            self._read_ahead(start + self._window_span, count)
        ids = SampleIds(epoch=epochs, file=self._unit_file[units],
                        row=self._unit_first[units] + rows, files=self._file_urls)
        return self._batch(columns), ids

    def get_batch(self, indices: Any) -> Batch:
        """Rows by their index in file order, for a fixed validation set."""
        units = self._index()
        idx = np.asarray(indices, dtype=np.int64)
        cum = np.cumsum([0] + [u.rows for u in units])
        at = np.searchsorted(cum, idx, side="right") - 1
        return self._batch(self._rows(at, idx - cum[at])[0])

    def _rows(self, units: np.ndarray, rows: np.ndarray) -> tuple[dict[str, Any], bool]:
        """The columns of rows (unit, row in unit), in the order given, and whether a unit
        was not yet held."""
        assert self.schema is not None
        others = [f.name for f in self.schema
                  if (self.columns is None or f.name in self.columns) and not is_dense(f.type)
                  and (self.transform is not None or is_number_list(f.type))]
        decoded, entered = self._decoded(np.unique(units).tolist())
        return gather(decoded, units, rows, others=others), entered

    def _decoded(self, needed: list[int]) -> tuple[dict[int, DecodedUnit], bool]:
        """The units, from the cache, from a read ahead in flight, or read now (in parallel)."""
        with self._lock:
            have = {u: self._cache[u] for u in needed if u in self._cache}
            for u in have:
                self._cache.move_to_end(u)
            ahead = {u: self._ahead.pop(u) for u in needed
                     if u not in have and u in self._ahead}
        for u, future in ahead.items():
            if future.exception() is None:  # a read ahead that failed is read again: its
                have[u] = future.result()    # error is raised by the step that needs it
        missing = [u for u in needed if u not in have]
        if len(missing) > 1:
            have.update(zip(missing, self._readers().map(self._read_unit, missing),
                            strict=True))
        elif missing:
            have[missing[0]] = self._read_unit(missing[0])
        self._keep({u: have[u] for u in missing + list(ahead)}, len(needed))
        return have, bool(missing or ahead)

    def _read_ahead(self, start: int, count: int) -> None:
        assert self.order is not None
        _, units, _ = self.order.locate(np.arange(start, start + count))
        with self._lock:
            wanted = [u for u in np.unique(units).tolist()
                      if u not in self._cache and u not in self._ahead]
            for u in wanted:
                self._ahead[u] = self._readers().submit(self._read_unit, u)

    def _keep(self, decoded: dict[int, DecodedUnit], needed: int) -> None:
        with self._lock:
            for u, unit in decoded.items():
                self._cache[u] = unit
            while len(self._cache) > max(self._capacity, needed):
                self._cache.popitem(last=False)

    def close(self) -> None:
        """Stop reading ahead: reads not started are dropped, reads in flight finished. Call
        it before `ray.shutdown()` in a process that read a `from_ray` stream: a read still
        running a Ray Data pipeline when Ray goes down aborts the process. The stream may be
        read again afterwards."""
        with self._lock:
            pool, self._pool, self._ahead = self._pool, None, {}
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

    def _readers(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_READERS, thread_name_prefix="stalwart-read")
        return self._pool

    def _read_unit(self, u: int) -> DecodedUnit:
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
        return decode(table)

    def _batch(self, columns: dict[str, Any]) -> Batch:
        if self.transform is not None:
            return self.transform(columns)
        assert self.schema is not None
        return numeric_batch(columns, self.schema, self.what)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_cache=OrderedDict(), _lock=None, _pool=None, _ahead={})
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


def _shared_cache(key: str) -> tuple[OrderedDict[int, DecodedUnit], threading.Lock]:
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None:
            entry = _SHARED[key] = (OrderedDict(), threading.Lock())
            while len(_SHARED) > _SHARED_STREAMS:
                _SHARED.popitem(last=False)
        else:
            _SHARED.move_to_end(key)
        return entry


def _same_fields(a: pa.Schema, b: pa.Schema) -> bool:
    return [(f.name, f.type) for f in a] == [(f.name, f.type) for f in b]


def _fields(schema: pa.Schema) -> str:
    return "{" + ", ".join(f"{f.name}: {f.type}" for f in schema) + "}"


def _part_name(fmt: str) -> str:
    return {"parquet": "row group", "arrow": "record batch"}.get(fmt, "chunk")
