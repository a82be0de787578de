"""Where checkpoints live in storage, and how a committed one is recognised.

    <storage>/step_000000100/   DCP shard files (*.distcp) and .metadata, written first
    <storage>/step_000000100/manifest.json   written last, once every shard is on storage
    <storage>/owner.json      the run that owns this storage (checkpointing/storage/owner.py)

A directory without manifest.json is an incomplete write (a crash mid-save) and is never
loaded. The manifest lists every file with its size and sha256, checked before a load, and
the number of ranks that wrote it: DCP writes `.metadata` and one `__<rank>_0.distcp` per
rank, and a manifest missing any of them is incomplete.

Step directories are named with at least nine digits, zero-padded (`step_000000100`); a step
of 10^9 or more simply has more digits (`step_1000000000`). Only the canonical name of a step
is a step directory, so no step has two.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

import fsspec
from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

from stalwart.checkpointing.errors import StorageURLError

MANIFEST = "manifest.json"
FORMAT_VERSION = 2
"""2: the optimizer's state keyed by parameter name (1 keyed it by param group index, which
lost a pipeline stage's settings; this version does not load it)."""
METADATA = ".metadata"
_STEP_DIR = re.compile(r"^step_(\d{9,})$")
_DATA_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def step_dir_name(step: int) -> str:
    if step < 0:
        raise ValueError(f"unexpected negative step {step}")
    return f"step_{step:09d}"


def base_name(path: str | os.PathLike) -> str:
    """The last component of a path or URL (fsspec lists full paths)."""
    return os.fspath(path).rstrip("/").rsplit("/", 1)[-1]


def parse_step_dir(name: str) -> int | None:
    base = base_name(name)
    m = _STEP_DIR.match(base)
    if not m:
        return None
    step = int(m.group(1))
    # step_0000000100 would be a second name for step 100: not a step directory.
    return step if step_dir_name(step) == base else None


def data_file_rank(name: str) -> int | None:
    """The rank that wrote a DCP data file (`__<rank>_<n>.distcp`), None for other files."""
    m = _DATA_FILE.match(name)
    return int(m.group(1)) if m else None


EXPORT_PREFIX = "export."
"""A checkpoint's files for exporters (`export.config.json`, ...): TrainTask.export_files."""


def check_file_name(name: object) -> str:
    """A file name from a manifest, safe to join under a directory: one plain path component.

    Anything that copies a checkpoint builds paths from these names, so a crafted name
    (`../x`, `/etc/x`, `a/b`, a NUL) would read or write outside the checkpoint."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name
            or "\\" in name or "\0" in name):
        raise ValueError(f"file name {name!r} is not a plain file name")
    return name


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def filesystem(url: str) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem and in-filesystem path for a storage URL, with clear errors."""
    try:
        fs, path = fsspec.core.url_to_fs(url)
    except ImportError as exc:
        protocol = url.split("://", 1)[0]
        raise StorageURLError(f"checkpoint.storage {url!r}: the filesystem for {protocol}:// "
                              f"is not installed ({exc})") from None
    except ValueError as exc:
        raise StorageURLError(f"checkpoint.storage {url!r}: {exc}; use a local path or an "
                              f"fsspec URL such as file://, s3://, gs://") from None
    except Exception as exc:  # a filesystem whose client fails to load (hdfs:// without a JVM)
        protocol = url.split("://", 1)[0]
        first_line = (str(exc).splitlines() or [""])[0]
        raise StorageURLError(f"checkpoint.storage {url!r}: cannot open the {protocol}:// "
                              f"filesystem: {type(exc).__name__}: {first_line}") from None
    return fs, path


# Where a run directory read as data (export, status) may point its checkpoint storage: local
# disk and the storage services a run can write. A URL of another kind (http://, ftp://, ...)
# would have a copied run directory make this machine send requests where it says.
DATA_STORAGE_PROTOCOLS = ("file", "local", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss",
                          "adl", "hdfs", "oci", "oss")


def check_remote_readable(url: str) -> None:
    """Refuse a run directory's storage URL that export or status must not contact."""
    protocol = url.split("://", 1)[0].lower() if "://" in url else "file"
    if protocol not in DATA_STORAGE_PROTOCOLS:
        raise StorageURLError(f"checkpoint.storage {url!r}: {protocol}:// is not read from a "
                              f"run directory's config; allowed: a local path or "
                              f"{', '.join(p + '://' for p in DATA_STORAGE_PROTOCOLS)}")


def sha256_of(fs: AbstractFileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest_file(fs: AbstractFileSystem, root: str, manifest: dict[str, Any]) -> None:
    _write_atomically(fs, root, json.dumps(manifest, indent=1, sort_keys=True))


def _write_atomically(fs: AbstractFileSystem, root: str, text: str) -> None:
    """The manifest appears whole or not at all, and is on disk before it appears."""
    tmp, final = f"{root}/{MANIFEST}.tmp", f"{root}/{MANIFEST}"
    if isinstance(fs, LocalFileSystem):
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # the data files were synced by DCP before .metadata
        os.replace(tmp, final)
        dir_fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the rename itself survives a power loss
        finally:
            os.close(dir_fd)
        return
    # Other filesystems: closing the file is the upload (object stores make it durable
    # then); mv is a copy+delete of one small object, and readers ignore the .tmp name.
    with fs.open(tmp, "w") as f:
        f.write(text)
    fs.mv(tmp, final)
