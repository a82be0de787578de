"""Writes into a directory someone else may have filled: none follows a symbolic link there.

A run directory can come from someone else (copied, shared, handed over) with links planted
at the names stalwart writes (config.toml -> ~/.bashrc). Whole files are written under a
fresh name in the same directory (mkstemp: unpredictable, O_EXCL) and renamed over their
name: a rename replaces a link itself, never the file it points at. Append-only logs are
opened with O_NOFOLLOW: a link there is refused, as is anything but a regular file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, TextIO

from stalwart.core.errors import RunDirError

__all__ = ["make_dir_nofollow", "new_mode", "open_append_nofollow", "replacing",
           "write_file_atomically"]

# O_NONBLOCK: a FIFO planted at the name fails the open (ENXIO) instead of blocking the
# writer until someone reads it; a regular file ignores the flag.
_APPEND_FLAGS = (os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
                 | os.O_NONBLOCK)


def _refused(path: Path, what: str) -> str:
    return (f"{path} is {what}; stalwart writes there only to a regular file and never "
            f"through a symbolic link: remove it, or choose another directory")


def _umask() -> int:
    """The process's umask, read without changing it (os.umask sets it, for every thread)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_mode(*, directory: bool = False) -> int:
    """The mode open() or mkdir() gives a new file or directory under the process's umask:
    for what is written under a private name (mkstemp, mkdtemp: 0600, 0700) and then handed
    over as an ordinary file."""
    return (0o777 if directory else 0o666) & ~_umask()


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[BinaryIO]:
    """A binary file for `path`'s new contents. A clean exit renames it over `path` (a link
    there is replaced, its target untouched); an exception leaves `path` as it was."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file 0600; the file it replaces was made as open() makes one.
        os.fchmod(fd, new_mode())
        with os.fdopen(fd, "wb") as f:
            fd = -1  # the file object owns it now
            yield f
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_file_atomically(path: Path, data: str | bytes) -> None:
    """Write `path` whole (str as UTF-8): a reader sees the old file or the new one, and a
    symbolic link at `path` is replaced by the file, never written through."""
    with replacing(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def open_append_nofollow(path: Path, *,
                         error: type[Exception] = RunDirError) -> TextIO:
    """`path` opened to append UTF-8 text (created if missing). A symbolic link, a FIFO or
    anything else but a regular file at `path` is `error`, naming it."""
    try:
        fd = os.open(path, _APPEND_FLAGS, 0o666)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EMLINK) and path.is_symlink():
            raise error(_refused(path, "a symbolic link")) from None
        if exc.errno == errno.ENXIO:  # a FIFO with no reader
            raise error(_refused(path, "not a regular file")) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(_refused(path, "not a regular file"))
    return os.fdopen(fd, "a", encoding="utf-8")


def make_dir_nofollow(path: Path, *, error: type[Exception] = RunDirError) -> Path:
    """`path` as a directory, made with its parents if missing. A symbolic link at `path` is
    `error`: the files written under it would land wherever it points."""
    if path.is_symlink():  # mkdir(exist_ok=True) would accept a link to a directory
        raise error(_refused(path, "a symbolic link"))
    path.mkdir(parents=True, exist_ok=True)
    return path
