"""The numerical-fault policy as pure data: the spike detector, the replica comparison, the
decision on each finding, the failure it becomes on the driver, and how the report counts it."""

from __future__ import annotations

import math

import pytest

from stalwart.core import events as E
from stalwart.core.numerics import (
    Action,
    Fault,
    Finding,
    Limits,
    NumericsState,
    ReplicaCheck,
    SpikeDetector,
    compare_replicas,
    decide,
)
from stalwart.orchestrator import classify
from stalwart.orchestrator.failures import FailDecision, FailureKind, FailurePolicy, RetryDecision
from stalwart.report.summary import summarize
from stalwart.report.table import format_summary, numerical_line
from tests.unit.test_report import ev

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

LIMITS = Limits(max_skips=2, evict_after=2)


def warm_detector(losses: list[float], z: float = 6.0, window: int = 10,
                  warmup: int = 0) -> SpikeDetector:
    detector = SpikeDetector(z, window, warmup)
    for loss in losses:
        detector.accept(loss)
    return detector


# ---------------------------------------------------------------------------- SpikeDetector


def test_spike_score_is_the_robust_z_against_median_and_mad() -> None:
    detector = warm_detector([1.0, 2.0, 3.0, 4.0, 5.0])  # median 3, MAD 1
    assert detector.score(3.0) == pytest.approx(0.0)
    assert detector.score(3.0 + 1.4826 * 6) == pytest.approx(6.0)
    assert detector.score(1.0) == pytest.approx(-2 / 1.4826)  # below the median: negative


def test_a_spike_is_strictly_above_z() -> None:
    detector = warm_detector([1.0, 2.0, 3.0, 4.0, 5.0], z=6.0)
    assert not detector.is_spike(3.0 + 1.4826 * 5.9)
    assert detector.is_spike(3.0 + 1.4826 * 6.1)
    assert not detector.is_spike(-1000.0)  # a loss falling fast is no spike


def test_the_check_is_off_with_z_zero() -> None:
    detector = warm_detector([1.0] * 10, z=0.0)
    assert detector.score(1e9) is None and not detector.is_spike(1e9)


def test_the_check_is_off_during_warmup_and_needs_five_losses() -> None:
    detector = SpikeDetector(6.0, 10, warmup=7)
    for loss in [1.0] * 6:
        detector.accept(loss)
        assert detector.score(1e6) is None
    detector.accept(1.0)  # the 7th accepted loss
    assert detector.is_spike(1e6)
    # warm-up 0 still waits for 5 losses: a median and a MAD need a few
    quick = SpikeDetector(6.0, 10, warmup=0)
    for loss in [1.0] * 4:
        quick.accept(loss)
    assert quick.score(1e6) is None
    quick.accept(1.0)
    assert quick.is_spike(1e6)


def test_a_flat_loss_uses_the_relative_floor_on_the_scale() -> None:
    # MAD 0: the scale is 1% of the median, so a wobble of 5% scores 5, of 7% scores 7
    detector = warm_detector([2.0] * 10, z=6.0)
    assert detector.score(2.1) == pytest.approx(5.0)
    assert not detector.is_spike(2.1)
    assert detector.is_spike(2.14)


def test_a_loss_near_zero_scores_finitely() -> None:
    detector = warm_detector([0.0] * 10)
    score = detector.score(1e-6)
    assert score is not None and math.isfinite(score) and score > 6


def test_not_finite_losses_are_neither_scored_nor_accepted() -> None:
    detector = warm_detector([1.0] * 10)
    assert detector.score(math.nan) is None and detector.score(math.inf) is None
    detector.accept(math.nan)
    detector.accept(-math.inf)
    assert detector.accepted == 10 and list(detector.losses) == [1.0] * 10


def test_the_window_keeps_the_last_accepted_losses() -> None:
    detector = warm_detector([100.0] * 5 + [1.0] * 5, window=5)
    assert list(detector.losses) == [1.0] * 5 and detector.accepted == 10
    assert detector.is_spike(2.0)  # against the last five, not the early 100s


