"""Typed errors of the public API: each names the input that is wrong and what is allowed."""

from __future__ import annotations

from collections.abc import Sequence


class StalwartError(Exception):
    """Base of every error stalwart raises on purpose; the CLI prints it as one line."""


class ConfigError(StalwartError, ValueError):
    """A config file, key or value is wrong (names the field, the value and what is allowed)."""


class TaskError(StalwartError):
    """The task path does not import, or the task does not satisfy the TrainTask contract."""


class RunDirError(StalwartError):
    """The run directory cannot be used as asked (would overwrite, or holds nothing to resume)."""


class RecordError(StalwartError, ValueError):
    """A record file of a run (events.jsonl, metrics.jsonl, config.toml) is damaged: names the
    file, the line and what is wrong with it."""


class ClusterError(StalwartError):
    """The Ray cluster cannot be reached or cannot hold the requested workers."""


class DeviceUnhealthy(StalwartError):
    """A worker's GPU failed its health check before the worker joined a world: a failure of
    that node's device, not of the task. Names the device, the node and every check that
    failed (workers/device_health.py)."""

    def __init__(self, device: str, reasons: Sequence[str], node_ip: str = "",
                 pid: int | None = None) -> None:
        self.device, self.reasons = device, tuple(reasons)
        self.node_ip, self.pid = node_ip, pid
        super().__init__(f"device {device} unhealthy on node {node_ip or '(unknown)'}: "
                         + "; ".join(self.reasons))

    def __reduce__(self) -> tuple[type, tuple[str, tuple[str, ...], str, int | None]]:
        # Ray pickles it back to the driver; an exception's own reduce would rebuild it from
        # its message alone, which is not this constructor's signature.
        return type(self), (self.device, self.reasons, self.node_ip, self.pid)


class DataError(TaskError):
    """A dataset's files cannot serve the run: missing, unreadable, of another schema, or
    changed since the run started. Names the file (and the row group or line) and the fix."""


class DataUnavailable(DataError):
    """A file the run was reading went away or failed mid-run. The run stops after
    checkpointing the last whole step and resumes from it once the file is back."""
