"""The snapshot schedule: the interval policy (grows on a slow link, shrinks back when it
recovers, holds through noise, stays in 1..persist_every, deterministic), the steps a world
snapshots and waits on, its reports, and a closed loop against a modelled link."""

from __future__ import annotations

import random

import pytest

from stalwart.checkpointing.snapshot_schedule import (
    AUTO,
    GROW_MARGIN,
    GROW_TARGET,
    HISTORY,
    UNMEASURED,
    Figures,
    IntervalPolicy,
    SnapshotSchedule,
    Window,
    cpu_share,
    replay,
    snapshot_schedule,
)
from stalwart.core.config import load_config

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

STEP_S = 0.1


def window(*, steps: int = 1, interval: int | None = None, step_s: float = STEP_S,
           stage_s: float = 0.0005, wait_s: float = 0.0, busy_s: float = 0.0005,
           exchange_s: float = 0.01) -> Window:
    return Window(steps=steps, interval=interval or steps, step_s=step_s, stage_s=stage_s,
                  wait_s=wait_s, busy_s=busy_s, exchange_s=exchange_s)


def policy(budget: float = 0.02, most: int = 50, share: float = 1.0) -> IntervalPolicy:
    return IntervalPolicy(budget=budget, most=most, share=share)


def feed(p: IntervalPolicy, w: Window, times: int = HISTORY) -> int:
    for _ in range(times):
        p.decide(w, step=0)
    return p.interval


# ---------------------------------------------------------------------------- figures


def test_a_window_travels_as_a_list_of_floats_and_back() -> None:
    w = window(steps=3, interval=4, exchange_s=0.25)
    values = w.to_list()
    assert all(isinstance(v, float) for v in values)
    assert Window.from_list(values) == w
    with pytest.raises(ValueError, match="a window has 8 figures, not 7"):
        Window.from_list(values[:-1])


def test_a_windows_overhead_is_what_the_training_thread_paid_over_its_steps() -> None:
    w = window(steps=4, step_s=0.1, stage_s=0.01, wait_s=0.02, busy_s=0.04)
    assert w.overhead(share=1.0) == pytest.approx(0.07 / 0.4)
    assert w.overhead(share=0.0) == pytest.approx(0.03 / 0.4)  # a GPU worker's


def test_the_model_hides_an_exchange_shorter_than_the_interval() -> None:
    f = Figures(step_s=0.1, fixed_s=0.002, exchange_s=0.35)
    # Waited for half-way into the k-th step after the snapshot: (k - 1/2) x 0.1 s of cover.
    assert f.cost(1) == pytest.approx(0.002 + 0.30)
    assert f.cost(3) == pytest.approx(0.002 + 0.10)
    assert f.cost(4) == pytest.approx(0.002)
    assert f.cost(4, margin=1.25) == pytest.approx(0.002 + 0.0875)
    assert [f.overhead(k) for k in range(1, 8)] == sorted(
        (f.overhead(k) for k in range(1, 8)), reverse=True)


def test_the_cpu_share_is_one_on_cpu_workers_and_none_on_gpus() -> None:
    assert cpu_share("cpu") == 1.0 and cpu_share("cuda") == 0.0


# ---------------------------------------------------------------------------- the policy


def test_a_fast_cheap_link_keeps_a_snapshot_every_step() -> None:
    p = policy()
    assert feed(p, window(), times=20) == 1


def test_no_decision_before_enough_windows() -> None:
    p = policy()
    slow = window(exchange_s=1.0)
    for _ in range(HISTORY - 1):
        assert p.decide(slow, step=0).interval == 1
    assert p.decide(slow, step=0).interval > 1


def test_a_slow_link_grows_the_interval_until_the_exchange_is_hidden() -> None:
    p = policy()
    # The exchange takes 3.5 steps: one every step stalls each step for most of its length.
    slow = window(exchange_s=0.35, wait_s=0.25)
    k = feed(p, slow)
    assert k > 1
    # The shortest under 0.8 x budget with the exchange taken a quarter longer than measured.
    assert p.typical.overhead(k, GROW_MARGIN) <= GROW_TARGET * p.budget
    assert p.typical.overhead(k - 1, GROW_MARGIN) > GROW_TARGET * p.budget
    assert (k - 0.5) * STEP_S >= GROW_MARGIN * 0.35