# ---------------------------------------------------------------------------- NumericsState


def test_numerics_state_json_round_trip() -> None:
    state = NumericsState(skipped=[3, 17], losses=[2.5, 2.25, 0.1 + 0.2], accepted=42)
    back = NumericsState.from_json(state.to_json())
    assert back == state
    assert back.losses[2] == 0.1 + 0.2  # bit-exact: the spike check must replay the same


def test_numerics_state_from_empty_text_is_fresh() -> None:
    assert NumericsState.from_json("") == NumericsState()
    assert NumericsState.from_json("{}") == NumericsState()


# ---------------------------------------------------------------------------- compare_replicas


def test_identical_replicas_do_not_differ() -> None:
    check = compare_replicas([7, 7, 7, 7], [0, 0, 0, 0])
    assert check == ReplicaCheck() and not check.differs


def test_ranks_of_different_classes_may_differ() -> None:
    # two shards, each replicated twice: shard 0 on ranks 0 and 2, shard 1 on 1 and 3
    check = compare_replicas([5, 9, 5, 9], ["s0", "s1", "s0", "s1"])
    assert not check.differs


def test_the_rank_differing_from_a_strict_majority_is_odd() -> None:
    check = compare_replicas([4, 4, 8], [0, 0, 0])
    assert check == ReplicaCheck(odd=(2,)) and check.differs


def test_several_odd_ranks_in_one_group() -> None:
    assert compare_replicas([1, 2, 1, 3, 1], [0] * 5) == ReplicaCheck(odd=(1, 3))


def test_two_replicas_that_differ_are_a_split() -> None:
    assert compare_replicas([1, 2], [0, 0]) == ReplicaCheck(split=(0, 1))


def test_an_even_split_or_no_majority_names_the_whole_group() -> None:
    assert compare_replicas([1, 1, 2, 2], [0] * 4) == ReplicaCheck(split=(0, 1, 2, 3))
    assert compare_replicas([1, 2, 3], [0] * 3) == ReplicaCheck(split=(0, 1, 2))


def test_groups_are_judged_apart() -> None:
    # class a (ranks 0, 2, 4): rank 4 odd; class b (ranks 1, 3): split; class c agrees
    fingerprints = [10, 20, 10, 21, 11, 30, 30]
    classes = ["a", "b", "a", "b", "a", "c", "c"]
    assert compare_replicas(fingerprints, classes) == ReplicaCheck(odd=(4,), split=(1, 3))


def test_a_lone_rank_never_differs() -> None:
    assert not compare_replicas([1, 2, 3], ["x", "y", "z"]).differs


# ---------------------------------------------------------------------------- decide


def nan_at(step: int = 20) -> Finding:
    return Finding(Fault.NAN, step, (), "loss not finite")


def mismatch(*ranks: int, step: int = 40, attributed: bool = True) -> Finding:
    return Finding(Fault.MISMATCH, step, ranks, "differ", attributed=attributed)


@pytest.mark.parametrize("fault", [Fault.NAN, Fault.SPIKE])
def test_a_first_failure_is_replayed(fault: Fault) -> None:
    finding = Finding(fault, 20)
    decision = decide(finding, attempt=1, skips=0, strikes={}, verified=None, limits=LIMITS)
    assert decision.action is Action.REPLAY and decision.finding == finding
    assert decision.rollback_to is None


@pytest.mark.parametrize("fault", [Fault.NAN, Fault.SPIKE])
def test_a_failed_replay_is_skipped_while_skips_remain(fault: Fault) -> None:
    for skips in range(LIMITS.max_skips):
        decision = decide(Finding(fault, 20), attempt=2, skips=skips, strikes={},
                          verified=None, limits=LIMITS)
        assert decision.action is Action.SKIP


