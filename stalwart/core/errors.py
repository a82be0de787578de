"""Typed errors of the public API: each names the input that is wrong and what is allowed."""

from __future__ import annotations


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