def test_a_costly_staging_grows_the_interval_by_its_share_of_the_budget() -> None:
    p = policy(budget=0.02)
    # 10 ms of staging on a 100 ms step: 10%, five times the budget; 1 <= k, 0.8 x 2% at k=7.
    assert feed(p, window(stage_s=0.01, busy_s=0.0, exchange_s=0.0)) == 7


def test_the_interval_shrinks_back_once_the_link_recovers() -> None:
    p = policy()
    grown = feed(p, window(exchange_s=0.35, wait_s=0.25))
    fast = window(steps=grown, exchange_s=0.01)
    # A link slow in any recent window holds the interval up...
    assert p.decide(fast, step=0).interval == grown
    assert p.decide(fast, step=0).interval == grown
    # ...and once every recent window is fast, it comes back.
    assert p.decide(fast, step=0).interval == 1


def test_one_window_held_up_by_the_machine_does_not_move_the_interval() -> None:
    p = policy()
    feed(p, window())
    hiccup = window(stage_s=0.4, wait_s=0.3, exchange_s=0.5)  # a preempted process
    decisions = [p.decide(w, step=0).interval for w in (window(), hiccup, window(), window())]
    assert decisions == [1, 1, 1, 1]


def test_a_wavering_step_time_does_not_flap_the_interval() -> None:
    rng = random.Random(0)
    p = policy()
    intervals = []
    for _ in range(200):
        step_s = STEP_S * rng.uniform(0.9, 1.1)  # 10% noise around a hidden exchange
        exchange_s = 0.35 * rng.uniform(0.95, 1.05)
        k = p.interval
        wait = max(0.0, exchange_s - (k - 0.5) * step_s)
        intervals.append(p.decide(window(steps=k, step_s=step_s, exchange_s=exchange_s,
                                         wait_s=wait), step=0).interval)
    changes = sum(a != b for a, b in zip(intervals, intervals[1:], strict=False))
    assert changes <= 2, intervals


def test_the_interval_stays_within_1_and_persist_every() -> None:
    p = policy(most=10)
    assert feed(p, window(exchange_s=60.0, stage_s=5.0)) == 10  # never past persist_every
    assert p.typical.overhead(10) > p.budget  # over budget, and it says so
    q = policy(most=10)
    assert feed(q, window(exchange_s=0.0, stage_s=0.0, busy_s=0.0)) == 1
    with pytest.raises(ValueError, match="between 0 and 1"):
        policy(budget=1.5)


def test_the_busy_time_counts_on_cpu_workers_only() -> None:
    busy = window(busy_s=0.02, stage_s=0.0, exchange_s=0.0)
    assert feed(policy(share=1.0), busy) > 1
    assert feed(policy(share=0.0), busy) == 1


def test_what_the_steps_measured_replaces_the_exchanges_cpu_time() -> None:
    # 4 ms of exchange CPU time, but the steps beside it lost 14 ms: the steps are believed.
    p = policy()
    feed(p, Window(steps=8, interval=8, step_s=STEP_S, stage_s=0.001, wait_s=0.0,
                   busy_s=0.004, exchange_s=0.02, contended_s=0.014))
    assert p.typical.fixed_s == pytest.approx(0.015)
    q = policy()
    feed(q, Window(steps=1, interval=1, step_s=STEP_S, stage_s=0.001, wait_s=0.0,
                   busy_s=0.004, exchange_s=0.02))  # unmeasured: the CPU time counts
    assert q.typical.fixed_s == pytest.approx(0.005)


def test_a_wait_the_exchange_does_not_explain_counts_as_a_longer_exchange() -> None:
    # 0.25 s of waiting after a step's cover with a 10 ms exchange: the thread waited as if
    # the exchange took 0.3 s, and the interval grows to hide that, not a fixed cost.
    p = policy()
    k = feed(p, window(wait_s=0.25, exchange_s=0.01, stage_s=0.0, busy_s=0.0))
    assert p.typical.exchange_s == pytest.approx(0.25 + 0.5 * STEP_S)
    assert p.typical.fixed_s == 0.0
    assert k == p.shortest_under(GROW_TARGET * p.budget,
                                 Figures(STEP_S, 0.0, 0.25 + 0.5 * STEP_S), GROW_MARGIN)
    assert (k - 0.5) * STEP_S >= GROW_MARGIN * 0.3


def test_bisection_finds_the_shortest_interval_a_linear_search_finds() -> None:
    rng = random.Random(1)
    p = policy(most=200)
    for _ in range(300):
        f = Figures(step_s=rng.uniform(0.01, 1.0), fixed_s=rng.uniform(0, 0.2),
                    exchange_s=rng.uniform(0, 20))
        target, margin = rng.uniform(0.001, 0.5), rng.choice([1.0, 1.25, 1.5])
        linear = next((k for k in range(1, 201) if f.overhead(k, margin) <= target), 200)
        assert p.shortest_under(target, f, margin) == linear