@pytest.mark.parametrize("fault", [Fault.NAN, Fault.SPIKE])
def test_a_failed_replay_stops_once_the_skips_are_spent(fault: Fault) -> None:
    decision = decide(Finding(fault, 20), attempt=2, skips=2, strikes={}, verified=None,
                      limits=LIMITS)
    assert decision.action is Action.STOP
    assert "numerics.max_skips = 2" in decision.reason


def test_max_skips_zero_stops_a_failed_replay() -> None:
    decision = decide(nan_at(), attempt=2, skips=0, strikes={}, verified=None,
                      limits=Limits(max_skips=0, evict_after=2))
    assert decision.action is Action.STOP


def test_a_mismatch_rolls_back_to_verified() -> None:
    decision = decide(mismatch(1), attempt=1, skips=0, strikes={1: 1}, verified=38,
                      limits=LIMITS)
    assert decision.action is Action.ROLLBACK and decision.rollback_to == 38
    assert "38" in decision.reason


def test_a_mismatch_is_rolled_back_whatever_the_attempt_and_skips() -> None:
    decision = decide(mismatch(1), attempt=3, skips=99, strikes={1: 1}, verified=5,
                      limits=LIMITS)
    assert decision.action is Action.ROLLBACK


def test_a_mismatch_with_nothing_verified_stops() -> None:
    decision = decide(mismatch(1), attempt=1, skips=0, strikes={1: 1}, verified=None,
                      limits=LIMITS)
    assert decision.action is Action.STOP and decision.rollback_to is None


def test_a_rank_with_evict_after_strikes_is_evicted() -> None:
    decision = decide(mismatch(1), attempt=1, skips=0, strikes={1: 2}, verified=38,
                      limits=LIMITS)
    assert decision.action is Action.EVICT and decision.rollback_to == 38
    assert "[1]" in decision.reason and "2 time(s)" in decision.reason


def test_eviction_comes_before_a_missing_snapshot() -> None:
    decision = decide(mismatch(3), attempt=1, skips=0, strikes={3: 1}, verified=None,
                      limits=Limits(max_skips=0, evict_after=1))
    assert decision.action is Action.EVICT and decision.rollback_to is None


def test_strikes_of_ranks_not_named_do_not_evict() -> None:
    decision = decide(mismatch(1), attempt=1, skips=0, strikes={0: 5, 1: 1}, verified=7,
                      limits=LIMITS)
    assert decision.action is Action.ROLLBACK


def test_eviction_names_only_the_ranks_that_reached_evict_after() -> None:
    decision = decide(mismatch(3, 4), attempt=1, skips=0, strikes={3: 2, 4: 1}, verified=7,
                      limits=LIMITS)
    assert decision.action is Action.EVICT
    assert decision.reason.startswith("rank(s) [3] differed from their replicas 2 time(s)")


# ---------------------------------------------------------------------------- on the driver


def test_an_eviction_is_a_faulty_device_naming_its_ranks() -> None:
    failure = classify.numerical(0, "numerical fault at step 40", (2, 3), now=10.0,
                                 last_seen=9.5)
    assert failure.kind is FailureKind.FAULTY_DEVICE
    assert failure.rank == 2 and failure.ranks == (2, 3) and failure.failed_ranks == (2, 3)
    assert failure.message == "numerical fault at step 40"
    assert (failure.detected_at, failure.last_seen) == (10.0, 9.5)


def test_a_stop_is_a_numerics_failure_with_no_rank_to_replace() -> None:
    failure = classify.numerical(1, "max_skips spent", (), now=10.0, last_seen=None)
    assert failure.kind is FailureKind.NUMERICS
    assert failure.rank is None and failure.failed_ranks == ()
    assert failure.message == "max_skips spent"


