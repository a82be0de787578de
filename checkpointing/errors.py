"""Typed errors of the checkpointing subsystem."""

from __future__ import annotations

from stalwart.core.errors import StalwartError


class CheckpointError(StalwartError):
    """A checkpoint is missing, damaged, or does not fit the model."""


class SnapshotRefused(CheckpointError):
    """A snapshot a peer sent is refused: its step is not the one being exchanged, or its
    sender, shard or chunks are not the sender's own. It never enters the memory tier."""


class SnapshotFormatError(SnapshotRefused):
    """Bytes from a peer are not a well-formed snapshot message (wrong type, shape or size)."""


class SnapshotCorrupt(CheckpointError):
    """A snapshot held in memory no longer matches the CRC32 its owner computed."""


class StorageURLError(StalwartError):
    """checkpoint.storage cannot be used (unknown protocol, filesystem not installed)."""


def describe_load_error(exc: BaseException) -> str:
    """One line for a failed DCP load. DCP's CheckpointException carries each failed rank's
    exception and traceback; the first rank's exception says what went wrong."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, (inner, _trace) = next(iter(sorted(failures.items())))
        return f"rank {rank}: {describe_load_error(inner)}"
    first = (str(exc).strip().splitlines() or [""])[0][:500]
    return f"{type(exc).__name__}: {first}".rstrip(": ")


class CheckpointKeyError(StalwartError):
    """The checkpoint signing key cannot be read or created."""
