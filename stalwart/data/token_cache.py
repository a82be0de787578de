"""Tokenize the fine-tuning data once, cache the packed rows on disk, and serve them memory-mapped.

`prepare` reads every row, renders it (stalwart.data.render), packs the documents
(stalwart.data.packing) and writes train and validation arrays as .npy files under
`<cache_dir>/finetune-<key>/`. The key hashes everything the arrays depend on: the tokenizer
files, the data files' contents, seq_len, the packing mode and the validation split, so a
changed input gives a new directory and an unchanged one is reused. Several processes may call
`prepare` at once (every rank of a node): one builds under a file lock, into a temporary
directory renamed into place once complete; `done.json`, written last, marks it complete.

`PackedRows` opens one split with `np.load(mmap_mode="r")`: a data set larger than memory is
read a batch at a time, and a pickled copy (to a worker) carries only the path.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
import zlib
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
from filelock import FileLock

from stalwart.checkpointing.storage.layout import sha256_of
from stalwart.core.errors import TaskError
from stalwart.data.packing import MODES, Packer, PackStats
from stalwart.data.render import check_tokenizer, render
from stalwart.data.rows import data_files, read_rows, row_kind, source_name

# Bump when the layout or the meaning of the arrays changes: old caches are then rebuilt.
FORMAT = 1
ARRAYS = ("input_ids", "labels", "position_ids")
SPLITS = ("train", "val")
# The files of a tokenizer folder that change how it tokenizes; whichever exist are hashed.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "vocab.json", "vocab.txt", "merges.txt",
)
_CHUNK = 1 << 20


def load_tokenizer(tokenizer_dir: str) -> Any:
    """The Hugging Face tokenizer saved in `tokenizer_dir` (local files only, nothing downloaded)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... by case
        raise TaskError(f"the tokenizer at {tokenizer_dir} cannot be loaded ({type(e).__name__}: "
                        f"{e}); give a folder that tokenizer.save_pretrained() wrote, with "
                        f"tokenizer.json or tokenizer.model and tokenizer_config.json") from e


def data_key(*, files: Sequence[str], val_files: Sequence[str], tokenizer_dir: str, seq_len: int,
             mode: str, val_fraction: float, val_data: str | None) -> str:
    """The cache key: a sha256 over everything the packed arrays depend on."""
    h = hashlib.sha256()

    def part(*values: object) -> None:
        h.update(json.dumps(values).encode() + b"\n")

    part("format", FORMAT)
    for name in TOKENIZER_FILES:
        path = Path(tokenizer_dir) / name
        if path.is_file():
            part("tokenizer", name, hashlib.sha256(path.read_bytes()).hexdigest())
    for split, paths in (("data", files), ("val_data", val_files)):
        for path in paths:
            part(split, path, sha256_of(*fsspec.core.url_to_fs(path)))
    part("seq_len", seq_len, "mode", mode, "val_fraction", val_fraction, "val_data", val_data)
    return h.hexdigest()[:24]


def in_val(source: str, number: int, val_fraction: float) -> bool:
    """Whether a row falls in the validation split: a crc32 of its file's name and number,
    the same on every machine and in every process (Python's own hash is salted)."""
    return zlib.crc32(f"{source_name(source)}:{number}".encode()) < val_fraction * 2**32


def prepare(*, data: str, val_data: str | None, val_fraction: float, tokenizer_dir: str,
            seq_len: int, mode: str, cache_dir: str) -> Path:
    """Tokenize and pack the data once; return the cache directory (train/, maybe val/,
    done.json). A second call with the same inputs returns the same directory at once."""
    _check_args(val_fraction=val_fraction, seq_len=seq_len, mode=mode)
    files = data_files(data)
    val_files = data_files(val_data, field="task.args.val_data") if val_data else []
    key = data_key(files=files, val_files=val_files, tokenizer_dir=tokenizer_dir,
                   seq_len=seq_len, mode=mode, val_fraction=val_fraction, val_data=val_data)
    out = Path(cache_dir) / f"finetune-{key}"
    if (out / "done.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if (out / "done.json").is_file():  # another process built it while this one waited
            return out
        _clear_leftovers(out)
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            _build(tmp, files=files, val_files=val_files, data=data, val_data=val_data,
                   val_fraction=val_fraction, tokenizer_dir=tokenizer_dir, seq_len=seq_len,
                   mode=mode, key=key)
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _check_args(*, val_fraction: float, seq_len: int, mode: str) -> None:
    if mode not in MODES:
        raise TaskError(f"packing mode {mode!r} is not one of {', '.join(MODES)}")
    if not 0 <= val_fraction < 1:
        raise TaskError(f"task.args.val_fraction = {val_fraction} is outside [0, 1); it is the "
                        f"share of rows held out for validation (0: none)")
    if seq_len < 2:
        raise TaskError(f"seq_len = {seq_len} is too short; give at least 2 tokens")


def _clear_leftovers(out: Path) -> None:
    # Under the lock, an incomplete directory or temporary build is a crashed build's: no one
    # else is writing it.
    if out.exists():
        shutil.rmtree(out)
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


class _NpyWriter:
    """Appends int32 rows to a raw file, then writes the .npy (header, then the rows) once the
    row count is known, so a split never has to fit in memory."""

    def __init__(self, path: Path) -> None:
        self.path, self.raw = path, path.with_suffix(".raw")
        self._f = open(self.raw, "wb")  # noqa: SIM115 - closed in finish()

    def write(self, row: np.ndarray) -> None:
        self._f.write(np.ascontiguousarray(row, dtype=np.int32).tobytes())

    def finish(self, rows: int, seq_len: int) -> None:
        self._f.close()
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.int32)),
                  "fortran_order": False, "shape": (rows, seq_len)}
        with open(self.path, "wb") as out, open(self.raw, "rb") as raw:
            np.lib.format.write_array_header_1_0(out, header)
            shutil.copyfileobj(raw, out, _CHUNK)
        self.raw.unlink()


