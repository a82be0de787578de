"""The failure classifier (orchestrator/classify.py): one function per kind of evidence builds
every WorkerFailure, pure (the time is passed in); and the two rules that keep it the only
place: no other module of the package builds a WorkerFailure, and only the group's node
health asks whether a node is up."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from stalwart.core.events import WorkerPlace
from stalwart.orchestrator import classify
from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.orchestrator.health import Hang
from stalwart.orchestrator.stragglers import Straggler

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ["stalwart", "orchestrator", "workers", "parallel", "checkpointing", "examples"]


def _calls(path: Path, names: set[str]) -> list[str]:
    """`file:line` of each call to one of `names` (a plain name or an attribute)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if name in names:
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


def test_no_module_but_the_classifier_builds_a_worker_failure() -> None:
    found = [hit for folder in PACKAGE for path in sorted((ROOT / folder).rglob("*.py"))
             if path.name != "classify.py" for hit in _calls(path, {"WorkerFailure"})]
    assert found == []
    assert _calls(ROOT / "orchestrator" / "classify.py", {"WorkerFailure"})


def test_only_the_groups_node_health_asks_whether_a_node_is_up() -> None:
    # Ray's node table and a raylet's socket: asked in orchestrator/node_health.py alone.
    found = [hit for path in sorted((ROOT / "orchestrator").rglob("*.py"))
             if path.name != "node_health.py"
             for hit in _calls(path, {"nodes", "create_connection", "nodes_alive"})]
    assert found == []


# ---------------------------------------------------------------------------- one rank


def test_what_the_group_sees_of_one_rank() -> None:
    dead = classify.actor_died(1, "ActorDiedError: gone ", now=5.0)
    assert (dead.kind, dead.rank, dead.ranks, dead.message, dead.detected_at) == (
        FailureKind.WORKER_DIED, 1, (1,), "worker rank 1 died: ActorDiedError: gone", 5.0)
    assert classify.actor_died(None, "x", 0.0).failed_ranks == ()
    setup = classify.call_failed(0, "ValueError: bad", 5.0, kind=FailureKind.START_ERROR)
    assert (setup.kind, setup.ranks, setup.message) == (
        FailureKind.START_ERROR, (0,), "worker rank 0: ValueError: bad")
    late = classify.no_answer(2, 30.0, 5.0)
    assert (late.kind, late.ranks, late.message) == (
        FailureKind.HANG, (2,), "worker rank 2 did not answer within 30s")
    start = classify.start_error("a worker could not load the task: x", 5.0)
    assert (start.kind, start.rank, start.failed_ranks) == (FailureKind.START_ERROR, None, ())


def test_what_a_nodes_agent_sees() -> None:
    exited = classify.process_exited(1, 101, 4.5, now=5.0)
    assert (exited.kind, exited.pids, exited.last_seen, exited.message) == (
        FailureKind.WORKER_DIED, (101,), 4.5, "worker rank 1 (pid 101) exited")
    stopped = classify.process_stopped(2, 102, since=4.0, now=5.0)
    assert (stopped.kind, stopped.pids, stopped.last_seen) == (FailureKind.HANG, (102,), 4.0)
    assert stopped.message == ("worker rank 2 (pid 102) is stopped (SIGSTOP or a frozen "
                               "process) since 1.00s: it cannot take part in its world")
    gone = classify.node_gone(3, "node-b", 5.0)
    assert (gone.kind, gone.ranks, gone.message) == (
        FailureKind.WORKER_DIED, (3,), "worker rank 3 died: its node node-b is gone")
    silent = classify.node_silent(3, 103, "node-b", 0.75, seen_at=4.0, now=5.0)
    assert (silent.kind, silent.pids, silent.last_seen) == (FailureKind.HANG, (103,), 4.0)
    assert "its agent is 0.75s late while the other nodes' agents answer" in silent.message
    polled = classify.poll_failed(0, "worker rank 0 died: ActorDiedError", 5.0)
    assert (polled.kind, polled.message) == (FailureKind.WORKER_DIED,
                                             "worker rank 0 died: ActorDiedError")


# ---------------------------------------------------------------------------- a poll's verdict


