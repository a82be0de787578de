"""A stop on the driver: Ctrl-C (SIGINT) or SIGTERM (Slurm's time limit, a pod's deletion,
`ray job stop`). The first stops the run after the step in flight and checkpoints it; a second
of either abandons that checkpoint (StopAbandoned, a KeyboardInterrupt), and so does the
stop's own deadline (`failure.stop_timeout_s`) when the checkpoint is not committed by then.
The previous committed checkpoint stays either way. The workers may have committed a step
the driver did not hear of before they were stopped: the controller then tells the abandon
with that step (`StopAbandoned.committed`), never as a checkpoint given up.

A flag rather than an exception at the first, so the signal never lands half-way through the
controller's own bookkeeping. The deadline is a timer whose expiry is delivered to the main
thread like a second signal, so it also ends a driver blocked in a call that never returns.

Only the main thread may own signal handlers: elsewhere (a Tune trial's thread) nothing is
installed and the flag stays as it is set. The handlers that were there (Ray's driver installs
one for SIGTERM when it connects) are put back by `uninstall`.
"""

from __future__ import annotations

import _thread
import math
import signal
import threading
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopAbandoned(KeyboardInterrupt):
    """The stop was cut short: a second stop signal, or the stop's deadline.

    `signum` is the signal that asked for the stop: a process stopped by SIGTERM exits 143,
    by Ctrl-C 130, however the stop then ended. `cause` says what cut it short; the message
    adds what came of the step in flight's checkpoint (given up, unless `committed`)."""

    def __init__(self, signum: int, cause: str,
                 outcome: str = "abandoned the checkpoint of the step in flight") -> None:
        super().__init__(f"{cause}; {outcome}")
        self.signum, self.cause = signum, cause

    def committed(self, step: int, *, in_flight: bool) -> StopAbandoned:
        """The same abandon, once the workers are stopped and storage shows that they had
        committed `step` unheard of; `in_flight`: a step past the last one the driver heard
        of, so the step in flight's checkpoint was not given up after all."""
        outcome = (f"stopped the workers at once, after step {step} was checkpointed"
                   if in_flight else
                   f"abandoned the checkpoint of the step in flight; step {step} was "
                   f"checkpointed before it")
        return StopAbandoned(self.signum, self.cause, outcome)


class StopRequest:
    def __init__(self, timeout_s: float = math.inf) -> None:
        self.requested = False
        self.signum: int | None = None
        """The signal that asked for the stop (None: asked in code, or not asked)."""
        self.timeout_s = timeout_s
        self._previous: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._expired = self._settled = False
        self.abandoned: StopAbandoned | None = None
        """The abandon raised, kept: Ray's waits turn an exception a signal handler raises
        inside them into a plain KeyboardInterrupt (see `restore`)."""

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def settle(self) -> None:
        """The run reached its end (or is leaving): the deadline no longer applies. A second
        signal still abandons what is left (the workers' graceful shutdown)."""
        with self._lock:
            self._settled = True
            if self._timer is not None:
                self._timer.cancel()

    def uninstall(self) -> None:
        """Put the handlers that were there back."""
        self.settle()
        for signum, previous in self._previous.items():
            if previous is not None:  # None: a handler not installed from Python; leave it
                signal.signal(signum, previous)
        self._previous = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        first = self.signum if self.signum is not None else signum
        if self._expired:
            self.abandoned = StopAbandoned(
                first, f"the stop did not end within failure.stop_timeout_s="
                       f"{self.timeout_s:g}s of the {signal_name(first)}")
            raise self.abandoned
        if self.requested:
            self.abandoned = StopAbandoned(first, f"{signal_name(signum)} during the stop")
            raise self.abandoned
        self.requested, self.signum = True, signum
        if math.isfinite(self.timeout_s):
            self._timer = threading.Timer(self.timeout_s, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        """On the timer's thread: run the handler on the main thread, as a second signal."""
        with self._lock:
            if self._settled:
                return
            self._expired = True
            assert self.signum is not None
            _thread.interrupt_main(self.signum)

    def restore(self, exc: KeyboardInterrupt) -> KeyboardInterrupt:
        """The interrupt to raise for `exc`: the abandon it stands for when a wait (ray.get,
        ray.wait: Ray's own signal check) replaced it with a plain KeyboardInterrupt."""
        if self.abandoned is not None and not isinstance(exc, StopAbandoned):
            return self.abandoned
        return exc
