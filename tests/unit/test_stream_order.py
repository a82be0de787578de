"""The streamed order: every row once per epoch, the same for any world, found without history."""

import numpy as np
import pytest

from stalwart.data.order import StreamOrder, default_lanes

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _pairs(order, start, count):
    epochs, units, rows = order.locate(np.arange(start, start + count))
    return epochs, list(zip(units.tolist(), rows.tolist(), strict=True))


@pytest.mark.parametrize("lanes,window", [(1, 1), (2, 3), (4, 2), (8, 1)])
def test_every_row_exactly_once_per_epoch(lanes, window):
    rows = np.random.default_rng(0).integers(0, 40, size=37)
    order = StreamOrder(rows, seed=3, global_batch=16, lanes=lanes, window=window)
    n = order.num_rows
    epochs, pairs = _pairs(order, 0, 2 * n)
    expected = {(u, r) for u, c in enumerate(rows) for r in range(c)}
    assert set(pairs[:n]) == expected and len(set(pairs[:n])) == n
    assert set(pairs[n:]) == expected
    assert (epochs[:n] == 0).all() and (epochs[n:] == 1).all()
    assert pairs[:n] != pairs[n:], "each epoch has its own order"


def test_a_position_is_found_alone_as_in_a_whole_pass():
    order = StreamOrder([50] * 20 + [7, 0, 13], seed=1, global_batch=12, lanes=4, window=2)
    whole = _pairs(order, 0, 3 * order.num_rows)[1]
    fresh = StreamOrder([50] * 20 + [7, 0, 13], seed=1, global_batch=12, lanes=4, window=2)
    for k in (0, 5, 511, order.num_rows - 1, order.num_rows, 2 * order.num_rows + 77):
        assert _pairs(fresh, k, 1)[1][0] == whole[k]


def test_the_order_depends_on_the_seed_and_the_shuffle_flag():
    rows = [30] * 10
    a = _pairs(StreamOrder(rows, seed=1, global_batch=8, lanes=2, window=2), 0, 300)[1]
    b = _pairs(StreamOrder(rows, seed=2, global_batch=8, lanes=2, window=2), 0, 300)[1]
    plain = _pairs(StreamOrder(rows, seed=1, global_batch=8, lanes=1, shuffle=False), 0, 300)[1]
    assert a != b
    assert plain == [(u, r) for u in range(10) for r in range(30)]


def test_a_rank_slice_reads_only_its_lanes():
    # 8 lanes over 4 data-parallel ranks: rank r's slices come from lanes 2r and 2r + 1.
    rows = [25] * 64
    order = StreamOrder(rows, seed=0, global_batch=32, lanes=8, window=2)
    plan = order._epoch(0)
    lane_of = {int(u): j for j, units in enumerate(plan.lane_units) for u in units}
    for rank in range(4):
        lanes = set()
        for step in range(plan.full_steps):
            start = step * 32 + rank * 8
            _, units, _ = order.locate(np.arange(start, start + 8))
            lanes |= {lane_of[int(u)] for u in units}
        assert lanes == {2 * rank, 2 * rank + 1}


def test_a_window_keeps_the_rows_of_its_units_together():
    rows = [10] * 12
    order = StreamOrder(rows, seed=5, global_batch=4, lanes=1, window=3)
    _, units, _ = order.locate(np.arange(0, 30))
    assert len(set(units.tolist())) == 3


def test_default_lanes_divide_the_batch_and_leave_each_lane_a_window():
    assert default_lanes(32, units=100, window=2) == 8
    assert default_lanes(12, units=100, window=2) == 6
    assert default_lanes(32, units=9, window=2) == 4
    assert default_lanes(7, units=100, window=1) == 7
    assert default_lanes(32, units=1, window=4) == 1


@pytest.mark.parametrize("kwargs,match", [
    ({"unit_rows": []}, "non-empty"),
    ({"unit_rows": [0, 0]}, "no rows"),
    ({"unit_rows": [5], "lanes": 3}, "must divide"),
    ({"unit_rows": [5], "window": 0}, "window"),
])
def test_bad_shapes_are_refused(kwargs, match):
    args = {"seed": 0, "global_batch": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        StreamOrder(**args)
