"""Straggler detection over the ranks' local times (orchestrator/stragglers.py)."""

from __future__ import annotations

import pytest

from stalwart.orchestrator.stragglers import StragglerDetector

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def feed(d: StragglerDetector, step: int, times: list[float]) -> list:
    for rank, t in enumerate(times):
        d.observe(rank, step, t)
    return d.check()


def test_a_rank_slow_for_enough_steps_in_a_row_is_reported_once() -> None:
    d = StragglerDetector(factor=2.0, steps=3)
    d.reset(4)
    found = [s for step in range(1, 8) for s in feed(d, step, [0.10, 0.11, 0.35, 0.10])]
    assert [(s.rank, s.step, s.steps) for s in found] == [(2, 3, 3)]
    assert found[0].peers_median_s == pytest.approx(0.10)
    assert found[0].ratio == pytest.approx(3.5)


def test_a_world_of_two_knows_which_rank_is_slow() -> None:
    d = StragglerDetector(factor=2.0, steps=2)
    d.reset(2)
    found = [s for step in range(1, 4) for s in feed(d, step, [0.02, 0.07])]
    assert [s.rank for s in found] == [1]


def test_a_break_in_the_streak_starts_it_again() -> None:
    d = StragglerDetector(factor=2.0, steps=3)
    d.reset(3)
    slow, fast = [0.1, 0.1, 0.5], [0.1, 0.1, 0.1]
    found = [s for step, times in enumerate([slow, slow, fast, slow, slow, slow], 1)
             for s in feed(d, step, times)]
    assert [(s.rank, s.step) for s in found] == [(2, 6)]


def test_one_slow_spell_is_one_report_though_a_noisy_step_breaks_it() -> None:
    d = StragglerDetector(factor=2.0, steps=3)
    d.reset(3)
    slow, fast = [0.1, 0.1, 0.5], [0.1, 0.1, 0.1]
    # reported at step 3; one step within the factor (a peer's hiccup) does not end the spell
    spell = [slow, slow, slow, fast, slow, slow, slow, slow]
    found = [s for step, times in enumerate(spell, 1) for s in feed(d, step, times)]
    assert [(s.rank, s.step) for s in found] == [(2, 3)]
    # back within the factor for `steps` steps ends it; a later spell is reported again
    later = [fast, fast, fast, slow, slow, slow]
    found = [s for step, times in enumerate(later, len(spell) + 1) for s in feed(d, step, times)]
    assert [(s.rank, s.step) for s in found] == [(2, 14)]


def test_jitter_of_short_steps_and_equal_ranks_are_not_stragglers() -> None:
    d = StragglerDetector(factor=2.0, steps=2)
    d.reset(2)
    # 3x, but 2 ms: scheduler noise, not a slow device
    assert [s for step in range(1, 5) for s in feed(d, step, [0.001, 0.003])] == []
    assert [s for step in range(5, 9) for s in feed(d, step, [0.2, 0.21])] == []


def test_a_step_is_judged_once_every_rank_reported_it_and_a_new_world_resets() -> None:
    d = StragglerDetector(factor=2.0, steps=1)
    d.reset(2)
    d.observe(1, 1, 0.5)
    assert d.check() == []  # rank 0 has not reported step 1 yet
    d.observe(0, 1, 0.1)
    assert [s.rank for s in d.check()] == [1]
    d.reset(3)
    assert feed(d, 2, [0.1, 0.1, 0.1]) == []


def test_off_and_single_rank_worlds_never_report() -> None:
    off = StragglerDetector(factor=0, steps=1)
    off.reset(2)
    assert not off.enabled and feed(off, 1, [0.1, 0.9]) == []
    alone = StragglerDetector(factor=2.0, steps=1)
    alone.reset(1)
    assert feed(alone, 1, [5.0]) == []
