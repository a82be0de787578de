"""The run that owns a storage: one storage, one run.

    <storage>/owner.json   {"run_id": ..., "task": ..., "run_dir": ...}

Written when a run first creates its storage, before any worker starts, so that a second
run pointed at the same storage is refused even before the first commit (two runs writing
one storage would each retain, and so delete, the other's steps). On a local filesystem the
record is created with O_EXCL: of two runs starting at once, exactly one claims it. Other
filesystems have no exclusive create in fsspec: the record is read back after writing and
the run that does not find itself in it stops.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from fsspec.implementations.local import LocalFileSystem

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.layout import filesystem

OWNER = "owner.json"


@dataclass(frozen=True, kw_only=True)
class Owner:
    run_id: str
    """A uuid the run writes into its run dir (run_id) at its start; --resume keeps it."""
    task: str
    run_dir: str


def read_owner(url: str) -> Owner | None:
    """The storage's owner, or None when no run has claimed it."""
    fs, root = filesystem(url)
    try:
        with fs.open(f"{root.rstrip('/')}/{OWNER}", "r") as f:
            data = json.load(f)
        return Owner(run_id=str(data["run_id"]), task=str(data.get("task", "")),
                     run_dir=str(data.get("run_dir", "")))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointError(f"checkpoint.storage {url!r}: {OWNER} is damaged ({exc}); "
                              f"delete it only if no other run uses this storage") from None


def claim(url: str, owner: Owner) -> Owner:
    """Make `owner` the storage's owner unless a run already is; returns the owner now."""
    fs, root = filesystem(url)
    path = f"{root.rstrip('/')}/{OWNER}"
    text = json.dumps(asdict(owner), indent=1, sort_keys=True)
    if isinstance(fs, LocalFileSystem):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            return read_owner(url) or owner
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return owner
    current = read_owner(url)
    if current is not None:
        return current
    fs.pipe(path, text.encode())
    return read_owner(url) or owner
