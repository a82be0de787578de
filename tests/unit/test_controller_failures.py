"""What is blamed for a failure, and injected faults; the controller driven by the fake worker group
(tests/unit/controller_world.py, tests/fake_group.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.core.config import parse_fault
from stalwart.core.events import WorkerPlace
from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.orchestrator.reporting import failure_line
from stalwart.orchestrator.states import Failed, Finished
from stalwart.workers.faults import FaultFired
from stalwart.workers.reports import WorkerStatus
from tests.fake_group import DRIVER_NODE, Plan, Poll, actors
from tests.unit.controller_world import (
    COLLECTIVE_ERROR,
    HANG_LIMIT,
    T0,
    T1,
    T2,
    USER_ERROR,
    FakeWorld,
    status,
    statuses,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


# ---------------------------------------------------------------------------- what failed


def test_a_rank_that_stops_answering_is_a_hang(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    silent = Poll([status(0)])  # rank 1's polls never return; rank 0 waits in a collective
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2]), *[silent] * 5]),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=1", *HANG_LIMIT])
    assert w.run() == Finished(step=6)
    # rank 1 last answered at T0+2; at T0+4.5 it has been silent 2.5 s > the 2 s limit
    assert w.group.unused_polls() == {}
    fail = w.event("failure")
    assert fail["failure_kind"] == "hang" and fail["rank"] == 1 and fail["ranks"] == [1]
    assert fail["message"] == (
        "hang: worker rank(s) [1] stopped answering for 2.5s (limit 2.0s = "
        "max(failure.hang_timeout_floor_s, failure.hang_factor x median step time))")
    assert fail["detection_s"] == 2.5  # from its last answer
    assert w.named("remove")[0].args == ((1,),) and w.killed() == [1001]


def test_everyone_answering_but_nobody_progressing_is_a_hang_with_no_rank_blamed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stalled = statuses([])
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2]), *[stalled] * 5]),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=1", *HANG_LIMIT])
    assert w.run() == Finished(step=6)
    assert w.group.unused_polls() == {}
    fail = w.event("failure")
    assert fail["failure_kind"] == "hang" and fail["rank"] is None and fail["ranks"] == []
    assert fail["message"] == (
        "hang: no rank completed a step for 2.5s (limit 2.0s = "
        "max(failure.hang_timeout_floor_s, failure.hang_factor x median step time))")
    assert fail["detection_s"] == 2.5
    # the stuck rank cannot be told from the ranks it holds up: nobody is killed up front;
    # the survivors leave (the group kills those that cannot)
    assert w.named("remove")[0].args == ((),) and w.killed() == []
    assert w.event("recovered")["lost_steps"] == 2


def test_no_hang_before_the_first_step_within_the_start_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 10 s without a step is far past the 2 s limit, but the first step may compile
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        *[statuses([])] * 20, statuses(range(1, 7), done=True, t0=T0 + 20)])],
        [*HANG_LIMIT, "scaling.start_timeout_s=30"])
    assert w.run() == Finished(step=6)
    assert w.all("failure") == []


def test_a_done_rank_does_not_hide_a_stuck_peer(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    stuck = [status(0, done=True), status(1)]
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        statuses([1, 2, 3, 4, 5]),
        [status(0, [6], done=True), status(1, [6])],
        *[stuck] * 10,                   # 5 s: rank 1 answers, never finishes
        statuses([], done=True),         # (only there so the run ends at all)
    ])], HANG_LIMIT)
    final = w.run()
    assert [e["failure_kind"] for e in w.all("failure")] == ["hang"]
    assert isinstance(final, Failed)


@pytest.mark.parametrize(("answered", "dead", "kind", "rank"), [
    # a dead rank outranks the failed collectives it causes on its peers...
    ([status(0, error=COLLECTIVE_ERROR, error_kind="collective")], [1], "worker_died", 1),
    # ...and an exception elsewhere in the same poll
    ([status(0, error=USER_ERROR, error_kind="user")], [1], "worker_died", 1),
    # the rank that raised is blamed, not the peer whose collective failed because of it
    ([status(0, error=COLLECTIVE_ERROR, error_kind="collective"),
      status(1, error=USER_ERROR, error_kind="user")], [], "user_error", 1),
    ([status(0, error=USER_ERROR, error_kind="user"),
      status(1, error=USER_ERROR, error_kind="user")], [], "user_error", 0),
])
def test_what_is_blamed_when_several_things_go_wrong(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answered: list[WorkerStatus],
        dead: list[int], kind: str, rank: int) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[statuses([1, 2]),
                                                      Poll(answered, dead=dead)])],
                  collective_grace_s=0.0)
    assert isinstance(w.run(), Failed)
    fail = w.event("failure")
    assert (fail["failure_kind"], fail["rank"], fail["ranks"]) == (kind, rank, [rank])


def test_ranks_on_a_lost_node_are_a_node_death(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    def lose_node_b(w: FakeWorld) -> None:
        w.group.dead_nodes.add("node-b")

    cluster = [*actors(2), *actors(2, first_pid=2000, node="node-b", ip="10.0.0.2")]
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        statuses([1, 2], world=4),
        Poll([status(0), status(1)], dead=[2, 3], hook=lose_node_b),
    ])], ["scaling.num_workers=4"], cluster=cluster)
    assert isinstance(w.run(), Failed)
    fail = w.event("failure")
    assert fail["failure_kind"] == "node_died"
    assert fail["rank"] == 2 and fail["ranks"] == [2, 3] and fail["nodes"] == ["10.0.0.2"]
    assert fail["message"] == ("worker ranks [2, 3] died (node(s) ['node-b']): worker rank 2 "
                               "died: the actor died unexpectedly")


def test_a_lost_node_is_named_on_the_console_with_its_ranks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def lose_node_b(w: FakeWorld) -> None:
        w.group.dead_nodes.add("node-b-0123456789")

    cluster = [*actors(2), *actors(2, first_pid=2000, node="node-b-0123456789", ip="10.0.0.2"),
               *actors(2, first_pid=3000, node="node-c", ip="10.0.0.3")]
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2], world=4),
                    Poll([status(0), status(1)], dead=[2, 3], hook=lose_node_b)]),
        Plan(polls=[statuses([1, 2, 3, 4, 5, 6], world=4, done=True, t0=T1)]),
    ], ["scaling.num_workers=4", "failure.max_failures=1"], cluster=cluster)
    assert w.run() == Finished(step=6)
    # One line, in the worker deaths' style: the node's IP and id (shortened), its ranks.
    assert "recovering from: node 10.0.0.2 (node-b-0) lost, with ranks 2, 3" in w.display.logs


def test_the_console_line_names_each_lost_node_and_every_rank_it_held() -> None:
    places = [WorkerPlace(rank=r, pid=1000 + r, node_ip=ip, node_id=node) for r, ip, node in [
        (0, "10.0.0.1", "aaaaaaaaaaaa"), (1, "10.0.0.2", "bbbbbbbbbbbb"),
        (2, "10.0.0.3", "cccccccccccc")]]

    def line(kind: FailureKind, ranks: tuple[int, ...], message: str = "m") -> str:
        return failure_line(WorkerFailure(kind=kind, rank=ranks[0], ranks=ranks,
                                          message=message, detected_at=0.0), places)

    assert line(FailureKind.NODE_DIED, (1,)) == "node 10.0.0.2 (bbbbbbbb) lost, with rank 1"
    assert line(FailureKind.NODE_DIED, (2, 1)) == (
        "nodes 10.0.0.2 (bbbbbbbb), 10.0.0.3 (cccccccc) lost, with ranks 2, 1")
    # Any other failure: its message's last line (a traceback's is the exception).
    assert line(FailureKind.WORKER_DIED, (1,), "worker rank 1 (pid 1001) exited") == (
        "worker rank 1 (pid 1001) exited")
    assert line(FailureKind.USER_ERROR, (1,), "Traceback:\n  ...\nValueError: x\n") == (
        "ValueError: x")


def test_a_collective_error_alone_waits_for_the_grace_period(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    failed = [status(0, error=COLLECTIVE_ERROR, error_kind="collective"),
              status(1, error=COLLECTIVE_ERROR, error_kind="collective")]
    w = FakeWorld(tmp_path, monkeypatch, [
        # seen at T0+2.5, still alone at T0+3.0, acted on at T0+3.5 (1 s later)
        Plan(polls=[statuses([1, 2]), failed, failed, failed]),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=1"], collective_grace_s=1.0)
    assert w.run() == Finished(step=6)
    assert w.group.unused_polls() == {}
    fail = w.event("failure")
    assert fail["failure_kind"] == "collective_error"
    assert fail["rank"] is None and fail["ranks"] == []
    assert fail["message"] == ("worker rank 0: a collective failed with no rank to blame:\n"
                               f"{COLLECTIVE_ERROR}")
    assert w.named("remove")[0].args == ((),)


def test_a_death_within_the_grace_period_is_what_is_blamed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    peer_failed = [status(0, error=COLLECTIVE_ERROR, error_kind="collective")]
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        statuses([1, 2]), peer_failed, Poll(peer_failed, dead=[1])])], collective_grace_s=1.0)
    assert isinstance(w.run(), Failed)
    fail = w.event("failure")
    assert fail["failure_kind"] == "worker_died" and fail["rank"] == 1


# ---------------------------------------------------------------------------- injected faults


def test_an_injected_fault_is_reported_acknowledged_and_not_armed_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fired = FaultFired(fault=parse_fault("kill:rank=1,step=3"), rank=1, time=T0 + 2.1)
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[
            statuses([1, 2]),
            [status(0), status(1, faults=[fired])],   # heard at T0+2.5
            Poll([status(0)], dead=[1]),              # found dead at T0+3.0
        ]),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=1"], faults=["kill:rank=1,step=3"])
    assert w.run() == Finished(step=6)

    assert w.group.armed == {0: {1: [parse_fault("kill:rank=1,step=3")]}, 1: {}}
    assert w.controller.faults.plan.pending == []
    assert [(c.state, c.args) for c in w.named("ack_faults")] == [("RUNNING", (1,))]
    assert w.kinds() == ["started", "fault_injected", "failure", "recovered", "finished"]
    injected = w.event("fault_injected")
    assert (injected["fault"], injected["rank"], injected["step"]) == ("kill:rank=1,step=3", 1, 3)
    # detection is measured from the fault (it happens once acknowledged), not from the end
    # of step 2, the last heartbeat
    assert w.event("failure")["detection_s"] == 0.5
    assert w.event("recovered")["recovery_s"] == T1 + 1 - (T0 + 2.5)


def test_a_fault_with_no_target_is_reported(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # every worker is on the driver's node (node 0): no node 1 to kill
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[statuses(range(1, 7), done=True)])],
                  cluster=actors(2, node=DRIVER_NODE), faults=["kill-node:node=1,step=3"])
    assert w.run() == Finished(step=6)
    assert w.group.armed == {0: {}}
    assert w.event("fault_skipped")["message"] == (
        "fault kill-node:node=1,step=3 has no target now: the workers are on node(s) [0] "
        "(node 0: the driver's)")


def test_an_old_fault_does_not_date_a_later_failure(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fired = FaultFired(fault=parse_fault("kill:rank=1,step=3"), rank=1, time=T0 + 2.1)
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2]), [status(0), status(1, faults=[fired])],
                    Poll([status(0)], dead=[1])]),
        # the new rank 1 dies on its own, 0.5 s after the end of step 3
        Plan(polls=[statuses([1, 2, 3], t0=T1), Poll([status(0)], dead=[1])]),
        Plan(polls=[statuses(range(1, 7), done=True, t0=T2)]),
    ], ["failure.max_failures=2"], faults=["kill:rank=1,step=3"])
    assert w.run() == Finished(step=6)
    assert [e["detection_s"] for e in w.all("failure")] == [0.5, 0.5]
    assert [e["recovery_s"] for e in w.all("recovered")] == [T1 + 1 - (T0 + 2.5),
                                                              T2 + 1 - (T1 + 3)]