def test_equal_windows_make_equal_decisions() -> None:
    rng = random.Random(2)
    windows = [window(step_s=rng.uniform(0.05, 0.2), exchange_s=rng.uniform(0, 1),
                      stage_s=rng.uniform(0, 0.01), wait_s=rng.uniform(0, 0.1))
               for _ in range(100)]
    a, b = policy(), policy()
    assert [a.decide(w, step=i) for i, w in enumerate(windows)] == \
        [b.decide(w, step=i) for i, w in enumerate(windows)]


def test_a_decision_says_what_it_measured_and_what_it_expects() -> None:
    p = policy()
    feed(p, window(exchange_s=0.35, wait_s=0.25), times=HISTORY - 1)
    d = p.decide(window(exchange_s=0.35, wait_s=0.25), step=12)
    assert (d.step, d.previous) == (12, 1) and d.interval > 1
    assert d.overhead == pytest.approx((0.0005 + 0.25 + 0.0005) / STEP_S)  # measured, at 1
    assert d.expected == pytest.approx(p.typical.overhead(d.interval))
    assert d.step_s == STEP_S and d.cost_s == pytest.approx(p.typical.cost(d.interval))


def test_an_unusable_window_changes_nothing() -> None:
    p = policy()
    feed(p, window(exchange_s=0.35, wait_s=0.25))
    k = p.interval
    assert p.decide(window(step_s=0.0), step=0).interval == k
    assert p.decide(window(steps=0), step=0).interval == k


# ---------------------------------------------------------------------------- the schedule


def test_a_fixed_interval_snapshots_its_multiples_and_waits_every_step() -> None:
    s = SnapshotSchedule(3, persist_every=10, last_step=30)
    assert [step for step in range(1, 13) if s.due(step)] == [3, 6, 9, 12]
    s.taken(3)
    assert all(s.must_wait(step) for step in range(1, 20))
    assert not s.unplanned(4) and s.report() is None and not s.auto


def test_auto_starts_every_step_and_plans_the_persist_and_last_steps() -> None:
    s = SnapshotSchedule(AUTO, persist_every=10, last_step=25, budget=0.02)
    assert s.due(1) and not s.must_wait(1)  # nothing in flight yet
    s.taken(1)
    s.policy.interval = 4
    # From 1 to the persist step 10: 9 steps in gaps of at most 4, spread evenly (3 each).
    assert [step for step in range(2, 11) if s.due(step)][:1] == [4]
    s.taken(4)
    assert s.next_step() == 7
    s.taken(10)
    s.policy.interval = 10
    assert s.next_step() == 20
    s.taken(20)
    assert s.next_step() == 25  # the last step


def test_auto_waits_only_before_the_next_snapshots_all_reduce() -> None:
    s = SnapshotSchedule(AUTO, persist_every=50, last_step=100)
    s.taken(1)
    s.policy.interval = 5
    s.taken(6)
    assert [step for step in range(7, 12) if s.must_wait(step)] == [11]


def test_after_a_restored_snapshot_the_first_step_waits() -> None:
    s = SnapshotSchedule(AUTO, persist_every=50, last_step=100)
    s.policy.interval = 5
    s.taken(30, restored=True)  # older generations are dropped after the first step
    assert s.must_wait(31)
    s.waited()
    assert not s.must_wait(32) and s.must_wait(35)


def test_a_stop_between_planned_snapshots_is_unplanned() -> None:
    s = SnapshotSchedule(AUTO, persist_every=50, last_step=100)
    assert not s.unplanned(7)  # no exchange of this world yet
    s.taken(1)
    s.policy.interval = 5
    s.taken(6)
    assert s.unplanned(8) and not s.unplanned(11)


def test_the_first_windows_of_a_world_are_left_out() -> None:
    s = SnapshotSchedule(AUTO, persist_every=50, last_step=100)
    slow = window(exchange_s=1.0, wait_s=0.9)
    decided = []
    for step in range(1, 10):
        decided.append(s.agreed(slow, step) is not None)
        s.taken(step)
    # At the third snapshot the exchange before agreed on the first window (from snapshot 1
    # to 2), which measures the set-up: left out, as nothing before it exists.
    assert decided[:3] == [False, False, False] and all(decided[3:])


