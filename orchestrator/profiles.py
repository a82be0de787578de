"""Profiler traces on the driver: each rank's trace, sent back through its poll, written to
RUN_DIR/profile/rank<R>-step<A>-<B>.json (a chrome trace: Perfetto, chrome://tracing).

The name says which steps the file holds, which are the window's (run.profile_steps) unless a
resize, a recovery or a stop cut it (workers/profiling.py). A trace is never overwritten: the
same rank and steps traced again (a world that trained them again after restoring from an
older checkpoint, or a resumed run) take `-2`, `-3`, ... The caller logs `profile_saved`.
"""

from __future__ import annotations

import zlib
from pathlib import Path

from stalwart.core.safe_files import make_dir_nofollow, write_file_atomically
from stalwart.workers.reports import ProfileReport


def trace_path(directory: Path, report: ProfileReport) -> Path:
    """The first free name for this rank and these steps."""
    first, last = report.steps
    stem = f"rank{report.rank}-step{first}-{last}"
    path, n = directory / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = directory / f"{stem}-{n}.json"
    return path


def save_trace(directory: Path, report: ProfileReport) -> Path:
    """Write the trace (whole, or not at all: a reader never sees half a file). A symbolic
    link at profile/ is refused, one at the trace's name replaced: neither is written
    through."""
    make_dir_nofollow(directory)
    path = trace_path(directory, report)
    write_file_atomically(path, zlib.decompress(report.trace_zlib))
    return path