def test_deaths_are_a_node_death_when_one_of_their_nodes_is_gone() -> None:
    died = [classify.poll_failed(3, "worker rank 3 died: a", 0.0),
            classify.poll_failed(2, "worker rank 2 died: b", 0.0)]
    worker = classify.deaths(died, {"node-b"}, frozenset(), now=5.0, last_seen=4.0)
    assert (worker.kind, worker.rank, worker.ranks, worker.last_seen) == (
        FailureKind.WORKER_DIED, 2, (2, 3), 4.0)
    assert worker.message == "worker ranks [2, 3] died (node(s) ['node-b']): worker rank 3 died: a"
    node = classify.deaths(died, {"node-b"}, frozenset({"node-b", "node-c"}), 5.0, None)
    assert node.kind is FailureKind.NODE_DIED
    # another node lost says nothing about these ranks
    assert classify.deaths(died, {"node-b"}, frozenset({"node-c"}), 5.0, None).kind is \
        FailureKind.WORKER_DIED
    # one death keeps its own message
    assert classify.deaths(died[:1], {"node-b"}, frozenset(), 5.0, None).message == \
        "worker rank 3 died: a"


def test_stopped_ranks_and_hangs() -> None:
    found = [classify.process_stopped(1, 101, 4.0, 5.0), classify.process_stopped(0, 100, 4.0,
                                                                                  5.0)]
    stopped = classify.stopped(found, 5.0, last_seen=4.0)
    assert (stopped.kind, stopped.ranks, stopped.last_seen) == (FailureKind.HANG, (0, 1), 4.0)
    assert stopped.message.startswith("worker ranks [0, 1] are stopped: worker rank 1 (pid 101)")
    silent = classify.hang(Hang(ranks=(1,), silent_s=2.5, limit_s=2.0, last_heartbeat=2.0,
                                answering=False), now=4.5, last_seen=2.0)
    assert (silent.kind, silent.rank, silent.ranks) == (FailureKind.HANG, 1, (1,))
    assert silent.message == (
        "hang: worker rank(s) [1] stopped answering for 2.5s (limit 2.0s = "
        "max(failure.hang_timeout_floor_s, failure.hang_factor x median step time))")
    stuck = classify.hang(Hang(ranks=(0, 1), silent_s=2.5, limit_s=2.0, last_heartbeat=2.0,
                               answering=True), now=4.5, last_seen=2.0)
    assert (stuck.rank, stuck.ranks) == (None, ())  # nobody can be blamed
    assert stuck.message.startswith("hang: no rank completed a step for 2.5s")


def test_exceptions_collectives_and_stragglers() -> None:
    user = classify.exception(1, "Traceback ...\nValueError: bad", 5.0, last_seen=4.0)
    assert (user.kind, user.ranks, user.message) == (
        FailureKind.USER_ERROR, (1,), "Traceback ...\nValueError: bad")
    collective = classify.collective_failed(0, "DistBackendError", 5.0, None)
    assert (collective.kind, collective.rank, collective.failed_ranks) == (
        FailureKind.COLLECTIVE_ERROR, None, ())
    assert collective.message == ("worker rank 0: a collective failed with no rank to blame:\n"
                                  "DistBackendError")
    slow = classify.straggler(Straggler(rank=2, step=9, local_s=0.3, peers_median_s=0.1,
                                        ratio=3.0, steps=5), 2.0, now=5.0, last_seen=None)
    assert (slow.kind, slow.ranks) == (FailureKind.STRAGGLER, (2,))
    assert slow.message == ("rank 2 took 3.0x its peers' median local time per step for 5 "
                            "steps (failure.straggler_factor=2, failure.replace_stragglers=true)")


def test_members_silent_as_their_world_ended_are_named_by_pid() -> None:
    workers = [WorkerPlace(rank=r, pid=100 + r, node_ip="10.0.0.1", node_id="a")
               for r in range(3)]
    silent = classify.silent_members([102, 100], workers, now=5.0)
    assert isinstance(silent, WorkerFailure)
    assert (silent.kind, silent.rank, silent.ranks, silent.pids, silent.last_seen) == (
        FailureKind.HANG, 0, (0, 2), (102, 100), None)
    assert silent.message == ("worker rank(s) [0, 2] (pid 102, 100) did not answer while the "
                              "world was torn down (stopped or dead); replaced")