def test_a_report_drains_the_changes_and_reads_the_windows_run_with_a_decided_interval(
        ) -> None:
    s = SnapshotSchedule(AUTO, persist_every=50, last_step=200, budget=0.02, share=1.0)
    slow = window(exchange_s=0.35, wait_s=0.25)
    step = 0
    # Nothing agreed is used at the first three snapshots; then HISTORY windows to decide on.
    for step in range(1, 4 + HISTORY):
        s.agreed(slow, step)
        s.taken(step)
    first = s.report()
    assert first is not None and len(first.changes) == 1
    change = first.changes[0]
    assert change.previous == 1 and change.interval == first.interval > 1
    assert first.step == change.step == step
    assert first.overhead is None and first.windows == 0  # nothing measured since
    k = first.interval
    settled = window(steps=k, interval=k, exchange_s=0.35)
    # The window agreed at the next snapshot still ran with one step: left out.
    for w in (slow, settled, settled, settled):
        step += k
        s.agreed(w, step)
        s.taken(step)
    second = s.report()
    assert second.changes == () and second.windows == 3
    assert second.overhead == pytest.approx(settled.overhead(1.0))
    assert second.overhead <= second.budget


def test_replay_gives_the_steps_the_world_snapshotted() -> None:
    s = SnapshotSchedule(AUTO, persist_every=20, last_step=60)
    decisions = {6: 3, 15: 5, 41: 2}
    steps = []
    for step in range(1, 61):
        if s.due(step):
            if step in decisions:
                s.policy.interval = decisions[step]
            s.taken(step)
            steps.append(step)
    assert replay(list(decisions.items()), persist_every=20, last_step=60) == steps
    assert replay(list(decisions.items()), persist_every=20, last_step=60, up_to=30) == \
        [x for x in steps if x <= 30]
    assert 20 in steps and 40 in steps and 60 in steps  # the persist and last steps
    assert max(b - a for a, b in zip(steps, steps[1:], strict=False)) <= 5


def test_the_workers_schedule_follows_the_config_and_its_device() -> None:
    config = load_config(None, ["checkpoint.snapshot_every=auto",
                                "checkpoint.snapshot_budget=0.05",
                                "checkpoint.persist_every=40", "train.steps=100"])
    s = snapshot_schedule(config, "cpu")
    assert s.auto and s.budget == 0.05 and s.share == 1.0
    assert (s.persist_every, s.last_step, s.policy.most) == (40, 100, 40)
    assert snapshot_schedule(config, "cuda").share == 0.0
    fixed = snapshot_schedule(load_config(None, ["checkpoint.snapshot_every=2"]), "cpu")
    assert not fixed.auto and fixed.interval == 2


# ---------------------------------------------------------------------------- closed loop


class Link:
    """A world's snapshots against a modelled link and step, as the tier would time them:
    the exchange of one snapshot is waited for before the next snapshot's step ends."""

    def __init__(self, *, step_s: float, stage_s: float, exchange_s: float) -> None:
        self.step_s, self.stage_s, self.exchange_s = step_s, stage_s, exchange_s

    def window(self, steps: int, interval: int) -> Window:
        wait = max(0.0, self.exchange_s - (steps - 0.5) * self.step_s)
        return Window(steps=steps, interval=interval, step_s=self.step_s,
                      stage_s=self.stage_s, wait_s=wait, busy_s=0.0,
                      exchange_s=self.exchange_s)


def run_world(schedule: SnapshotSchedule, link: Link, steps: range,
              overheads: list[float]) -> None:
    last = schedule.anchor
    for step in steps:
        if not schedule.due(step):
            continue
        if last is not None:
            w = link.window(step - last, schedule.interval)
            schedule.agreed(w, step)
            overheads.append(w.overhead(schedule.share))
        schedule.taken(step)
        last = step


def test_a_world_on_a_slow_link_settles_under_budget_and_recovers_with_the_link() -> None:
    s = SnapshotSchedule(AUTO, persist_every=100, last_step=1000, budget=0.02, share=1.0)
    link = Link(step_s=0.1, stage_s=0.0005, exchange_s=0.01)
    overheads: list[float] = []
    run_world(s, link, range(1, 100), overheads)
    assert s.interval == 1
    link.exchange_s = 0.6  # the link slows to 6 steps per exchange
    run_world(s, link, range(100, 400), overheads)
    slow_interval = s.interval
    assert slow_interval >= 7
    assert max(overheads[-5:]) <= 0.02  # settled: under the budget
    link.exchange_s = 0.01  # and recovers
    run_world(s, link, range(400, 700), overheads)
    assert s.interval == 1
    changes = s.report().changes
    assert [c.interval > c.previous for c in changes] == [True] * (len(changes) - 1) + [False]


