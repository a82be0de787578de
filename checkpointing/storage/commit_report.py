"""CommitReport: a storage checkpoint is complete. Its own module, free of torch, because it
travels in every worker's poll answer and whoever unpickles one imports this module (the node
agents do, and they must start in a fraction of a second)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CommitReport:
    """A storage checkpoint is complete and visible (its manifest is written)."""

    step: int
    path: str
    save_s: float
    """Seconds from the start of the save to the manifest being written."""
    cleared: tuple[str, ...] = ()
    """Files the step directory held before the save began, removed so that the manifest
    signs only what this save wrote (an earlier attempt's, or planted ones)."""
