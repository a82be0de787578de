"""The stream constructors a task returns from `train_dataset` / `val_dataset`.

Each takes files, directories or globs (local paths or fsspec URLs such as `s3://b/x/*.parquet`)
and the same options: `columns` to read, a batch `transform`, `shuffle`, the shuffle `window`
(units per lane shuffled together) and `lanes` (see stalwart.data.order and docs/data.md).
`from_ray` takes a Ray Data pipeline over files instead of paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from stalwart.data.sources import ArrowFormat, LinesFormat, ParquetFormat
from stalwart.data.stream import FileStream, Transform


def read_parquet(paths: str | Sequence[str], *, columns: Sequence[str] | None = None,
                 transform: Transform | None = None, shuffle: bool = True, window: int = 2,
                 lanes: int | None = None) -> FileStream:
    """Parquet files, a row group at a time."""
    return FileStream(ParquetFormat(), paths, columns=columns, transform=transform,
                      shuffle=shuffle, window=window, lanes=lanes, what="read_parquet")


def read_arrow(paths: str | Sequence[str], *, columns: Sequence[str] | None = None,
               transform: Transform | None = None, shuffle: bool = True, window: int = 2,
               lanes: int | None = None) -> FileStream:
    """Arrow IPC files (file or stream format), a record batch at a time."""
    return FileStream(ArrowFormat(), paths, columns=columns, transform=transform,
                      shuffle=shuffle, window=window, lanes=lanes, what="read_arrow")


def read_json(paths: str | Sequence[str], *, columns: Sequence[str] | None = None,
              transform: Transform | None = None, shuffle: bool = True, window: int = 2,
              lanes: int | None = None) -> FileStream:
    """JSON-lines files (one object per line), a chunk of lines at a time."""
    return FileStream(LinesFormat("json"), paths, columns=columns, transform=transform,
                      shuffle=shuffle, window=window, lanes=lanes, what="read_json")


def read_text(paths: str | Sequence[str], *, transform: Transform | None = None,
              shuffle: bool = True, window: int = 2, lanes: int | None = None) -> FileStream:
    """Text files, one row {"text": line} per non-blank line; `transform` tokenizes them."""
    return FileStream(LinesFormat("text"), paths, transform=transform, shuffle=shuffle,
                      window=window, lanes=lanes, what="read_text")


def from_huggingface(dataset: Any, *, columns: Sequence[str] | None = None,
                     transform: Transform | None = None, shuffle: bool = True,
                     window: int = 2, lanes: int | None = None) -> FileStream:
    """A Hugging Face `datasets.Dataset` backed by local Arrow files (`load_dataset`,
    `load_from_disk`), streamed from those files."""
    from stalwart.core.errors import DataError

    files = [f["filename"] for f in getattr(dataset, "cache_files", None) or []]
    if not files:
        raise DataError("from_huggingface: the dataset has no Arrow files on disk (an "
                        "in-memory dataset); save it with dataset.save_to_disk(path) and "
                        "load_from_disk(path), or write parquet with dataset.to_parquet(path)")
    if getattr(dataset, "_indices", None) is not None:
        raise DataError("from_huggingface: the dataset has an indices mapping (select, "
                        "shuffle, filter or train_test_split); call "
                        "dataset.flatten_indices() first so its files hold its rows")
    stream = FileStream(ArrowFormat(), files, columns=columns, transform=transform,
                        shuffle=shuffle, window=window, lanes=lanes, what="from_huggingface")
    # A contiguous select() or a shard() is a slice of the same files, with no indices
    # mapping: the files would then hold more rows than the dataset.
    stream.expected_rows = len(dataset)
    return stream


def from_ray(dataset: Any, *, columns: Sequence[str] | None = None,
             transform: Transform | None = None, shuffle: bool = True, window: int = 2,
             lanes: int | None = None) -> FileStream:
    """A Ray Data pipeline over files (`ray.data.read_parquet(...).map_batches(f)...`),
    streamed a file at a time: stalwart orders the files and rows, and Ray Data runs the
    pipeline on each file when the stream reads it (docs/data-ray.md).

    After the read, only operations that map each file's rows on their own are allowed:
    map, map_batches, filter, flat_map, add_column, drop_columns, select_columns,
    rename_columns, with_column. Their functions must be deterministic (the same rows for the
    same file every time): each file is run once to count its rows, and again whenever the
    stream reads it. Operations that mix files or reorder rows (random_shuffle, sort, groupby,
    union, zip, join, limit, repartition with shuffle, ...) and sources that are not files
    (from_items, range, from_pandas, ...) are refused with what to do instead.

    A sample's row in the data ledger is its row in the pipeline's output for its file.
    """
    from stalwart.data.ray_source import ray_stream

    return ray_stream(dataset, columns=columns, transform=transform, shuffle=shuffle,
                      window=window, lanes=lanes)