# ---------------------------------------------------------------------------- the tier's clock


def test_the_tiers_clock_takes_each_steps_own_time_and_the_windows_waits() -> None:
    from stalwart.checkpointing.memory.tier import WindowClock

    clock = WindowClock(on=True)
    clock.restart(stage_s=0.004)
    clock.waited(0.02)  # inside the first step: not its own time
    clock.stepped(0.12, end=10.12)
    for end, step_s in ((10.22, 0.1), (10.72, 0.5), (10.83, 0.11)):
        clock.stepped(step_s, end=end)  # one held up by something else: the median ignores it
    w = clock.window(interval=4, busy_s=0.003, exchange_s=0.3, finished_at=10.05)
    assert (w.steps, w.interval, w.stage_s, w.wait_s, w.busy_s, w.exchange_s) == \
        (4, 4, 0.004, 0.02, 0.003, 0.3)
    assert w.step_s == pytest.approx(0.105)
    clock.restart(stage_s=0.001)
    assert clock.window(interval=4, busy_s=0.0, exchange_s=0.0, finished_at=0.0).steps == 0
    off = WindowClock()  # a fixed interval keeps no figures
    off.waited(1.0)
    off.stepped(1.0)
    assert (off.steps, off.wait_s, len(off.spans)) == (0, 0.0, 0)


def test_the_clock_measures_what_the_exchange_took_from_the_steps_beside_it() -> None:
    from stalwart.checkpointing.memory.tier import WindowClock

    clock = WindowClock(on=True)
    for t0 in range(WindowClock.TOLLS_NEEDED):
        clock.restart(stage_s=0.002)
        # Steps of 0.1 s; the exchange starts in the first (+0.012 s) and ends in the third
        # (+0.008 s), sleeping on the wire in between.
        for end, own in ((1.112, 0.112), (1.212, 0.1), (1.320, 0.108), (1.420, 0.1),
                         (1.521, 0.101)):
            clock.stepped(own, end=t0 + end)
        w = clock.window(interval=5, busy_s=0.004, exchange_s=0.25, finished_at=t0 + 1.25)
        if t0 < WindowClock.TOLLS_NEEDED - 1:  # too few windows to trust yet
            assert w.contended_s == UNMEASURED
    assert w.contended_s == pytest.approx(0.012 + 0.008)
    assert w.contention(share=1.0) == pytest.approx(0.02)  # measured: not the CPU time


def window_with_toll(clock, toll: float, t0: float):  # noqa: ANN001, ANN201
    """A window of three 0.1 s steps whose exchange starts and ends in the first."""
    clock.restart(stage_s=0.0)
    for i, own in enumerate((0.1 + toll, 0.1, 0.1)):
        clock.stepped(own, end=t0 + 0.1 * (i + 1))
    return clock.window(interval=3, busy_s=0.004, exchange_s=0.01, finished_at=t0 + 0.05)


def test_the_exchanges_toll_is_the_median_of_the_last_windows() -> None:
    from stalwart.checkpointing.memory.tier import WindowClock

    clock = WindowClock(on=True)
    tolls = [window_with_toll(clock, toll, t0=10.0 * i).contended_s
             for i, toll in enumerate((0.02, 0.5, 0.01, -0.004, 0.03, 0.4, 0.025))]
    # From the fifth window on, the median of the tolls so far: a hiccup moves nothing, and
    # a step faster than its neighbours counts too (a toll below zero), so noise evens out.
    assert tolls == pytest.approx([UNMEASURED] * 4 + [0.02, 0.025, 0.025])
    low = WindowClock(on=True)
    assert [window_with_toll(low, -0.01, t0=10.0 * i).contended_s for i in range(5)][-1] == 0.0


def test_with_no_step_clear_of_the_exchange_its_cpu_time_counts() -> None:
    from stalwart.checkpointing.memory.tier import WindowClock

    clock = WindowClock(on=True)
    clock.restart(stage_s=0.002)
    clock.stepped(0.1, end=2.1)
    w = clock.window(interval=1, busy_s=0.004, exchange_s=0.05, finished_at=2.05)
    assert w.contended_s == UNMEASURED and w.contention(share=1.0) == 0.004
    assert w.contention(share=0.0) == 0.0  # a GPU worker's
