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
    Scheduling(generation=0), Rendezvous(generation=0), Restoring(generation=0, checkpoint=None),
    Running(generation=0, start_step=0), Recovering(generation=0, failure=_FAILURE),
    Finished(step=1), Stopped(step=1), Failed(reason="x"),
]
# The table as designed (orchestrator/states.py docstring), written out independently.
ALLOWED = {
    ("SCHEDULING", "RENDEZVOUS"), ("SCHEDULING", "RECOVERING"), ("SCHEDULING", "FAILED"),
    ("RENDEZVOUS", "RESTORING"), ("RENDEZVOUS", "RECOVERING"), ("RENDEZVOUS", "FAILED"),
    ("RESTORING", "RUNNING"), ("RESTORING", "RECOVERING"), ("RESTORING", "FAILED"),
    ("RUNNING", "FINISHED"), ("RUNNING", "STOPPED"), ("RUNNING", "RECOVERING"),
    ("RUNNING", "FAILED"),
    ("RECOVERING", "SCHEDULING"), ("RECOVERING", "FAILED"),
}


def test_sample_covers_every_state() -> None:
    assert {type(s) for s in SAMPLES} == set(TRANSITIONS)


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
    (Rendezvous(generation=0), Running(generation=0, start_step=0)),
    (Running(generation=0, start_step=0), Scheduling(generation=1)),
    (Failed(reason="x"), Recovering(generation=0, failure=_FAILURE)),
    (Recovering(generation=0, failure=_FAILURE), Rendezvous(generation=1)),
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
    assert str(err.value).endswith("from SCHEDULING: ['FAILED', 'RECOVERING', 'RENDEZVOUS']")


def test_terminal_states() -> None:
    assert {s.name for s in SAMPLES if s.terminal} == {"FINISHED", "STOPPED", "FAILED"}
