"""The run directory's two logs: events.jsonl and metrics.jsonl, written one record a line.

Every room that records what a run did writes through these (the controller, its observers,
the trainer). The schema is stalwart/core/events.py; the run directory itself (its other
files, and the rules for reusing one) is stalwart/run_dir.py on the top floor.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from stalwart.core.events import Event, MetricsRow, dumps
from stalwart.core.safe_files import open_append_nofollow

__all__ = ["EventLog", "JsonlLog", "MetricsLog"]

R = TypeVar("R", Event, MetricsRow)


class JsonlLog(Generic[R]):
    """Appends one record per line and flushes it, so a reader (or a crash) sees whole lines.

    A symbolic link at the log's name is refused (RunDirError), never written through: a run
    directory from someone else may hold one pointing at a file of yours.

    Listeners (a run's callbacks) see each record after it is on disk, on the writer's thread.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.listeners: list[Callable[[R], None]] = []

    def write(self, record: R) -> None:
        line = dumps(record)  # type: ignore[arg-type]
        with self._lock, open_append_nofollow(self.path) as f:
            f.write(line + "\n")
        for listener in self.listeners:
            listener(record)


class EventLog(JsonlLog[Event]):
    """events.jsonl: the run's typed events (stalwart/core/events.py is the schema)."""

    def emit(self, event: Event) -> Event:
        self.write(event)
        return event


class MetricsLog(JsonlLog[MetricsRow]):
    """metrics.jsonl: one MetricsRow per logged step."""
