"""The feeder reads the steps ahead on a thread and gives each step exactly what reading it
inline would, whatever jumps the position takes (a restore moves it back or forward)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from stalwart.core.errors import DataUnavailable
from stalwart.workers.feeder import Feeder
from stalwart.workers.sampler import GlobalSampler

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

G = 8


class Items:
    """A map-style dataset that records which thread read it, and can be made to fail."""

    def __init__(self, n: int = 100) -> None:
        self.n, self.threads, self.broken = n, set(), set()

    def __len__(self) -> int:
        return self.n

    def get_batch(self, indices):
        self.threads.add(threading.current_thread().name)
        if self.broken & set(np.asarray(indices).tolist()):
            raise DataUnavailable("data file x.parquet is gone")
        return torch.as_tensor(np.asarray(indices))


def _plan(position: int) -> list[tuple[int, int]]:
    return [(position, G // 2), (position + G // 2, G // 2)]  # two micro-batches


def _feeder(data, depth: int = 2) -> Feeder:
    return Feeder(data, seed=3, plan=_plan, step_size=G, depth=depth)


def test_steps_read_ahead_equal_steps_read_inline():
    ahead, inline = _feeder(Items()), _feeder(Items(), depth=0)
    for position in [0, 8, 16, 24, 8, 16, 96, 104, 0]:  # restores jump back and forth
        a, _ = ahead.take(position)
        b, _ = inline.take(position)
        assert all(torch.equal(x, y) for x, y in zip(a.batches, b.batches, strict=True))
        assert a.ids.row.tolist() == torch.cat(a.batches).tolist()
        assert a.ids.epoch.tolist() == [p // 100 for p in range(position, position + G)]
    ahead.close()


def test_reading_happens_on_the_feeder_thread():
    data = Items()
    feeder = _feeder(data)
    feeder.take(0)
    feeder.take(8)
    assert data.threads and all(t.startswith("stalwart-data") for t in data.threads)
    feeder.close()


def test_a_step_that_cannot_be_read_is_told_ahead_of_time():
    data = Items()
    data.broken = set(GlobalSampler(100, seed=3).items(16, G).tolist())  # the third step
    feeder = _feeder(data)
    feeder.take(0)
    error, _ = feeder.check_ahead(8)
    assert error is None
    feeder.take(8)
    error, _ = feeder.check_ahead(16)
    assert error is not None and "x.parquet" in error
    with pytest.raises(DataUnavailable):
        feeder.take(16)
    data.broken = set()  # the file is back: a fresh position reads again
    batch, _ = feeder.take(24)
    assert torch.cat(batch.batches).numel() == G
    feeder.close()


def test_without_read_ahead_nothing_is_checked_ahead():
    feeder = _feeder(Items(), depth=0)
    assert feeder.check_ahead(8) == (None, 0.0)
