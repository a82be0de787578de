"""The node agent's view of its processes (/proc), and how its reports become failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from stalwart.core.config import JobConfig
from stalwart.core.events import WorkerPlace
from stalwart.orchestrator.detection import FailureDetector, LastSeen
from stalwart.orchestrator.failures import FailureKind
from stalwart.orchestrator.group import PollView
from stalwart.orchestrator.node_polls import _failures
from stalwart.workers.node_agent import (
    NodeAgent,
    NodeReport,
    failed_marker,
    process_state,
    take_failed_mark,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60),
              pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs /proc")]


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_process_state_tells_running_stopped_and_gone_apart():
    proc = _sleeper()
    try:
        # A python starting up on a loaded machine may be in disk sleep (D): running all the same.
        assert process_state(proc.pid) in ("R", "S", "D")
        os.kill(proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while process_state(proc.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(proc.pid) == "T"
        os.kill(proc.pid, signal.SIGKILL)
        while process_state(proc.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(proc.pid) == "Z"  # not reaped yet: dead all the same
    finally:
        proc.kill()
        proc.wait()
    assert process_state(proc.pid) == "gone"


def test_a_command_name_with_parentheses_and_spaces_is_parsed():
    # The state follows the last ")", whatever the command name holds.
    assert process_state(os.getpid()) in ("R", "S")


def test_the_watch_reports_a_stop_only_after_it_lasts_and_an_exit_at_once():
    proc = _sleeper()
    agent = NodeAgent()
    agent.generation, agent.members = 0, {1: (None, proc.pid)}
    agent._alive_at = {1: time.time()}
    try:
        assert agent._watch() == ({}, {})
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.05)
        exited, stopped = agent._watch()
        assert exited == {} and stopped == {}  # stopped, but not for long yet
        time.sleep(agent.stopped_for_s)
        exited, stopped = agent._watch()
        assert exited == {} and list(stopped) == [1]
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.05)
        assert agent._watch() == ({}, {})  # resumed: well again
        alive_at = agent._alive_at[1]
        proc.kill()
        proc.wait()
        exited, stopped = agent._watch()
        assert exited == {1: alive_at} and stopped == {}
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfds")
def test_an_exit_wakes_the_sleeping_agent_and_a_live_process_does_not():
    proc = _sleeper()
    agent = NodeAgent()
    agent.members = {1: (None, proc.pid)}
    agent._open_pidfds()
    try:
        assert agent._pidfds, "pidfd_open failed for a live child"
        assert agent._sleep_until_an_exit(0.05) is False
        threading.Timer(0.2, proc.kill).start()
        assert agent._sleep_until_an_exit(30.0) is True
    finally:
        proc.kill()
        proc.wait()
        agent.members = {}
        agent._open_pidfds()  # closes the last world's
    assert agent._pidfds == {}


class _Actor:
    """A rank's actor handle as the agent uses it: poll.remote(generation)."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.poll = self

    def remote(self, generation: int) -> str:
        self.asked.append(generation)
        return f"poll-{len(self.asked)}"


def test_a_rank_that_marks_a_failure_is_polled_again_once_its_poll_is_back():
    proc = subprocess.Popen([sys.executable, "-c", "from stalwart.workers.node_agent import "
                             "mark_failed; mark_failed()"])
    assert proc.wait(timeout=30) == 0
    actor, agent = _Actor(), NodeAgent()
    agent.generation, agent.members = 3, {1: (actor, proc.pid)}
    try:
        agent._polls = {1: "in flight"}  # its answer may predate the failure: mark kept
        assert agent._repoll_failed(3) is False and os.path.exists(failed_marker(proc.pid))
        agent._polls = {}
        assert agent._repoll_failed(3) is True and actor.asked == [3]
        assert agent._polls == {1: "poll-1"}
        assert not os.path.exists(failed_marker(proc.pid))  # taken: asked once
        agent._polls = {}
        assert agent._repoll_failed(3) is False and actor.asked == [3]
    finally:
        take_failed_mark(proc.pid)


