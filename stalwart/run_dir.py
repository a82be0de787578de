"""The run directory: the files a run leaves for its user (an interface; see README).

    config.toml     the resolved JobConfig (defaults filled in, overrides applied)
    events.jsonl    one JSON object per line: {"time", "kind", ...fields}
    metrics.jsonl   one row per logged step: step, loss, lr, tokens_per_s, world_size, time,
                    window_s, ...
    checkpoints/    storage checkpoints, unless checkpoint.storage points elsewhere

A run directory that already holds checkpoints is never reused without --resume, so no run
can overwrite another's work.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from stalwart.checkpointing.storage.catalog import list_step_dirs
from stalwart.config import JobConfig, dump_config
from stalwart.errors import RunDirError


class JsonlWriter:
    """Appends one JSON object per line and flushes it, so a reader (or a crash) sees whole lines.

    Listeners (a run's callbacks) see each row after it is on disk, on the writer's thread.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def write(self, row: dict[str, Any]) -> None:
        line = json.dumps(row, default=str)
        with self._lock, self.path.open("a") as f:
            f.write(line + "\n")
        for listener in self.listeners:
            listener(row)


class EventLog(JsonlWriter):
    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        row = {"time": time.time(), "kind": kind, **fields}
        self.write(row)
        return row


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every row of a JSONL file, which a running (or crashed) writer may have left with a
    half-written last line: that one is left out. A damaged line before it still raises."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = [line for line in text.splitlines() if line.strip()]
    rows = [json.loads(line) for line in lines[:-1]]
    if lines:
        try:
            rows.append(json.loads(lines[-1]))
        except json.JSONDecodeError:
            if text.endswith("\n"):  # a whole line the writer finished: damaged, not partial
                raise
    return rows


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.config_file = path / "config.toml"
        self.events = EventLog(path / "events.jsonl")
        self.metrics = JsonlWriter(path / "metrics.jsonl")

    @staticmethod
    def default_path(config: JobConfig) -> Path:
        return Path("runs") / f"{config.run.name}-{datetime.now():%Y%m%d-%H%M%S}"

    def storage_url(self, config: JobConfig) -> str:
        return config.checkpoint.storage or str((self.path / "checkpoints").resolve())

    def check_new(self, storage_url: str) -> None:
        """Refuse to start a fresh run where one already left checkpoints."""
        steps = list_step_dirs(storage_url)
        if steps:
            raise RunDirError(f"{storage_url} already holds checkpoints (steps "
                              f"{[s for s, _ in steps][-3:]}); pass --resume to continue that "
                              f"run, or choose another --run-dir")
        if self.config_file.exists():
            raise RunDirError(f"run dir {self.path} already holds a run (config.toml); pass "
                              f"--resume to continue it, or choose another --run-dir")

    def check_resumable(self) -> None:
        if not self.path.is_dir():
            raise RunDirError(f"run dir {self.path} does not exist")
        if not self.config_file.exists():
            raise RunDirError(f"run dir {self.path} holds no config.toml, so no "
                              f"run to resume")

    def write_config(self, config: JobConfig) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        tmp = self.config_file.with_suffix(".toml.tmp")
        tmp.write_text(dump_config(config))
        tmp.replace(self.config_file)
