"""The global sample order: a function of (seed, global index) only, whatever the world size."""

from __future__ import annotations

import numpy as np
import pytest

from stalwart.workers.sampler import GlobalSampler, rank_slice

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

NUM_ITEMS = 50  # small enough that a few steps cross several epoch boundaries


def _run(sampler_per_rank: list[GlobalSampler], start_step: int, steps: int,
         global_batch: int) -> list[np.ndarray]:
    """What each step consumed over all ranks, concatenated in rank order."""
    world = len(sampler_per_rank)
    out = []
    for step in range(start_step, start_step + steps):
        step_start = step * global_batch
        parts = []
        for rank, sampler in enumerate(sampler_per_rank):
            start, count = rank_slice(step_start, global_batch, rank, world)
            parts.append(sampler.items(start, count))
        out.append(np.concatenate(parts))
    return out


def _ranks(world: int, seed: int = 0) -> list[GlobalSampler]:
    return [GlobalSampler(NUM_ITEMS, seed=seed) for _ in range(world)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("global_batch", [12, 24, 36])
def test_ranks_together_consume_exactly_the_global_sequence(world: int, global_batch: int) -> None:
    steps = 7
    expected = GlobalSampler(NUM_ITEMS, seed=3).items(0, steps * global_batch)
    per_step = _run(_ranks(world, seed=3), 0, steps, global_batch)
    assert all(len(s) == global_batch for s in per_step)
    np.testing.assert_array_equal(np.concatenate(per_step), expected)


@pytest.mark.parametrize("world", [2, 3, 4, 6])
def test_rank_slices_are_disjoint_and_cover_the_batch(world: int) -> None:
    global_batch, step_start = 24, 240
    covered = []
    for rank in range(world):
        start, count = rank_slice(step_start, global_batch, rank, world)
        assert count == global_batch // world
        covered.extend(range(start, start + count))
    assert covered == list(range(step_start, step_start + global_batch))


def test_every_item_exactly_once_per_epoch() -> None:
    sampler = GlobalSampler(NUM_ITEMS, seed=11)
    epochs = [sampler.items(e * NUM_ITEMS, NUM_ITEMS) for e in range(4)]
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(NUM_ITEMS))
    # a fresh permutation per epoch, not the same order repeated
    assert len({tuple(e.tolist()) for e in epochs}) == 4


def test_order_depends_on_the_seed_only() -> None:
    a = GlobalSampler(NUM_ITEMS, seed=0).items(0, 3 * NUM_ITEMS)
    b = GlobalSampler(NUM_ITEMS, seed=1).items(0, 3 * NUM_ITEMS)
    again = GlobalSampler(NUM_ITEMS, seed=0).items(0, 3 * NUM_ITEMS)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, again)
    assert not np.array_equal(a[:NUM_ITEMS], np.arange(NUM_ITEMS))  # actually shuffled


def test_no_shuffle_is_the_identity_order() -> None:
    sampler = GlobalSampler(7, seed=5, shuffle=False)
    assert sampler.items(5, 9).tolist() == [5, 6, 0, 1, 2, 3, 4, 5, 6]


def test_crossing_an_epoch_boundary_mid_batch() -> None:
    sampler = GlobalSampler(NUM_ITEMS, seed=2)
    epoch0 = GlobalSampler(NUM_ITEMS, seed=2).items(0, NUM_ITEMS)
    epoch1 = GlobalSampler(NUM_ITEMS, seed=2).items(NUM_ITEMS, NUM_ITEMS)
    batch = sampler.items(NUM_ITEMS - 4, 10)  # 4 from the end of epoch 0, 6 from epoch 1
    np.testing.assert_array_equal(batch[:4], epoch0[-4:])
    np.testing.assert_array_equal(batch[4:], epoch1[:6])
    # a batch longer than an epoch spans three of them
    long = sampler.items(NUM_ITEMS - 1, NUM_ITEMS + 2)
    assert long[0] == epoch0[-1]
    np.testing.assert_array_equal(long[1:-1], epoch1)
    assert long[-1] == GlobalSampler(NUM_ITEMS, seed=2).items(2 * NUM_ITEMS, 1)[0]
    assert len(sampler.items(123, 0)) == 0


@pytest.mark.parametrize("samples_seen", [0, 1, 17, 49, 50, 51, 99, 100, 137])
def test_resume_at_any_position_continues_as_if_never_stopped(samples_seen: int) -> None:
    uninterrupted = GlobalSampler(NUM_ITEMS, seed=9).items(0, 300)
    resumed = GlobalSampler(NUM_ITEMS, seed=9).items(samples_seen, 300 - samples_seen)
    np.testing.assert_array_equal(resumed, uninterrupted[samples_seen:])


def test_queries_out_of_order_match_a_fresh_sampler() -> None:
    # the per-epoch cache must not leak: jump forward, back, and forward again
    sampler = GlobalSampler(NUM_ITEMS, seed=4)
    for start in (230, 3, 120, 49, 0, 230):
        np.testing.assert_array_equal(
            sampler.items(start, 20), GlobalSampler(NUM_ITEMS, seed=4).items(start, 20))


def test_changing_world_size_mid_run_consumes_the_same_sequence() -> None:
    global_batch = 24
    expected = GlobalSampler(NUM_ITEMS, seed=7).items(0, 10 * global_batch)
    # 4 ranks for 3 steps, then 2 ranks (fresh samplers, as after a restart) for 4 steps,
    # then 3 ranks for 3 steps: the position carried across is only the step number
    consumed = (_run(_ranks(4, seed=7), 0, 3, global_batch)
                + _run(_ranks(2, seed=7), 3, 4, global_batch)
                + _run(_ranks(3, seed=7), 7, 3, global_batch))
    np.testing.assert_array_equal(np.concatenate(consumed), expected)


def test_rank_slice_rejects_an_indivisible_batch() -> None:
    with pytest.raises(ValueError, match="global batch 10 is not divisible by 4 ranks"):
        rank_slice(0, 10, 0, 4)
    assert rank_slice(30, 10, 1, 5) == (32, 2)


def test_empty_dataset_is_refused() -> None:
    with pytest.raises(ValueError, match=r"the dataset is empty \(num_items=0\)"):
        GlobalSampler(0, seed=0)