def test_reports_become_failures_naming_rank_pid_and_when_last_seen_well():
    ranks = {0: (None, 100), 1: (None, 101), 2: (None, 102)}
    report = NodeReport(errors={0: "worker rank 0 died: ActorDiedError", 1: "dup"},
                        exited={1: 50.0}, stopped={2: 60.0})
    failures = {f.rank: f for f in _failures(report, ranks)}
    assert failures[0].kind == FailureKind.WORKER_DIED and failures[0].last_seen is None
    assert failures[1].kind == FailureKind.WORKER_DIED and failures[1].last_seen == 50.0
    assert "pid 101" in failures[1].message and failures[1].pids == (101,)
    assert failures[2].kind == FailureKind.HANG and failures[2].last_seen == 60.0
    assert "stopped" in failures[2].message


def _detector() -> FailureDetector:
    detector = FailureDetector(JobConfig(), collective_grace_s=3.0)
    detector.after_form(0, [WorkerPlace(rank=r, pid=100 + r, node_ip="10.0.0.1",
                                        node_id="n1") for r in range(2)], 0.0)
    detector.after_launch(0, 2, 0.0)
    return detector


def test_a_stopped_rank_is_a_hang_at_once_and_a_dead_one_outranks_it():
    ranks = {0: (None, 100), 1: (None, 101)}
    stopped = _failures(NodeReport(stopped={1: 9.5}), ranks)
    # the heartbeat the agent reports (9.5) dates it, not the newest step's end (9.0)
    failure = _detector().find(PollView(answered={}, dead=tuple(stopped)), 10.0,
                               LastSeen(last_step_end=9.0))
    assert failure.kind == FailureKind.HANG and failure.ranks == (1,)
    assert failure.last_seen == 9.5
    both = stopped + _failures(NodeReport(exited={0: 9.0}), ranks)
    failure = _detector().find(PollView(answered={}, dead=tuple(both)), 10.0, LastSeen())
    assert failure.kind == FailureKind.WORKER_DIED and failure.ranks == (0,)


def test_two_answers_of_one_rank_in_one_pass_keep_both_parts_in_step_order():
    from stalwart.checkpointing.storage.commit_report import CommitReport
    from stalwart.orchestrator.node_polls import merge
    from stalwart.workers.reports import StepReport, WorkerStatus

    def step(n: int) -> StepReport:
        return StepReport(rank=0, step=n, loss=1.0, lr=0.1, tokens=8, step_time_s=0.1,
                          time=float(n), local_s=0.05)

    agent = WorkerStatus(rank=0, generation=1, steps=[step(1), step(2)],
                         commits=[CommitReport(step=2, path="p2", save_s=0.1)], done=False)
    direct = WorkerStatus(rank=0, generation=1, steps=[step(3)], commits=[], done=True,
                          snapshot_bytes=10)
    both = merge(direct, agent)
    assert [s.step for s in both.steps] == [1, 2, 3]
    assert [c.step for c in both.commits] == [2]
    assert both.done and both.snapshot_bytes == 10


def test_a_node_is_silent_only_when_late_past_the_limit_while_another_answers():
    from stalwart.orchestrator.node_polls import _Agent, silent_nodes

    def agent(asked_at: float, answered_at: float, *, ready=True, in_flight=True) -> _Agent:
        return _Agent(actor=None, ref=object() if in_flight else None, ready=ready,
                      asked_at=asked_at, due_s=0.5, answered_at=answered_at)

    # a's answer was due at 10.5; b answered at 10.6, after that.
    a, b = agent(10.0, 9.9), agent(10.1, 10.6)
    assert silent_nodes({"a": a, "b": b}, now=10.9, silent_for_s=0.5) == {}  # 0.4 s late
    assert silent_nodes({"a": a, "b": b}, now=11.1, silent_for_s=0.5) == {"a": pytest.approx(0.6)}
    # Nobody answered since a's answer was due: the driver may be the one that is late.
    quiet = agent(10.1, 10.4)
    assert silent_nodes({"a": a, "b": quiet}, now=12.0, silent_for_s=0.5) == {}
    assert silent_nodes({"a": a}, now=12.0, silent_for_s=0.5) == {}  # one node: never
    # An agent that has not answered once (still starting) or has no poll out is not late.
    for other in (agent(10.0, 0.0, ready=False), agent(10.0, 9.9, in_flight=False)):
        assert silent_nodes({"a": other, "b": b}, now=12.0, silent_for_s=0.5) == {}
