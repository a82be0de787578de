"""Stopping the driver: SIGTERM is a stop like Ctrl-C, a second of either abandons the stop's
checkpoint, and so does failure.stop_timeout_s; the handlers that were there are put back.

Real signals to this process (the controller's handlers run on the main thread), the
controller driven by the fake worker group (tests/unit/controller_world.py).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stalwart.core.config import load_config
from stalwart.core.errors import ConfigError
from stalwart.orchestrator.interrupt import StopAbandoned, StopRequest
from stalwart.orchestrator.states import Stopped
from tests.fake_group import Plan, Poll
from tests.unit.controller_world import FakeWorld, statuses

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60),
              pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                                 reason="only the main thread may own signal handlers")]


def _handlers() -> tuple[object, object]:
    return signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)


@pytest.fixture
def terminate_handler() -> Iterator[None]:
    """A SIGTERM handler of our own in place (as Ray's driver has one), put back after."""
    before = signal.getsignal(signal.SIGTERM)

    def ray_like(signum, frame):
        raise AssertionError("the stop's handler should have taken SIGTERM")

    signal.signal(signal.SIGTERM, ray_like)
    yield
    signal.signal(signal.SIGTERM, before)


def _sigterm(w: FakeWorld) -> None:
    signal.raise_signal(signal.SIGTERM)


def _wait_to_be_interrupted(w: FakeWorld) -> None:
    """A step and its checkpoint that take too long: the stop's deadline ends the wait."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(0.01)
    raise AssertionError("the stop's deadline did not interrupt the driver")


def test_sigterm_stops_after_the_step_in_flight_like_ctrl_c(tmp_path: Path, monkeypatch,
                                                            terminate_handler) -> None:
    before = _handlers()
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        Poll(statuses([1, 2]), hook=_sigterm),
        statuses([3], commits=[3], done=True, stopped_early=True),
    ])])
    assert w.run() == Stopped(step=3)
    assert len(w.named("request_stop")) == 1 and w.shutdowns() == [True]
    assert w.event("stopped")["step"] == 3
    assert w.controller.stop.signum == signal.SIGTERM
    assert _handlers() == before  # Ray's SIGTERM handler, and Ctrl-C's, are back


@pytest.mark.parametrize(("first", "second"), [(signal.SIGTERM, signal.SIGTERM),
                                               (signal.SIGTERM, signal.SIGINT),
                                               (signal.SIGINT, signal.SIGTERM)])
def test_a_second_signal_of_either_kind_abandons_the_checkpoint(
        tmp_path: Path, monkeypatch, terminate_handler, first, second) -> None:
    before = _handlers()
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        Poll(statuses([1, 2]), hook=lambda w: signal.raise_signal(first)),
        Poll(statuses([3]), hook=lambda w: signal.raise_signal(second)),
    ])])
    with pytest.raises(StopAbandoned, match="during the stop; abandoned") as raised:
        w.run()
    assert isinstance(raised.value, KeyboardInterrupt)  # every interrupt path applies
    assert raised.value.signum == first  # the exit code is the stop's: 143 or 130
    assert w.shutdowns() == [False] and "stopped" not in w.kinds()
    assert "checkpoint_committed" not in w.kinds()  # storage holds nothing new: none found
    assert _handlers() == before


def _commit_then_sigint(step: int) -> Callable[[FakeWorld], None]:
    """The workers commit `step` and the driver gets its second Ctrl-C before any poll says so."""
    def hook(w: FakeWorld) -> None:
        w.commit(step)
        signal.raise_signal(signal.SIGINT)
    return hook


def test_a_step_in_flight_committed_before_the_second_signal_is_logged_not_abandoned(
        tmp_path: Path, monkeypatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        Poll(statuses([1, 2]), hook=lambda w: signal.raise_signal(signal.SIGINT)),
        Poll(statuses([3]), hook=_commit_then_sigint(3)),  # its answer never arrives
    ])])
    with pytest.raises(StopAbandoned) as raised:
        w.run()
    assert str(raised.value) == ("SIGINT during the stop; stopped the workers at once, after "
                                 "step 3 was checkpointed")
    assert raised.value.signum == signal.SIGINT
    # The world was killed by PID before the teardown: nothing could commit after the look.
    assert [(c.name, c.args) for c in w.named("remove", "shutdown")] == [
        ("remove", ((0, 1),)), ("shutdown", (False,))]
    committed = w.event("checkpoint_committed")
    assert committed["step"] == 3 and committed["found_on_restore"] is True
    assert w.controller.outcome().step == 3  # the run's step is the checkpoint's


def test_an_older_commit_found_after_the_second_signal_is_logged_and_the_stop_abandoned(
        tmp_path: Path, monkeypatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        Poll(statuses([1, 2]), hook=lambda w: signal.raise_signal(signal.SIGINT)),
        Poll(statuses([3]), hook=_commit_then_sigint(2)),  # a save of step 2, late
    ])])
    with pytest.raises(StopAbandoned) as raised:
        w.run()
    assert str(raised.value) == ("SIGINT during the stop; abandoned the checkpoint of the step "
                                 "in flight; step 2 was checkpointed before it")
    assert w.event("checkpoint_committed")["step"] == 2
    assert w.controller.outcome().step == 2


def test_past_stop_timeout_the_checkpoint_is_abandoned(tmp_path: Path, monkeypatch,
                                                       terminate_handler) -> None:
    before = _handlers()
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        Poll(statuses([1, 2]), hook=_sigterm),
        Poll(statuses([3]), hook=_wait_to_be_interrupted),
    ])], overrides=["failure.stop_timeout_s=0.2"])
    with pytest.raises(StopAbandoned, match=r"the stop did not end within "
                                            r"failure.stop_timeout_s=0.2s of the SIGTERM; "
                                            r"abandoned the checkpoint of the step in flight$"
                       ) as raised:
        w.run()
    assert raised.value.signum == signal.SIGTERM
    assert w.shutdowns() == [False] and _handlers() == before


def _wait_like_ray(w: FakeWorld) -> None:
    """A wait as ray.get's: the handler's exception comes out as a plain KeyboardInterrupt."""
    try:
        _wait_to_be_interrupted(w)
    except KeyboardInterrupt:
        raise KeyboardInterrupt from None


def test_the_abandon_survives_a_wait_that_turns_it_into_a_plain_interrupt(
        tmp_path: Path, monkeypatch, terminate_handler) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        Poll(statuses([1, 2]), hook=_sigterm),
        Poll(statuses([3]), hook=_wait_like_ray),
    ])], overrides=["failure.stop_timeout_s=0.2"])
    raised: KeyboardInterrupt | None = None
    try:
        w.run()
    except KeyboardInterrupt as exc:  # caught here: a plain one must fail the test, not pytest
        raised = exc
    assert isinstance(raised, StopAbandoned), f"{raised!r} is not the stop's abandon"
    assert "failure.stop_timeout_s=0.2s" in str(raised) and raised.signum == signal.SIGTERM


def test_a_run_that_ended_is_not_interrupted_by_its_stop_deadline() -> None:
    stop = StopRequest(timeout_s=0.05)
    before = _handlers()
    stop.install()
    try:
        signal.raise_signal(signal.SIGINT)
        assert stop.requested and stop.signum == signal.SIGINT
        stop.settle()
        time.sleep(0.3)  # past the deadline: nothing is raised
        with pytest.raises(StopAbandoned):  # a second signal still abandons the rest
            signal.raise_signal(signal.SIGTERM)
    finally:
        stop.uninstall()
    assert _handlers() == before


def test_off_the_main_thread_nothing_is_installed() -> None:
    before = _handlers()
    stop = StopRequest(timeout_s=0.05)
    t = threading.Thread(target=stop.install)
    t.start()
    t.join()
    assert _handlers() == before
    stop.uninstall()
    assert _handlers() == before


def test_stop_timeout_is_validated() -> None:
    assert load_config(None, []).failure.stop_timeout_s == 120.0
    assert load_config(None, ["failure.stop_timeout_s=5"]).failure.stop_timeout_s == 5.0
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match=rf"^failure.stop_timeout_s = {float(bad)} is "
                                              rf"invalid: must be > 0"):
            load_config(None, [f"failure.stop_timeout_s={bad}"])
    with pytest.raises(ConfigError, match="failure.stop_timeout_s = inf is invalid"):
        load_config(None, ["failure.stop_timeout_s=inf"])