@pytest.mark.parametrize("max_failures", [-1, 0, 5])
def test_a_numerics_failure_is_never_retried(max_failures: int) -> None:
    failure = classify.numerical(0, "stop", (), now=1.0, last_seen=None)
    decision = FailurePolicy(max_failures).make_decision(failure)
    assert isinstance(decision, FailDecision) and "[numerics]" in decision.reason


def test_a_faulty_device_is_retried_within_the_budget() -> None:
    policy = FailurePolicy(2)
    failures = [classify.numerical(0, "evict", (r,), now=1.0, last_seen=None)
                for r in (1, 2, 3)]
    assert isinstance(policy.make_decision(failures[0]), RetryDecision)
    assert isinstance(policy.make_decision(failures[1]), RetryDecision)
    last = policy.make_decision(failures[2])
    assert isinstance(last, FailDecision) and "faulty_device" in last.reason


# ---------------------------------------------------------------------------- the report


def fault_event(time: float, step: int, fault: str, action: str, ranks: list[int] | None = None,
                rollback_to: int | None = None) -> E.Event:
    return ev(time, "numerical_fault", step=step, fault=fault, action=action,
              ranks=ranks or [], rollback_to=rollback_to, detail="d", reason="r",
              decided_s=0.01)


def test_numerical_line_counts_by_fault_and_by_action() -> None:
    faults = [{"fault": "nan", "action": "replay"}, {"fault": "spike", "action": "replay"},
              {"fault": "spike", "action": "skip"}]
    assert numerical_line(faults) == "numerical faults: 3 (nan 1, spike 2; replay 2, skip 1)"


def test_the_summary_picks_up_numerical_fault_events() -> None:
    places = [{"rank": r, "pid": 100 + r, "node_ip": "127.0.0.1", "node_id": "n"}
              for r in range(2)]
    events = [ev(0.0, "started", world_size=2, steps=40, start_step=0),
              ev(0.0, "workers_started", generation=0, world_size=2, workers=places),
              fault_event(20.0, 20, "nan", "replay"),
              fault_event(30.0, 30, "spike", "replay"),
              fault_event(30.5, 30, "spike", "skip"),
              fault_event(40.0, 40, "mismatch", "rollback", ranks=[1], rollback_to=38),
              ev(42.0, "finished", step=40, loss=0.25, val_loss=None)]
    rows = [E.MetricsRow(step=s, loss=1.0, lr=1e-3, world_size=2, tokens_per_s=1000.0,
                         samples_seen=8 * s, time=float(s), window_s=5.0, steps_in_window=5)
            for s in range(5, 41, 5)]
    summary = summarize(events, rows, now=99.0, steps_total=40)
    assert summary.numerical_faults == [
        {"step": 20, "fault": "nan", "action": "replay", "ranks": [], "rollback_to": None},
        {"step": 30, "fault": "spike", "action": "replay", "ranks": [], "rollback_to": None},
        {"step": 30, "fault": "spike", "action": "skip", "ranks": [], "rollback_to": None},
        {"step": 40, "fault": "mismatch", "action": "rollback", "ranks": [1],
         "rollback_to": 38}]
    text = format_summary(summary, "runs/x")
    assert ("numerical faults: 4 (mismatch 1, nan 1, spike 2; replay 2, rollback 1, skip 1)"
            in text.splitlines())


def test_trackers_count_numerical_faults_and_describe_each() -> None:
    from stalwart.core.events import NumericalFault
    from stalwart.integrations.run_log import EventScalars, describe

    scalars = EventScalars()
    fault = NumericalFault(step=20, fault="nan", action="replay", ranks=[], rollback_to=None,
                           detail="a loss or gradient norm not finite on 1 rank(s)",
                           reason="first failure of this step", decided_s=0.01)
    assert scalars.of(fault) == {"events/numerical_faults": 1}
    assert scalars.of(fault) == {"events/numerical_faults": 2}
    assert describe(fault) == ("nan at step 20: replay (a loss or gradient norm not finite on "
                               "1 rank(s))")
