"""Byte-level training text from the standard library's .py files, as memory-mapped Arrow tokens.

Every Python install ships ~30 MB of real source code, so the example needs
no download: ``build_token_files`` caches it as two uint8 Arrow files (train,
val) and ``TokenDataset`` serves fixed-length windows from them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import sysconfig
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from filelock import FileLock
from torch import Tensor

SEPARATOR = 0  # between files; NUL never occurs in Python source text
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages"})
_DONE = "done"


@dataclass(frozen=True)
class TokenFiles:
    train: Path
    val: Path


def _stdlib_files(root: Path) -> list[tuple[str, Path]]:
    """(posix relative path, path) of every .py file under root, third-party dirs excluded, sorted."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Installed packages live inside the stdlib dir on many systems; they are not "the stdlib"
        # and differ between machines.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath, name)
                found.append((path.relative_to(root).as_posix(), path))
    found.sort()
    return found


def _is_val(relpath: str, val_fraction: float) -> bool:
    # Hash of the path, not position in the list: the split is the same on every machine.
    return zlib.crc32(relpath.encode()) % 10_000 < val_fraction * 10_000


def _stdlib_root() -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"standard library directory not found: {root}")
    return root


@functools.cache
def _stdlib_relpaths() -> tuple[str, ...]:
    return tuple(rel for rel, _ in _stdlib_files(_stdlib_root()))


def split_sizes(val_fraction: float) -> tuple[int, int]:
    """(train, validation) file counts for `val_fraction`, without reading any file: what
    GPTTask checks on the driver, so a split that leaves one side empty fails up front."""
    rels = _stdlib_relpaths()
    n_val = sum(_is_val(rel, val_fraction) for rel in rels)
    return len(rels) - n_val, n_val


def _read_tokens(paths: list[Path]) -> np.ndarray:
    """Concatenated bytes of the files with SEPARATOR between them, as uint8 [n_tokens]."""
    data = bytes([SEPARATOR]).join(p.read_bytes() for p in paths)
    return np.frombuffer(data, dtype=np.uint8)


def _write_arrow(path: Path, tokens: np.ndarray) -> None:
    """Write tokens as one uint8 column in one record batch, atomically via a temp file."""
    batch = pa.record_batch([pa.array(tokens, type=pa.uint8())], names=["tokens"])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    os.replace(tmp, path)


def build_token_files(cache_dir: str | Path, *, val_fraction: float = 0.02) -> TokenFiles:
    """Build (once per Python install) and return the train/val token files under cache_dir."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction!r}")
    root = _stdlib_root()
    files = _stdlib_files(root)
    if not files:
        raise FileNotFoundError(f"no .py files found under the standard library directory {root}")

    # The key changes whenever the source text could: another Python, or edited files.
    listing = [(rel, (st := p.stat()).st_size, st.st_mtime_ns) for rel, p in files]
    blob = json.dumps([sys.version, str(root), listing, val_fraction]).encode()
    key = hashlib.sha256(blob).hexdigest()[:16]

    cache_dir = Path(cache_dir)
    out = cache_dir / key
    result = TokenFiles(train=out / "train.arrow", val=out / "val.arrow")
    if (out / _DONE).exists():  # written last, so both files are complete
        return result

    out.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache_dir / f"{key}.lock")):
        if (out / _DONE).exists():  # another process built it while we waited
            return result
        val = [p for rel, p in files if _is_val(rel, val_fraction)]
        train = [p for rel, p in files if not _is_val(rel, val_fraction)]
        if not val or not train:
            raise ValueError(
                f"val_fraction={val_fraction} puts {len(val)} of {len(files)} files in validation; "
                "both splits must be non-empty"
            )
        _write_arrow(result.train, _read_tokens(train))
        _write_arrow(result.val, _read_tokens(val))
        (out / _DONE).write_text(json.dumps({"train_files": len(train), "val_files": len(val)}))
    return result


class TokenDataset:
    """Windows of seq_len+1 tokens over a memory-mapped Arrow token file."""

    def __init__(self, path: str | Path, seq_len: int):
        if not isinstance(seq_len, int) or seq_len < 1:
            raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
        self.path = Path(path)
        self.seq_len = seq_len
        self._tokens: np.ndarray | None = None
        self._open()  # fail fast on a missing or malformed file

    def _open(self) -> np.ndarray:
        if self._tokens is None:
            # The OS pages the file in on demand and shares it between processes.
            reader = pa.ipc.open_file(pa.memory_map(str(self.path), "r"))
            if reader.num_record_batches != 1:
                raise ValueError(
                    f"{self.path}: expected 1 record batch, got {reader.num_record_batches}"
                )
            column = reader.get_batch(0).column("tokens")
            if column.type != pa.uint8():
                raise ValueError(f"{self.path}: column 'tokens' must be uint8, got {column.type}")
            if column.null_count:
                raise ValueError(f"{self.path}: column 'tokens' has {column.null_count} nulls")
            # [n_tokens] uint8, a view of the mapped file: no copy, no RAM per process.
            # Read from the data buffer directly: Array.to_numpy imports pandas (about half
            # a second of CPU in every worker) to check for extension types.
            self._tokens = np.frombuffer(column.buffers()[1], dtype=np.uint8,
                                         count=len(column), offset=column.offset)
        return self._tokens

    @property
    def n_tokens(self) -> int:
        return len(self._open())

    def __len__(self) -> int:
        return max(0, (self.n_tokens - 1) // self.seq_len)

    def get_batch(self, indices: Sequence[int] | np.ndarray) -> tuple[Tensor, Tensor]:
        """x, y int64 [B, seq_len] for windows starting at i * seq_len; y is x shifted left by one."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)  # [B]
        n = len(self)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise IndexError(
                f"window indices must be in [0, {n}), got min={idx.min()} max={idx.max()}"
            )
        offsets = idx[:, None] * self.seq_len + np.arange(self.seq_len + 1)  # [B, seq_len+1]
        # Fancy indexing copies the windows out of the map, so the tensors own their memory.
        windows = torch.from_numpy(self._open()[offsets]).long()
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()

    # Ship only the path across processes (e.g. to Ray actors); each side maps the file itself.
    def __getstate__(self) -> dict[str, object]:
        return {"path": str(self.path), "seq_len": self.seq_len}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.path = Path(state["path"])
        self.seq_len = state["seq_len"]
        self._tokens = None
