"""A recovery's calls point one way: the controller calls the group, the policies, the detector
and the helpers; none of them calls back.

The real Controller is driven through a kill and a recovery by the fake worker group
(tests/unit/controller_world.py, tests/fake_group.py). From the poll that finds rank 1
dead to the new world's first step, every Python call is recorded with sys.setprofile as an
edge (the caller's module and qualified name -> the callee's). Then:

- no function outside orchestrator/controller.py calls a Controller method;
- no function of a policy, the detector, the fault plan or the classifier calls a
  WorkerGroup method, directly or through anything it calls (the whole stack is looked at
  on each call into the group);
- the controller is the only caller of the group (besides the group's own methods);
- observers' hooks are called by the controller's `_notify` alone, never by a helper.

So that the check cannot pass by seeing nothing, the trace must hold the recovery's steps:
the detection, the classifier, the failure decision, the teardown, the scheduling policy,
the pick, the fault plan, the form, the restore choice, the memory restore, the launch and
the first step.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest

from stalwart.orchestrator.group import WorkerGroup
from stalwart.orchestrator.observers import ControllerObserver
from stalwart.orchestrator.states import Finished
from stalwart.workers.reports import StepReport
from tests.fake_group import FakeGroup, Plan, Poll
from tests.unit.controller_world import T1, FakeWorld, _commit_checkpoint, status, statuses

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

CONTROLLER = "stalwart.orchestrator.controller"
# What decides: the policies, the failure detector (and its hang detector), the fault plan
# (and the controller's side of it), the classifier and the resize plan.
DECIDERS = {f"stalwart.orchestrator.{m}" for m in (
    "scaling", "restore", "failures", "policies", "detection", "health", "stragglers",
    "faults", "fault_watch", "classify", "resize_plan", "failure_log")}
GROUP_MODULES = {"tests.fake_group", "stalwart.orchestrator.group"}


def where(code: CodeType, frame: FrameType) -> tuple[str, str]:
    return frame.f_globals.get("__name__", "?"), code.co_qualname


def group_methods() -> set[CodeType]:
    """The code of every method of the group's interface and of the fake group."""
    out = set()
    for cls in (WorkerGroup, FakeGroup):
        for value in vars(cls).values():
            fn = getattr(value, "fget", value)
            code = getattr(fn, "__code__", None)
            if code is not None:
                out.add(code)
    return out


class Trace:
    """Call edges recorded between start() and stop(); each call into the group also
    records the modules on the stack above it."""

    def __init__(self) -> None:
        self.edges: set[tuple[tuple[str, str], tuple[str, str]]] = set()
        self.into_group: list[tuple[tuple[str, str], set[str]]] = []
        self._group = group_methods()
        self.running = False

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event != "call" or frame.f_back is None:
            return
        caller = frame.f_back
        callee = where(frame.f_code, frame)
        self.edges.add((where(caller.f_code, caller), callee))
        if frame.f_code in self._group:
            stack, f = set(), caller
            while f is not None:
                stack.add(f.f_globals.get("__name__", "?"))
                f = f.f_back
            self.into_group.append((callee, stack))

    def start(self, w: FakeWorld) -> None:  # a Poll hook: inside the poll that finds the death
        self.running = True
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)
        self.running = False


class StopAtTheNextStep(ControllerObserver):
    """Ends the trace at the first step of the world after the recovery."""

    def __init__(self, trace: Trace) -> None:
        self.trace = trace

    def on_step(self, report: StepReport) -> None:
        if self.trace.running and report.time >= T1:
            self.trace.stop()


def test_a_recovery_from_detection_to_the_next_step_has_no_backward_call(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trace = Trace()
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 2)
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2, 3, 4, 5], commits=[2]),
                    Poll([status(0)], dead=[1], hook=trace.start)]),
        Plan(polls=[statuses([6], done=True, t0=T1)]),
    ], ["failure.max_failures=1", "train.steps=6", "checkpoint.snapshot_every=1"],
        storage=storage, faults=["kill-node:node=2,step=6"],  # pending: no node 2
        observers=[StopAtTheNextStep(trace)])
    w.group.memory[1000] = [4, 5]  # the survivor holds step 5 in memory
    try:
        assert w.run() == Finished(step=6)
    finally:
        trace.stop()
    assert w.event("recovered")["source"] == "memory"

    # 1. Nothing outside the controller calls a Controller method.
    backward = sorted(f"{caller} -> {callee}" for caller, callee in trace.edges
                      if callee[0] == CONTROLLER and callee[1].startswith("Controller.")
                      and caller[0] != CONTROLLER)
    assert backward == []
    # 2. Nothing that decides reaches the group, directly or through what it calls.
    reached = sorted(f"{callee} under {sorted(stack & DECIDERS)}"
                     for callee, stack in trace.into_group if stack & DECIDERS)
    assert reached == []
    # 3. The controller is the group's only caller.
    callers = {caller[0] for caller, callee in trace.edges
               if any(callee == c for c, _ in trace.into_group)}
    assert callers <= {CONTROLLER, *GROUP_MODULES}, callers
    # 4. Observers hear of things from the controller, at its transitions, and from no one else.
    hooks = {name for name in vars(ControllerObserver) if not name.startswith("_")}
    heard = {(caller, callee) for caller, callee in trace.edges
             if callee[1].rsplit(".", 1)[-1] in hooks}
    assert heard and {caller for caller, _ in heard} == {(CONTROLLER, "Controller._notify")}

    # The trace holds the recovery, from its detection to the next step.
    def called(caller: str, callee: str) -> bool:
        return any(a[1] == caller and b[1] == callee for a, b in trace.edges)

    for caller, callee in [
        ("Controller._on_running", "FailureDetector.find"),
        ("FailureDetector.find", "deaths"),  # the classifier
        ("Controller._on_failure", "Controller._decide"),
        ("Controller._decide", "FailureLog.decide"),
        ("Controller._on_recovering", "FakeGroup.remove"),
        ("Controller._on_recovering", "FakeGroup.disband"),
        ("Controller._on_scheduling", "FakeGroup.pool_view"),
        ("Controller._on_scheduling", "ScalingPolicy.schedule"),
        ("Controller._on_rendezvous", "FakeGroup.pick"),
        ("Controller._on_rendezvous", "FaultWatch.arm"),
        ("FaultWatch.arm", "FaultPlan.arm"),
        ("Controller._on_rendezvous", "FakeGroup.form"),
        ("Controller._on_rendezvous", "FakeGroup.memory_inventory"),
        ("Controller._on_rendezvous", "RestorePolicy.choose"),
        ("Controller._on_restoring", "FakeGroup.restore_memory"),
        ("Controller._on_restoring", "FakeGroup.launch"),
        ("Controller._on_step", "Controller._notify"),
    ]:
        assert called(caller, callee), f"{caller} -> {callee} is not in the trace"
    assert w.group.armed[1] == {}  # the fault plan found no node 2 in the new world
