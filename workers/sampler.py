"""The global sample order: a pure function of (seed, global sample index).

A run consumes the stream of global sample indices 0, 1, 2, ...; step s takes the next
`global_batch_size` of them and each data-parallel rank takes a contiguous slice. Which
dataset item a global index maps to depends only on the seed and the index (a fresh
permutation per epoch), never on rank or world size. So after any resize or restore the
run continues at the exact next sample: none is skipped and none is seen twice. The data
position stored in every checkpoint is just `samples_seen`.
"""

from __future__ import annotations

import numpy as np


class GlobalSampler:
    def __init__(self, num_items: int, *, seed: int, shuffle: bool = True) -> None:
        if num_items < 1:
            raise ValueError(f"the dataset is empty (num_items={num_items})")
        self.num_items = num_items
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def _permutation(self, epoch: int) -> np.ndarray:
        # Cached for the current epoch: a step almost always stays inside one epoch.
        if epoch != self._epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_items)
            else:
                self._perm = np.arange(self.num_items)
            self._epoch = epoch
        assert self._perm is not None
        return self._perm

    def items(self, start: int, count: int) -> np.ndarray:
        """Dataset item indices for global sample indices [start, start + count)."""
        out = np.empty(count, dtype=np.int64)
        pos = 0
        while pos < count:
            index = start + pos
            epoch, offset = divmod(index, self.num_items)
            take = min(count - pos, self.num_items - offset)
            out[pos : pos + take] = self._permutation(epoch)[offset : offset + take]
            pos += take
        return out


def rank_slice(step_start: int, global_batch: int, dp_rank: int, dp_size: int) -> tuple[int, int]:
    """(start, count) of the global sample indices data-parallel rank `dp_rank` takes in a step."""
    if global_batch % dp_size:
        raise ValueError(f"global batch {global_batch} is not divisible by {dp_size} ranks")
    per_rank = global_batch // dp_size
    return step_start + dp_rank * per_rank, per_rank
