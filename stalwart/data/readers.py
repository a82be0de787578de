"""The stream constructors a task returns from `train_dataset` / `val_dataset`.

Each takes files, directories or globs (local paths or fsspec URLs such as `s3://b/x/*.parquet`)
and the same options: `columns` to read, a batch `transform`, `shuffle`, the shuffle `window`
(units per lane shuffled together) and `lanes` (see stalwart.data.order and docs/data.md).
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
    return FileStream(ArrowFormat(), files, columns=columns, transform=transform,
                      shuffle=shuffle, window=window, lanes=lanes, what="from_huggingface")
