"""Reading fine-tuning rows: which files `task.args.data` names, their rows, and each row's shape.

A row is one JSON object (a JSON line, a parquet row, or a whole .txt file) in one of three
shapes: chat `messages`, a `prompt` with its `completion`, or plain `text`. Files are read
lazily, a line or a record batch at a time, so a data set larger than memory streams through.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import fsspec

from stalwart.core.errors import TaskError
from stalwart.data.sources import url_of

SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
KINDS = ("messages", "prompt_completion", "text")
SHAPES = ('{"messages": [{"role": str, "content": str}, ...]} with at least one assistant '
          'message, {"prompt": str, "completion": str}, or {"text": str}')
# Parquet rows come out a record batch at a time: bounded memory, few Python round trips.
_PARQUET_BATCH = 1024


@dataclass(frozen=True)
class Row:
    """One row: the file it came from, its 1-based line (JSONL) or row (parquet) number, its value."""

    source: str
    number: int
    value: dict

    @property
    def where(self) -> str:
        return f"{self.source}:{self.number}"


def data_files(data: str, *, field: str = "task.args.data") -> list[str]:
    """The data files `data` names, sorted: a file, a directory (the data files directly in it),
    a glob, or an fsspec URL of any of those. Local files come back as paths, others as URLs."""
    try:
        fs, _, paths = fsspec.core.get_fs_token_paths(data)
    except (ValueError, ImportError, OSError) as e:
        raise TaskError(f"{field} = {data!r} cannot be opened: {e}") from e
    files: list[str] = []
    for path in paths:
        if fs.isdir(path):
            files += _directory_files(fs, path)
        elif fs.isfile(path):
            _check_suffix(path, data, field)
            files.append(path)
    if not files:
        raise TaskError(f"{field} = {data!r} matches no data file; give a file, a directory or "
                        f"a glob of {', '.join(SUFFIXES)} files (local or an fsspec URL)")
    return sorted(url_of(fs, f) for f in set(files))


def _directory_files(fs: Any, path: str) -> list[str]:
    # Only the files directly inside: a data directory's subfolders (caches, old versions)
    # are not silently pulled in. Files of other kinds (README, .DS_Store) are skipped.
    return [p for p in fs.ls(path, detail=False)
            if fs.isfile(p) and p.endswith(SUFFIXES) and not _basename(p).startswith(".")]


def _check_suffix(path: str, data: str, field: str) -> None:
    if not path.endswith(SUFFIXES):
        raise TaskError(f"{field} = {data!r} matches {path!r}, whose suffix is not a data "
                        f"file's; allowed: {', '.join(SUFFIXES)}")


def _basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def read_rows(files: Iterable[str]) -> Iterator[Row]:
    """Every row of `files`, in order. Blank JSON lines are skipped (the numbering counts them)."""
    for path in files:
        if path.endswith(".parquet"):
            yield from _parquet_rows(path)
        elif path.endswith(".txt"):
            with fsspec.open(path, "r", encoding="utf-8-sig") as f:
                yield Row(path, 1, {"text": f.read()})
        else:
            yield from _json_rows(path)


def _json_rows(path: str) -> Iterator[Row]:
    with fsspec.open(path, "r", encoding="utf-8-sig") as f:
        if path.endswith(".json") and _first_char(f) == "[":
            # A .json file holding one array of rows, as many exporters write it.
            yield from _json_array_rows(path, f.read())
            return
        for number, line in enumerate(f, start=1):
            if line.strip():
                yield Row(path, number, _parse(line, path, number))


def _first_char(f: Any) -> str:
    start = f.tell()
    head = f.read(64).lstrip()
    f.seek(start)
    return head[:1]


def _json_array_rows(path: str, text: str) -> Iterator[Row]:
    values = _parse(text, path, 1)
    for number, value in enumerate(values, start=1):
        yield Row(path, number, value)


def _parse(text: str, path: str, number: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TaskError(f"{path}:{number} is not valid JSON ({e.msg} at column {e.colno}); each "
                        f"line of a .jsonl file must be one JSON object") from e


def _parquet_rows(path: str) -> Iterator[Row]:
    import pyarrow.parquet as pq

    with fsspec.open(path, "rb") as f:
        number = 0
        for batch in pq.ParquetFile(f).iter_batches(batch_size=_PARQUET_BATCH):
            for value in batch.to_pylist():
                number += 1
                yield Row(path, number, value)


def row_kind(row: Row) -> str:
    """The row's shape: "messages", "prompt_completion" or "text"; a TaskError for anything else."""
    value = row.value
    if not isinstance(value, dict):
        raise TaskError(f"{row.where} is a JSON {type(value).__name__}, not an object; allowed "
                        f"rows: {SHAPES}")
    if value.get("messages") is not None:  # None: a parquet column that this row leaves empty
        _check_messages(row, value["messages"])
        return "messages"
    if isinstance(value.get("prompt"), str) and isinstance(value.get("completion"), str):
        return "prompt_completion"
    if isinstance(value.get("text"), str):
        return "text"
    keys = ", ".join(sorted(str(k) for k, v in value.items() if v is not None)) or "(none)"
    raise TaskError(f"{row.where} has keys {keys}, which are no row shape stalwart reads; "
                    f"allowed rows: {SHAPES}")


def _check_messages(row: Row, messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise TaskError(f"{row.where}: messages must be a non-empty list of "
                        f'{{"role": str, "content": str}}, got {_short(messages)}')
    for i, message in enumerate(messages):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise TaskError(f"{row.where}: messages[{i}] = {_short(message)} is not "
                            f'{{"role": str, "content": str}}')
    if not any(m["role"] == "assistant" for m in messages):
        roles = ", ".join(m["role"] for m in messages)
        raise TaskError(f"{row.where}: messages has no assistant message (roles: {roles}); the "
                        f"loss is taken on assistant messages, so each row needs at least one")


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def source_name(source: str) -> str:
    """A file's name without its folder or URL: what the validation split hashes, so the split
    stays the same when the data set moves (another mount point, a copy on another node)."""
    return os.path.basename(source.rstrip("/"))
