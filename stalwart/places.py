"""The places a run writes (its run dir, its checkpoint storage): made absolute, and probed
with a real write before anything starts, leaving nothing behind.

Permission bits do not say whether a write works (root ignores them; /proc, a read-only
mount or an HTTP server refuse anyway), so each place is tried: the directories the run would
make are made, a probe file is written in the deepest and removed, and the directories made
for the probe are removed again. A refused run leaves the disk as it found it.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from pathlib import Path

from fsspec.implementations.local import LocalFileSystem

from stalwart.checkpointing.errors import StorageURLError
from stalwart.checkpointing.storage.layout import filesystem, join
from stalwart.core.errors import RunDirError, StalwartError

PROBE_PREFIX = ".stalwart-write-probe-"
LOCAL_PROTOCOLS = ("file", "local")


def absolute_storage(storage: str, cwd: Path | None = None) -> str:
    """A relative local checkpoint.storage made absolute against `cwd` (default: the current
    directory); anything else unchanged.

    Workers resolve a relative path against their own working directory, which on a cluster
    (`--address`) is not the driver's: they would write somewhere else, each node in its own
    place. The driver resolves it once, as it does the default `<run dir>/checkpoints`.
    """
    protocol, sep, rest = storage.partition("://")
    if not sep:
        protocol, rest = "", storage
    elif protocol not in LOCAL_PROTOCOLS:
        return storage
    if not rest:
        return storage  # empty: <run dir>/checkpoints, resolved by RunDir.storage_url
    path = Path(rest).expanduser()
    if path == Path(rest) and path.is_absolute():
        return storage
    if not path.is_absolute():
        path = ((cwd or Path.cwd()) / path).resolve()
    return f"{protocol}://{path}" if sep else str(path)


def probe_local_dir(path: Path, what: str, error: type[StalwartError]) -> None:
    """Refuse a local directory that cannot be made or written into; `what` names it in the
    message ("run dir runs/x"). Leaves the disk as it was."""
    base = path
    try:
        while not base.exists() and base != base.parent:
            base = base.parent
    except OSError as exc:
        raise error(f"{what} cannot be checked: {exc.strerror or exc}") from None
    if not base.is_dir():
        where = "is a file" if base == path else f"is under {base}, a file"
        raise error(f"{what} {where}, not a directory; choose another path")
    made: list[Path] = []
    try:
        for parent in reversed([path, *path.parents]):
            try:
                if parent.exists():  # raises on a name too long for the filesystem
                    continue
                parent.mkdir()
            except FileExistsError:  # made meanwhile by another process
                continue
            except OSError as exc:
                raise error(f"{what} is not writable: cannot create the directory {parent}: "
                            f"{exc.strerror or exc}") from None
            made.append(parent)
        try:
            fd, probe = tempfile.mkstemp(prefix=PROBE_PREFIX, dir=path)
        except OSError as exc:
            raise error(f"{what} is not writable: cannot create a file in {path}: "
                        f"{exc.strerror or exc}") from None
        os.close(fd)
        os.unlink(probe)
    finally:
        for d in reversed(made):
            try:
                d.rmdir()
            except OSError:  # filled meanwhile by another process: never ours to remove
                break


def probe_storage(url: str) -> None:
    """Refuse a checkpoint.storage that cannot be written: a local path as a directory (see
    probe_local_dir); any other filesystem by writing a probe object under it and removing
    it (object stores need no directories; a filesystem with directories gets the storage
    directory made, as the run would make it)."""
    what = f"checkpoint.storage {url!r}"
    fs, path = filesystem(url)
    if isinstance(fs, LocalFileSystem):
        probe_local_dir(Path(path), what, StorageURLError)
        return
    probe = join(path, f"{PROBE_PREFIX}{uuid.uuid4().hex}")
    try:
        try:
            fs.pipe_file(probe, b"")
        except FileNotFoundError:
            fs.makedirs(path, exist_ok=True)
            fs.pipe_file(probe, b"")
        fs.rm_file(probe)
    except Exception as exc:  # any filesystem's own error type (read-only, auth, network)
        first_line = (str(exc).splitlines() or [""])[0]
        raise StorageURLError(f"{what} is not writable: {type(exc).__name__}: "
                              f"{first_line}") from None


def probe_run_dir(path: Path) -> None:
    probe_local_dir(path, f"run dir {path}", RunDirError)
