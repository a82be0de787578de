"""The order of a streamed dataset: a pure function of (seed, epoch, the units' row counts).

A stream is a list of units (a parquet row group, a chunk of JSON lines), each with a known
row count. An epoch is one pass over every row, in this order:

1. The units are shuffled with a generator seeded by (seed, epoch).
2. They are dealt round robin to `lanes` lanes. Inside a lane, the rows of each `window`
   consecutive units are shuffled together (seeded by seed, epoch, lane, window): the
   shuffle buffer, whose whole state is the position.
3. Each global batch of size G takes G / lanes rows from every lane, lane 0 first. Once the
   shortest lane runs out, what the lanes have left follows, lane by lane (the tail).

Any global sample position maps to (epoch, unit, row) in O(log units), with no history. A
contiguous slice of a global batch falls in few lanes, so data-parallel rank r of dp reads
only lanes [r * lanes / dp, (r + 1) * lanes / dp): each rank reads its share of the data,
not all of it, and the order itself never depends on dp.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

# Window permutations kept per order: a step touches one window per lane, two at a boundary.
_WINDOW_CACHE = 64


def default_lanes(global_batch: int, units: int, window: int, *, most: int = 8) -> int:
    """The largest divisor of `global_batch` up to `most` that leaves every lane at least one
    full window of units (1 when the units are too few)."""
    for lanes in range(min(most, global_batch), 0, -1):
        if global_batch % lanes == 0 and lanes * window <= units:
            return lanes
    return 1


class StreamOrder:
    """Maps global sample positions to (epoch, unit, row in unit)."""

    def __init__(self, unit_rows: Sequence[int] | np.ndarray, *, seed: int, global_batch: int,
                 lanes: int = 1, window: int = 1, shuffle: bool = True) -> None:
        rows = np.asarray(unit_rows, dtype=np.int64)
        if rows.ndim != 1 or len(rows) == 0 or (rows < 0).any():
            raise ValueError(f"unit row counts must be a non-empty list of counts >= 0, "
                             f"got {rows.tolist()[:8]}")
        if global_batch < 1 or lanes < 1 or global_batch % lanes:
            raise ValueError(f"lanes = {lanes} must divide the global batch ({global_batch})")
        if window < 1:
            raise ValueError(f"window = {window} must be >= 1 unit")
        self.unit_rows = rows
        self.num_rows = int(rows.sum())
        if self.num_rows == 0:
            raise ValueError("the stream has no rows")
        self.seed, self.global_batch = seed, global_batch
        self.lanes, self.window, self.shuffle = lanes, window, shuffle
        self._epochs: OrderedDict[int, _Epoch] = OrderedDict()
        self._windows: OrderedDict[tuple[int, int, int], np.ndarray] = OrderedDict()

    def locate(self, positions: np.ndarray | Sequence[int]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(epoch, unit, row) for each global sample position."""
        pos = np.asarray(positions, dtype=np.int64)
        epochs, offsets = np.divmod(pos, self.num_rows)
        units = np.empty_like(pos)
        rows = np.empty_like(pos)
        for epoch in np.unique(epochs):
            mask = epochs == epoch
            units[mask], rows[mask] = self._epoch(int(epoch)).locate(offsets[mask], self)
        return epochs, units, rows

    def _epoch(self, epoch: int) -> _Epoch:
        plan = self._epochs.get(epoch)
        if plan is None:
            plan = self._epochs[epoch] = _Epoch(self, epoch)
            while len(self._epochs) > 3:  # a step spans two; reading ahead may touch a third
                self._epochs.popitem(last=False)
        return plan

    def window_rows(self, plan: _Epoch, lane: int, window: int
                    ) -> tuple[np.ndarray, np.ndarray]:
        """(unit, row in unit) of each row of one lane's window, in shuffled order: built once
        per window, then every position in it is one lookup."""
        key = (plan.epoch, lane, window)
        found = self._windows.get(key)
        if found is not None:
            self._windows.move_to_end(key)
            return found
        cum, units = plan.lane_cum[lane], plan.lane_units[lane]
        first, last = window * self.window, min((window + 1) * self.window, len(units))
        index = np.arange(cum[first], cum[last], dtype=np.int64)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, plan.epoch, lane, window])
            index = index[rng.permutation(len(index))]
        at = np.searchsorted(cum, index, side="right") - 1
        found = self._windows[key] = (units[at], index - cum[at])
        while len(self._windows) > _WINDOW_CACHE:
            self._windows.popitem(last=False)
        return found


class _Epoch:
    """One epoch's lanes: which units each holds and where the shared part ends."""

    def __init__(self, order: StreamOrder, epoch: int) -> None:
        n = len(order.unit_rows)
        perm = (np.random.default_rng([order.seed, epoch]).permutation(n) if order.shuffle
                else np.arange(n))
        self.epoch = epoch
        self.lane_units = [perm[j::order.lanes] for j in range(order.lanes)]
        self.lane_cum = [np.concatenate([[0], np.cumsum(order.unit_rows[u])])
                         for u in self.lane_units]
        # Each window's first row in its lane (windows of `window` units).
        self.window_starts = [c[:-1][::order.window] if len(c) > 1 else c
                              for c in self.lane_cum]
        lengths = np.array([c[-1] for c in self.lane_cum], dtype=np.int64)
        self.width = order.global_batch // order.lanes  # rows per lane per global batch
        self.full_steps = int(lengths.min()) // self.width
        self.body = self.full_steps * order.global_batch
        self.tail_cum = np.concatenate([[0], np.cumsum(lengths - self.full_steps * self.width)])

    def locate(self, offsets: np.ndarray, order: StreamOrder) -> tuple[np.ndarray, np.ndarray]:
        lane = np.empty_like(offsets)
        index = np.empty_like(offsets)  # row index inside the lane
        body = offsets < self.body
        k = offsets[body]
        step, slot = np.divmod(k, order.global_batch)
        lane[body] = slot // self.width
        index[body] = step * self.width + slot % self.width
        x = offsets[~body] - self.body
        tail_lane = np.searchsorted(self.tail_cum, x, side="right") - 1
        lane[~body] = tail_lane
        index[~body] = self.full_steps * self.width + x - self.tail_cum[tail_lane]
        units = np.empty_like(offsets)
        rows = np.empty_like(offsets)
        for j in np.unique(lane):
            mask = lane == j
            units[mask], rows[mask] = self._lane_rows(int(j), index[mask], order)
        return units, rows

    def _lane_rows(self, lane: int, index: np.ndarray, order: StreamOrder
                   ) -> tuple[np.ndarray, np.ndarray]:
        starts = self.window_starts[lane]
        windows = np.searchsorted(starts, index, side="right") - 1
        units = np.empty_like(index)
        rows = np.empty_like(index)
        for w in np.unique(windows):
            mask = windows == w
            window_units, window_rows = order.window_rows(self, lane, int(w))
            offset = index[mask] - starts[w]
            units[mask], rows[mask] = window_units[offset], window_rows[offset]
        return units, rows
