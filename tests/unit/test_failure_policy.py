"""FailurePolicy: retry or fail, the failure budget, user errors and the backoff."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.orchestrator.failures import (
    FailDecision,
    FailureKind,
    FailurePolicy,
    RetryDecision,
    WorkerFailure,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def failure(kind: FailureKind = FailureKind.WORKER_DIED, rank: int | None = 1) -> WorkerFailure:
    return WorkerFailure(kind=kind, rank=rank, message=f"{kind.value} on rank {rank}",
                         detected_at=0.0)


def test_only_user_errors_and_unmendable_numerics_are_not_retried_by_kind() -> None:
    """Within the budget, the policy retries every kind of failure but the task's own
    exceptions (failure.retry_user_errors=false by default) and a numerical fault the checks
    could not mend (a faulty device is retried: replaced, its node excluded)."""
    not_retried = {k for k in FailureKind
                   if isinstance(FailurePolicy(10).make_decision(failure(k)), FailDecision)}
    assert not_retried == {FailureKind.USER_ERROR, FailureKind.NUMERICS}


@pytest.mark.parametrize(("rank", "ranks", "expected"), [
    (1, (), (1,)),
    (None, (), ()),
    (2, (2, 3), (2, 3)),
    (None, (0, 1), (0, 1)),
])
def test_failed_ranks(rank: int | None, ranks: tuple[int, ...],
                      expected: tuple[int, ...]) -> None:
    f = WorkerFailure(kind=FailureKind.NODE_DIED, rank=rank, ranks=ranks, message="m",
                      detected_at=0.0)
    assert f.failed_ranks == expected


def test_retries_within_the_budget_then_fails_naming_every_failure() -> None:
    policy = FailurePolicy(2)
    first, second, third = (failure(FailureKind.WORKER_DIED), failure(FailureKind.HANG),
                            failure(FailureKind.NODE_DIED))
    assert policy.make_decision(first) == RetryDecision(first, attempt=1, delay_s=0.0)
    assert policy.make_decision(second) == RetryDecision(second, attempt=2, delay_s=0.0)
    decision = policy.make_decision(third)
    assert decision == FailDecision(third, "failure budget exhausted (failure.max_failures=2; "
                                           "failures: worker_died, hang, node_died)")
    assert policy.failures == 3 and policy.history == [first, second, third]


def test_no_budget_fails_at_the_first_failure() -> None:
    policy = FailurePolicy(0)
    f = failure(FailureKind.START_ERROR, rank=None)
    assert policy.make_decision(f) == FailDecision(
        f, "failure budget exhausted (failure.max_failures=0; failures: start_error)")


def test_minus_one_is_no_limit() -> None:
    policy = FailurePolicy(-1)
    for n in range(1, 201):
        decision = policy.make_decision(failure())
        assert isinstance(decision, RetryDecision) and decision.attempt == n


def test_progress_does_not_refill_the_budget() -> None:
    policy = FailurePolicy(1)
    assert isinstance(policy.make_decision(failure()), RetryDecision)
    policy.made_progress()
    assert isinstance(policy.make_decision(failure()), FailDecision)


@pytest.mark.parametrize("budget", [0, 3, -1])
def test_a_user_error_fails_at_once_whatever_the_budget(budget: int) -> None:
    policy = FailurePolicy(budget)
    f = failure(FailureKind.USER_ERROR, rank=0)
    assert policy.make_decision(f) == FailDecision(
        f, "an exception in the training code is not retried "
           "(failure.retry_user_errors=false)")


def test_user_errors_are_retried_when_configured_and_count_against_the_budget() -> None:
    policy = FailurePolicy(1, retry_user_errors=True)
    f = failure(FailureKind.USER_ERROR, rank=0)
    assert policy.make_decision(f) == RetryDecision(f, attempt=1, delay_s=0.0)
    decision = policy.make_decision(f)
    assert isinstance(decision, FailDecision)
    assert decision.reason == ("failure budget exhausted (failure.max_failures=1; "
                               "failures: user_error, user_error)")


def test_no_backoff_by_default() -> None:
    policy = FailurePolicy(-1)
    assert [policy.make_decision(failure()).delay_s for _ in range(5)] == [0.0] * 5


def test_backoff_doubles_for_consecutive_failures_up_to_a_minute() -> None:
    policy = FailurePolicy(-1, backoff_s=1.5)
    delays = [policy.make_decision(failure()).delay_s for _ in range(9)]
    assert delays == [1.5, 3.0, 6.0, 12.0, 24.0, 48.0, 60.0, 60.0, 60.0]
    assert FailurePolicy.MAX_DELAY_S == 60.0


def test_progress_resets_the_backoff_streak() -> None:
    policy = FailurePolicy(-1, backoff_s=2.0)
    assert [policy.make_decision(failure()).delay_s for _ in range(3)] == [2.0, 4.0, 8.0]
    policy.made_progress()
    assert policy.consecutive == 0
    assert [policy.make_decision(failure()).delay_s for _ in range(2)] == [2.0, 4.0]
    assert policy.failures == 5


def test_a_failed_decision_has_no_delay_to_wait() -> None:
    policy = FailurePolicy(1, backoff_s=10.0)
    assert policy.make_decision(failure()).delay_s == 10.0
    assert isinstance(policy.make_decision(failure()), FailDecision)


def test_unlimited_failures_keep_backing_off_at_the_cap() -> None:
    policy = FailurePolicy(-1, backoff_s=0.5)
    for _ in range(1100):
        decision = policy.make_decision(failure())
    assert isinstance(decision, RetryDecision) and decision.delay_s == 60.0


def test_the_failure_log_names_what_failed_from_the_members_it_is_given(tmp_path: Path) -> None:
    """FailureLog: the policy's decision, written as a `failure` event whose nodes and pids
    come from the places it is handed (no group asked)."""
    from stalwart.core.events import WorkerPlace, read_jsonl
    from stalwart.core.run_logs import EventLog
    from stalwart.orchestrator.failure_log import FailureLog

    places = [WorkerPlace(rank=r, pid=100 + r, node_ip=f"10.0.0.{r + 1}", node_id=f"n{r}")
              for r in range(3)]
    log = FailureLog(FailurePolicy(1), EventLog(tmp_path / "events.jsonl"))
    died = WorkerFailure(kind=FailureKind.WORKER_DIED, rank=2, ranks=(2,), message="gone",
                         detected_at=10.0, last_seen=9.25)
    # a world that failed while forming: its members are not yet the running world's
    assert isinstance(log.decide(died, workers=places[:2], members=places, step=7),
                      RetryDecision)
    silent = WorkerFailure(kind=FailureKind.HANG, rank=0, ranks=(0,), pids=(100,),
                           message="silent", detected_at=11.0)
    assert isinstance(log.decide(silent, workers=places, members=[], step=7), FailDecision)
    first, second = read_jsonl(tmp_path / "events.jsonl")
    assert (first["nodes"], first["pids"], first["detection_s"], first["retry"],
            first["attempt"]) == (["10.0.0.3"], [102], 0.75, True, 1)
    # pids known: named among the world's workers
    assert (second["nodes"], second["pids"], second["retry"]) == (["10.0.0.1"], [100], False)
