"""HangDetector: the adaptive limit, the start timeout, silent ranks and a stalled world."""

from __future__ import annotations

import pytest

from stalwart.orchestrator.health import Hang, HangDetector

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def detector(floor: float = 5.0, factor: float = 10.0, start: float = 120.0) -> HangDetector:
    return HangDetector(floor_s=floor, factor=factor, start_timeout_s=start)


# ---------------------------------------------------------------------------- the limit


def test_limit_before_any_step_is_at_least_the_start_timeout() -> None:
    d = detector(floor=5.0, start=120.0)
    assert d.limit_s() == 120.0
    assert detector(floor=200.0, start=120.0).limit_s() == 200.0  # the larger of the two


@pytest.mark.parametrize(("times", "expected"), [
    ([0.1], 5.0),                  # 10 x 0.1 = 1 s < the floor
    ([0.1, 0.2, 0.3], 5.0),
    ([2.0], 20.0),                 # 10 x 2 s > the floor
    ([1.0, 2.0, 100.0], 20.0),     # the median, not the mean: one slow step does not count
    ([1.0, 3.0], 20.0),            # the median of an even count is the mean of the middle two
])
def test_limit_is_the_floor_or_factor_times_the_median_step(times: list[float],
                                                            expected: float) -> None:
    d = detector(floor=5.0, factor=10.0)
    for t in times:
        d.step_time(t)
    assert d.limit_s() == pytest.approx(expected)


def test_the_median_follows_a_window_of_recent_steps() -> None:
    d = detector(floor=1.0, factor=2.0)
    for _ in range(HangDetector.WINDOW):
        d.step_time(10.0)
    assert d.limit_s() == 20.0
    for _ in range(HangDetector.WINDOW // 2 + 1):  # a majority of the window is faster now
        d.step_time(1.0)
    assert d.limit_s() == 2.0
    for _ in range(HangDetector.WINDOW):
        d.step_time(0.1)
    assert d.limit_s() == 1.0  # back at the floor


def test_each_generation_starts_with_the_start_timeout_and_keeps_the_median() -> None:
    d = detector(floor=5.0, factor=10.0, start=60.0)
    d.reset(range(2), now=0.0)
    assert d.limit_s() == 60.0
    d.step_time(1.0)
    assert d.limit_s() == 10.0
    d.reset(range(2), now=100.0)  # a new world: its first step may compile again
    assert d.limit_s() == 60.0
    d.step_time(3.0)
    assert d.limit_s() == 20.0  # median of [1, 3] x 10: the old step times are kept


# ---------------------------------------------------------------------------- check


def started(ranks: int = 3, *, floor: float = 5.0, now: float = 0.0) -> HangDetector:
    """A detector past its first step: the limit is the floor (5 s)."""
    d = detector(floor=floor, factor=10.0)
    d.reset(range(ranks), now=now)
    d.step_time(0.1)
    return d


def test_no_hang_while_everyone_answers_and_progresses() -> None:
    d = started()
    for t in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        for r in range(3):
            d.answered(r, t, progressed=True)
        assert d.check(t + 0.5) is None


def test_nothing_is_hung_right_after_a_reset() -> None:
    d = started(now=1000.0)
    assert d.check(1000.0) is None
    assert d.check(1005.0) is None  # exactly the limit: not yet
    assert d.check(1005.01) is not None


def test_a_rank_that_stops_answering_is_blamed_alone() -> None:
    d = started()
    for t in (1.0, 2.0, 3.0):
        for r in (0, 2):
            d.answered(r, t, progressed=True)
    d.answered(1, 1.5, progressed=True)
    # rank 1 last answered at 1.5; the others keep answering without progress (they wait
    # for rank 1 in a collective)
    for t in (4.0, 5.0, 6.0, 6.5):
        for r in (0, 2):
            d.answered(r, t, progressed=False)
    assert d.check(6.5) is None  # 5 s since rank 1's answer: not more than the limit
    hang = d.check(7.0)
    assert hang == Hang(ranks=(1,), silent_s=5.5, limit_s=5.0, last_heartbeat=1.5,
                        answering=False)


def test_several_silent_ranks_are_blamed_together_from_the_latest_answer() -> None:
    d = started(ranks=4)
    d.answered(1, 1.0, progressed=True)
    d.answered(3, 2.0, progressed=True)
    for r in (0, 2):
        d.answered(r, 7.5, progressed=True)
    hang = d.check(8.0)
    assert hang is not None
    assert hang.ranks == (1, 3) and not hang.answering
    assert hang.last_heartbeat == 2.0 and hang.silent_s == 6.0


def test_a_rank_that_never_answered_since_the_reset_is_silent() -> None:
    d = started(ranks=2, now=10.0)
    d.answered(0, 14.0, progressed=True)
    hang = d.check(15.5)
    assert hang is not None and hang.ranks == (1,) and hang.last_heartbeat == 10.0


def test_everyone_answers_but_nobody_progresses() -> None:
    d = started()
    for r in range(3):
        d.answered(r, 2.0, progressed=True)
    for t in (3.0, 5.0, 7.0, 7.5):
        for r in range(3):
            d.answered(r, t, progressed=False)
    assert d.check(7.0) is None
    hang = d.check(7.5)
    assert hang == Hang(ranks=(0, 1, 2), silent_s=5.5, limit_s=5.0, last_heartbeat=2.0,
                        answering=True)


def test_one_rank_progressing_means_the_world_is_not_stalled() -> None:
    d = started()
    for t in (3.0, 6.0, 9.0):
        for r in range(3):
            d.answered(r, t, progressed=(r == 0))
    assert d.check(9.5) is None


def test_silence_is_reported_before_a_stall() -> None:
    d = started(ranks=2)
    d.answered(0, 6.0, progressed=False)  # answers, no progress since the reset at 0
    hang = d.check(6.5)  # rank 1 silent since 0, and nobody progressed since 0
    assert hang is not None and hang.ranks == (1,) and not hang.answering


def test_the_start_timeout_protects_the_first_step() -> None:
    d = detector(floor=5.0, factor=10.0, start=60.0)
    d.reset(range(2), now=0.0)
    for t in (10.0, 30.0, 59.0):
        for r in range(2):
            d.answered(r, t, progressed=False)  # compiling: no step yet
    assert d.check(60.0) is None
    assert d.check(60.5) is not None  # no progress for more than the start timeout
    d.step_time(0.1)
    d.answered(0, 61.0, progressed=True)
    d.answered(1, 61.0, progressed=True)
    assert d.check(66.0) is None
    assert d.check(66.5) is not None  # after the first step the floor applies


def test_a_rank_busy_between_steps_gets_the_start_timeout_not_the_step_limit() -> None:
    d = started()  # limit 5 s; start timeout 120 s
    for r in range(3):
        d.answered(r, 2.0, progressed=True)
    for t in (4.0, 8.0, 60.0):  # rank 0 waits for a slow store; its peers wait for it
        d.answered(0, t, progressed=False, busy=True)
        for r in (1, 2):
            d.answered(r, t, progressed=False)
    assert d.check(60.0) is None
    d.answered(0, 123.0, progressed=False, busy=True)
    for r in (1, 2):
        d.answered(r, 123.0, progressed=False)
    hang = d.check(123.0)  # past the start timeout: a stuck store is a hang all the same
    assert hang is not None and hang.answering and hang.limit_s == 120.0
    d.answered(0, 124.0, progressed=False)  # no longer busy: back to the step limit
    assert d.progress_limit_s() == 5.0
