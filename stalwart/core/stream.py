"""The contract between a streamed dataset (stalwart.data) and the engine that reads it.

A map-style dataset (`len`, `get_batch(indices)`) is ordered by the engine's GlobalSampler.
A stream orders itself: the engine binds it to the run's seed and global batch, then asks for
the batch of global sample positions [start, start + count) of that order. Both report each
sample's identity (epoch, file, row) for the data ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

if TYPE_CHECKING:  # torch stays out of what the node agents import
    from stalwart.core.batch import Batch


@dataclass(frozen=True)
class SampleIds:
    """Which samples a batch holds, in batch order: `epoch`, an index into `files`, and the
    row in that file (a map-style dataset's item index, with `files` = ("",))."""

    epoch: np.ndarray
    file: np.ndarray
    row: np.ndarray
    files: tuple[str, ...]


@runtime_checkable
class StreamDataset(Protocol):
    def bind(self, *, seed: int, global_batch: int, cache_dir: str) -> None:
        """Fix the order (reads the files' indexes); called once per engine, before reads."""

    def __len__(self) -> int:
        """Samples per epoch."""

    def read(self, start: int, count: int) -> tuple[Batch, SampleIds]:
        """The batch of global positions [start, start + count) of the bound order."""

    def get_batch(self, indices: Any) -> Batch:
        """Rows by their index in file order (for a fixed validation set)."""

    def identity(self) -> dict[str, Any]:
        """What the order depends on (files with their sizes and versions, order options):
        recorded in every manifest, compared on resume."""
