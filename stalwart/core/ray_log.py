"""Ray's own messages during a run go to RUN_DIR/ray.log, not to the user's console.

Besides the workers' output, Ray's driver prints what its daemons log and the errors the
raylet and GCS publish: a paragraph for each worker that died (which guesses at the OOM
killer whatever killed it), one for each node marked dead. stalwart handles those faults and
prints one line of its own for each; Ray's account of them is kept in ray.log, next to
events.jsonl. The workers' own output (the task's prints, its logging, warnings) stays on the
console, as Ray prefixes it with the rank's actor name: it is the task's, and Ray cannot tell
it apart from anything else a worker process writes.
"""

from __future__ import annotations

import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

from stalwart.core.errors import RunDirError
from stalwart.core.ray_private import route_driver_printing
from stalwart.core.safe_files import open_append_nofollow

RAY_LOG = "ray.log"
# Ray's batches from its daemons, and the errors its raylet and GCS publish (as "raylet").
RAY_SOURCES = frozenset({"raylet", "gcs_server", "autoscaler"})
# Seconds a run's log still takes Ray's messages after the run: Ray reports the workers its
# end killed a moment later, from another thread. Bounded, so that a process that goes on
# using Ray (a notebook) gets Ray's messages on its console again.
LINGER_S = 10.0
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")

_routes: list[RayLog] = []  # the runs of this process that route Ray's messages, newest last
_lock = threading.Lock()


class RayLog:
    """While entered, and for LINGER_S after, Ray's own messages on this driver are appended
    to `path`.

    Nothing is written, and the file not created, until Ray says something. Runs in one
    process nest (a run inside a callback, tests): the newest run still running gets them,
    else the newest that ended within LINGER_S. Without Ray loaded there is nothing to
    route, and nothing is imported."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.ended_at: float | None = None
        self._partial = ""
        self._write_lock = threading.Lock()

    def __enter__(self) -> RayLog:
        if "ray" in sys.modules and route_driver_printing(_route):
            with _lock:
                _routes.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ended_at = time.monotonic()

    # -- the file Ray prints to (its printing threads call these)

    def write(self, text: str) -> int:
        """Whole lines are appended, stamped with the time and without Ray's colours. A
        log that cannot be written (a symbolic link planted there, which is never written
        through, a full disk) leaves the lines on the console: Ray's printing thread must
        not die, and nothing Ray says is lost."""
        with self._write_lock:
            lines = (self._partial + _COLOUR.sub("", text)).split("\n")
            self._partial = lines.pop()
            if lines:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                try:
                    with open_append_nofollow(self.path) as f:
                        f.writelines(f"{stamp} {line}\n" for line in lines)
                except (OSError, RunDirError):
                    sys.stderr.writelines(f"{line}\n" for line in lines)
        return len(text)

    def flush(self) -> None:
        """Lines are written as they end."""


def _route(data: dict[str, Any]) -> RayLog | None:
    """Where one of Ray's batches goes: a run's ray.log for Ray's own, else None (the
    console)."""
    if data.get("pid") not in RAY_SOURCES:
        return None
    now = time.monotonic()
    with _lock:
        _routes[:] = [r for r in _routes if r.ended_at is None or now - r.ended_at < LINGER_S]
        running = [r for r in _routes if r.ended_at is None]
        return (running or _routes or [None])[-1]
