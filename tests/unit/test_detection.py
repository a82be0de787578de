"""The failure detector on its own (orchestrator/detection.py): what one poll's answers say
failed, and when it began. No group, fake or real: each poll is a PollView built here, the
time and LastSeen are plain values."""

from __future__ import annotations

import pytest

from stalwart.core.config import load_config
from stalwart.core.events import WorkerPlace
from stalwart.orchestrator import classify
from stalwart.orchestrator.detection import FailureDetector, LastSeen
from stalwart.orchestrator.failures import FailureKind
from stalwart.orchestrator.group import PollView
from stalwart.workers.reports import StepReport, WorkerStatus

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# ranks 0, 1 on node a; ranks 2, 3 on node b
PLACES = [WorkerPlace(rank=r, pid=100 + r, node_ip=f"10.0.0.{r // 2 + 1}",
                      node_id="ab"[r // 2]) for r in range(4)]
USER = "Traceback (most recent call last):\n  ...\nValueError: bad batch"
COLLECTIVE = "torch.distributed.DistBackendError: Connection closed by peer"


def detector(grace_s: float = 1.0) -> FailureDetector:
    """A detector that saw a world of four form and launch at t=0 (hang limit: 2 s)."""
    config = load_config(None, ["failure.hang_timeout_floor_s=2", "failure.hang_factor=1",
                                "scaling.start_timeout_s=2"])
    d = FailureDetector(config, collective_grace_s=grace_s)
    d.after_form(0, PLACES, 0.0)
    d.after_launch(0, 4, 0.0)
    return d


def answer(rank: int, step: int | None = None, *, error: str | None = None,
           error_kind: str | None = None) -> WorkerStatus:
    steps = [] if step is None else [StepReport(rank=rank, step=step, loss=1.0, lr=0.1,
                                                tokens=8, step_time_s=0.1, time=float(step))]
    return WorkerStatus(rank=rank, generation=0, steps=steps, commits=[], done=False,
                        error=error, error_kind=error_kind)


def heard(d: FailureDetector, now: float, statuses: list[WorkerStatus]) -> PollView:
    """What the controller does with a poll before it asks the detector: each status is seen."""
    for st in statuses:
        d.on_status(st.rank, st, now)
    return PollView(answered={st.rank: st for st in statuses})


def test_nothing_wrong_is_no_failure() -> None:
    d = detector()
    assert d.find(heard(d, 1.0, [answer(r, 1) for r in range(4)]), 1.0, LastSeen()) is None


def test_a_death_outranks_a_stop_an_exception_and_a_collective() -> None:
    d = detector()
    poll = PollView(answered={0: answer(0, error=USER, error_kind="user"),
                              1: answer(1, error=COLLECTIVE, error_kind="collective")},
                    dead=(classify.process_stopped(2, 102, 0.5, 1.0),
                          classify.process_exited(3, 103, 0.8, 1.0)))
    failure = d.find(poll, 1.0, LastSeen(last_step_end=0.2))
    assert (failure.kind, failure.ranks) == (FailureKind.WORKER_DIED, (3,))
    assert failure.last_seen == 0.8  # the agent's last sight of it beats the newest step


def test_deaths_on_a_node_the_group_says_is_gone_are_a_node_death() -> None:
    dead = (classify.poll_failed(2, "worker rank 2 died: x", 1.0),
            classify.poll_failed(3, "worker rank 3 died: y", 1.0))
    on_b = detector().find(PollView(answered={}, dead=dead, lost_nodes=frozenset({"b"})),
                           1.0, LastSeen())
    assert (on_b.kind, on_b.ranks) == (FailureKind.NODE_DIED, (2, 3))
    assert on_b.message == "worker ranks [2, 3] died (node(s) ['b']): worker rank 2 died: x"
    # a node the group lost that holds none of them says nothing about these deaths
    elsewhere = detector().find(PollView(answered={}, dead=dead, lost_nodes=frozenset({"a"})),
                                1.0, LastSeen())
    assert elsewhere.kind is FailureKind.WORKER_DIED


def test_stopped_ranks_are_a_hang_at_once() -> None:
    poll = PollView(answered={}, dead=(classify.process_stopped(1, 101, 0.5, 1.0),
                                       classify.node_silent(2, 102, "b", 0.6, 0.4, 1.0)))
    failure = detector().find(poll, 1.0, LastSeen())
    assert (failure.kind, failure.rank, failure.ranks) == (FailureKind.HANG, 1, (1, 2))
    assert failure.last_seen == 0.5  # the newest sign of life of the ranks


def test_a_rank_silent_past_the_limit_is_a_hang() -> None:
    d = detector()
    poll = heard(d, 1.0, [answer(r, 1) for r in range(4)])
    assert d.find(poll, 1.0, LastSeen()) is None
    poll = heard(d, 3.5, [answer(r, 2) for r in (0, 1, 3)])  # rank 2: not since t=1
    failure = d.find(poll, 3.5, LastSeen(last_step_end=2.0))
    assert (failure.kind, failure.ranks) == (FailureKind.HANG, (2,))
    assert failure.last_seen == 1.0  # its last answer, not the newest step's end
    assert "worker rank(s) [2] stopped answering for 2.5s (limit 2.0s" in failure.message


def test_the_rank_that_raised_is_blamed_not_the_peer_whose_collective_failed() -> None:
    d = detector()
    poll = heard(d, 1.0, [answer(0, error=COLLECTIVE, error_kind="collective"),
                          answer(2, error=USER, error_kind="user"),
                          answer(3, error=USER, error_kind="user")])
    failure = d.find(poll, 1.0, LastSeen(fault_times={2: 0.9}))
    assert (failure.kind, failure.ranks, failure.message) == (FailureKind.USER_ERROR, (2,),
                                                              USER)
    assert failure.last_seen == 0.9  # an injected fault dates it


def test_a_collective_error_alone_waits_for_the_grace_period() -> None:
    d = detector(grace_s=1.0)
    failed = [answer(0, error=COLLECTIVE, error_kind="collective")]
    assert d.find(heard(d, 1.0, failed), 1.0, LastSeen()) is None
    assert d.find(heard(d, 1.5, failed), 1.5, LastSeen()) is None
    failure = d.find(heard(d, 2.0, failed), 2.0, LastSeen())
    assert (failure.kind, failure.rank, failure.failed_ranks) == (
        FailureKind.COLLECTIVE_ERROR, None, ())


def test_last_seen_is_a_fault_then_a_heartbeat_then_the_newest_step() -> None:
    seen = LastSeen(fault_times={1: 5.0, 2: 6.0}, last_step_end=3.0)
    assert seen.at((1, 2), heartbeat=4.0) == 6.0  # the latest fault of these ranks
    assert seen.at((0,), heartbeat=4.0) == 4.0
    assert seen.at((0,)) == 3.0
    assert LastSeen().at((0,)) is None
