"""Typed errors of the checkpointing subsystem."""

from __future__ import annotations

from stalwart.errors import StalwartError


class CheckpointError(StalwartError):
    """A checkpoint is missing, damaged, or does not fit the model."""


class StorageURLError(StalwartError):
    """checkpoint.storage cannot be used (unknown protocol, filesystem not installed)."""