class _Split:
    """One split being written: a packer feeding three .npy writers."""

    def __init__(self, directory: Path, seq_len: int, pad_id: int, mode: str) -> None:
        directory.mkdir(parents=True)
        self.directory, self.seq_len = directory, seq_len
        self.packer = Packer(seq_len, pad_id=pad_id, mode=mode)
        self.writers = [_NpyWriter(directory / f"{name}.npy") for name in ARRAYS]

    def add(self, ids: list[int], mask: list[bool]) -> None:
        self._write(self.packer.add(ids, mask))

    def _write(self, rows: list[tuple[np.ndarray, ...]]) -> None:
        for row in rows:
            for writer, array in zip(self.writers, row, strict=True):
                writer.write(array)

    def finish(self) -> PackStats:
        self._write(self.packer.finish())
        for writer in self.writers:
            writer.finish(self.packer.stats.rows, self.seq_len)
        return self.packer.stats


def _build(tmp: Path, *, files: list[str], val_files: list[str], data: str,
           val_data: str | None, val_fraction: float, tokenizer_dir: str, seq_len: int,
           mode: str, key: str) -> None:
    tokenizer = load_tokenizer(tokenizer_dir)
    check_tokenizer(tokenizer, set(), str(tokenizer_dir))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    train = _Split(tmp / "train", seq_len, pad_id, mode)
    val = _Split(tmp / "val", seq_len, pad_id, mode)
    kinds: Counter[str] = Counter()

    def add(row: Any, split: _Split) -> None:
        kind = row_kind(row)
        if kind not in kinds:
            check_tokenizer(tokenizer, {kind}, str(tokenizer_dir))
        kinds[kind] += 1
        split.add(*render(tokenizer, row, kind))

    for row in read_rows(files):
        add(row, val if not val_files and in_val(row.source, row.number, val_fraction) else train)
    for row in read_rows(val_files):
        add(row, val)
    train_stats, val_stats = train.finish(), val.finish()
    if not train_stats.rows:
        raise TaskError(f"task.args.data = {data!r} gives no training rows ({train_stats.docs} "
                        f"documents, {train_stats.dropped} without a token to learn after "
                        f"truncation to seq_len = {seq_len}); give more data or a longer seq_len")
    if val_data and not val_stats.rows:
        raise TaskError(f"task.args.val_data = {val_data!r} gives no validation rows")
    if not val_stats.rows:  # val_fraction 0, or too few rows for any to fall in the split
        shutil.rmtree(tmp / "val")
    done = {"format": FORMAT, "key": key, "data": data, "val_data": val_data,
            "val_fraction": val_fraction, "tokenizer_dir": str(tokenizer_dir),
            "seq_len": seq_len, "mode": mode, "pad_id": int(pad_id), "kinds": dict(kinds),
            "train": train_stats.as_dict(),
            "val": val_stats.as_dict() if val_stats.rows else None}
    (tmp / "done.json").write_text(json.dumps(done, indent=2) + "\n")


def read_stats(directory: str | Path) -> dict:
    """The done.json of a prepared cache directory: its inputs and each split's stats
    (docs, rows, truncated, dropped, tokens, loss_tokens); "val" is None without a split."""
    path = Path(directory) / "done.json"
    if not path.is_file():
        raise TaskError(f"{directory} is not a prepared data cache (no done.json); "
                        f"stalwart.data.token_cache.prepare() writes one")
    return json.loads(path.read_text())


class PackedRows:
    """One split of a prepared cache (`prepare(...) / "train"` or `/ "val"`), as a map-style
    dataset of packed rows. Opened lazily, memory-mapped, in each process that reads it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not all((self.path / f"{name}.npy").is_file() for name in ARRAYS):
            raise TaskError(f"{self.path} holds no packed rows ({', '.join(ARRAYS)} .npy files); "
                            f"give a split directory of prepare()'s output, e.g. <dir>/train")
        self._arrays: dict[str, np.ndarray] | None = None

    def _open(self) -> dict[str, np.ndarray]:
        if self._arrays is None:
            self._arrays = {name: np.load(self.path / f"{name}.npy", mmap_mode="r")
                            for name in ARRAYS}
        return self._arrays

    def __getstate__(self) -> dict:
        return {"path": self.path, "_arrays": None}  # a worker maps the files itself

    def __len__(self) -> int:
        return int(self._open()["input_ids"].shape[0])

    @property
    def seq_len(self) -> int:
        return int(self._open()["input_ids"].shape[1])

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, Any]:
        """Rows `indices` as int64 tensors [len(indices), seq_len]: input_ids, labels,
        position_ids. No attention_mask: the position ids separate the documents."""
        import torch

        index = np.asarray(indices, dtype=np.int64)
        return {name: torch.from_numpy(np.asarray(array[index], dtype=np.int64))
                for name, array in self._open().items()}

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {name: t[0] for name, t in self.get_batch([i]).items()}
