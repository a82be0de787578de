"""Where checkpoints live in storage, and how a committed one is recognised.

    <storage>/step_000000100/   DCP shard files (*.distcp) and .metadata, written first
    <storage>/step_000000100/manifest.json   written last, once every shard is on storage

A directory without manifest.json is an incomplete write (a crash mid-save) and is never
loaded. The manifest lists every file with its size and sha256, checked before a load.
"""

from __future__ import annotations

import hashlib
import re

import fsspec
from fsspec import AbstractFileSystem

from stalwart.checkpointing.errors import StorageURLError

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step_(\d{9})$")


def step_dir_name(step: int) -> str:
    return f"step_{step:09d}"


def parse_step_dir(name: str) -> int | None:
    m = _STEP_DIR.match(name.rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


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


def sha256_of(fs: AbstractFileSystem, path: str) -> str:
    digest = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
