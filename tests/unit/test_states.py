"""The controller's one table of transitions, checked against the design written out here."""

from __future__ import annotations

import itertools

import pytest

from stalwart.orchestrator.errors import InvalidTransition
from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.orchestrator.states import (
    TRANSITIONS,
    Failed,
    Finished,
    Recovering,
    Rendezvous,
    Resizing,
    Restoring,
    Running,
    Scheduling,
    State,
    Stopped,
    check_transition,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# ---------------------------------------------------------------------------- transition table

_FAILURE = WorkerFailure(kind=FailureKind.WORKER_DIED, rank=1, message="gone", detected_at=0.0)
SAMPLES: list[State] = [
    Scheduling(generation=0), Rendezvous(generation=0, world_size=2),
    Restoring(generation=0, checkpoint=None), Running(generation=0, start_step=0),
    Recovering(generation=0, failure=_FAILURE),
    Resizing(generation=0, reason="grow"),
    Finished(step=1), Stopped(step=1), Failed(reason="x"),
]
# The table as designed, written out independently of orchestrator/states.py:
# - the happy path SCHEDULING -> RENDEZVOUS -> RESTORING -> RUNNING -> FINISHED;
# - a stop asked by the user ends RUNNING, or SCHEDULING while it waits for workers;
# - a planned resize (grow, preemption, drain) goes RUNNING -> RESIZING -> SCHEDULING;
# - every live state may fail over to RECOVERING (which starts again at SCHEDULING) or FAILED.
ALLOWED = {
    ("SCHEDULING", "RENDEZVOUS"), ("SCHEDULING", "RECOVERING"), ("SCHEDULING", "STOPPED"),
    ("SCHEDULING", "FAILED"),
    ("RENDEZVOUS", "RESTORING"), ("RENDEZVOUS", "RECOVERING"), ("RENDEZVOUS", "FAILED"),
    ("RESTORING", "RUNNING"), ("RESTORING", "RECOVERING"), ("RESTORING", "FAILED"),
    ("RUNNING", "FINISHED"), ("RUNNING", "STOPPED"), ("RUNNING", "RECOVERING"),
    ("RUNNING", "RESIZING"), ("RUNNING", "FAILED"),
    ("RECOVERING", "SCHEDULING"), ("RECOVERING", "FAILED"),
    ("RESIZING", "SCHEDULING"), ("RESIZING", "RECOVERING"), ("RESIZING", "FAILED"),
}


def test_sample_covers_every_state() -> None:
    assert {type(s) for s in SAMPLES} == set(TRANSITIONS)
    assert len({s.name for s in SAMPLES}) == len(SAMPLES)


@pytest.mark.parametrize(("old", "new"), list(itertools.product(SAMPLES, SAMPLES)),
                         ids=lambda s: s.name)
def test_transition_table(old: State, new: State) -> None:
    if (old.name, new.name) in ALLOWED:
        check_transition(old, new)
    else:
        with pytest.raises(InvalidTransition) as err:
            check_transition(old, new)
        assert f"controller transition {old.name} -> {new.name} is not allowed" in str(err.value)


@pytest.mark.parametrize(("old", "new"), [
    (Scheduling(generation=0), Running(generation=0, start_step=0)),
    (Scheduling(generation=0), Finished(step=3)),
    (Scheduling(generation=0), Resizing(generation=0, reason="grow")),
    (Rendezvous(generation=0, world_size=2), Running(generation=0, start_step=0)),
    (Rendezvous(generation=0, world_size=2), Stopped(step=0)),
    (Running(generation=0, start_step=0), Scheduling(generation=1)),
    (Running(generation=0, start_step=0), Rendezvous(generation=1, world_size=4)),
    (Resizing(generation=0, reason="drain", leaving=(2, 3)),
     Rendezvous(generation=1, world_size=2)),
    (Resizing(generation=0, reason="grow"), Running(generation=1, start_step=0)),
    (Resizing(generation=0, reason="grow"), Stopped(step=3)),
    (Recovering(generation=0, failure=_FAILURE), Resizing(generation=0, reason="grow")),
    (Recovering(generation=0, failure=_FAILURE), Rendezvous(generation=1, world_size=2)),
    (Recovering(generation=0, failure=_FAILURE), Recovering(generation=1, failure=_FAILURE)),
    (Failed(reason="x"), Recovering(generation=0, failure=_FAILURE)),
    *[(Finished(step=1), s) for s in SAMPLES],
    *[(Stopped(step=1), s) for s in SAMPLES],
    *[(Failed(reason="x"), s) for s in SAMPLES],
], ids=lambda s: s.name)
def test_disallowed_transitions_name_both_states(old: State, new: State) -> None:
    with pytest.raises(InvalidTransition) as err:
        check_transition(old, new)
    msg = str(err.value)
    assert f"{old.name} -> {new.name}" in msg
    assert f"from {old.name}:" in msg


def test_error_lists_what_is_allowed() -> None:
    with pytest.raises(InvalidTransition) as err:
        check_transition(Scheduling(generation=0), Running(generation=0, start_step=0))
    assert str(err.value).endswith(
        "from SCHEDULING: ['FAILED', 'RECOVERING', 'RENDEZVOUS', 'STOPPED']")
    with pytest.raises(InvalidTransition) as err:
        check_transition(Resizing(generation=0, reason="grow"), Finished(step=1))
    assert str(err.value) == ("controller transition RESIZING -> FINISHED is not allowed; "
                              "from RESIZING: ['FAILED', 'RECOVERING', 'SCHEDULING']")


def test_terminal_states() -> None:
    assert {s.name for s in SAMPLES if s.terminal} == {"FINISHED", "STOPPED", "FAILED"}


def test_states_carry_their_data() -> None:
    assert Scheduling(generation=3).since == 0.0
    assert Rendezvous(generation=1, world_size=4).world_size == 4
    resize = Resizing(generation=2, reason="preempted", leaving=(1,))
    assert (resize.name, resize.reason, resize.leaving) == ("RESIZING", "preempted", (1,))
    assert Resizing(generation=0, reason="grow").leaving == ()
    assert Recovering(generation=0, failure=_FAILURE).failure.failed_ranks == (1,)
