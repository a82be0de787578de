"""StepProfiler: a torch.profiler trace of one window of steps on this rank (run.profile_steps).

The training loop calls `begin(step)` before each step and `end(step, stop=...)` after it (its
snapshot, validation and checkpoint included: all of it is the step's cost). Outside the
window both are one comparison: no profiler object exists, so no other step pays for it.

A world traces the steps of the window that it trains: from FIRST, or from its own first
step when it starts inside the window (after a recovery or a resize), to LAST, or to the step
it stops after when a planned stop ends it inside the window (Ctrl-C, a resize). A world that
fails inside the window drops its trace (`discard`): its last step is incomplete and its thread
is unwinding from a failed collective; the next world traces again from the step it restores.

The trace leaves the worker as bytes (a chrome trace, zlib-compressed: these JSON files are
mostly repeated keys, about 10x smaller), because the driver that writes the run directory may
be on another machine. Kineto prints two `USDT: profiler_start/stop` lines per trace to the
worker's stderr; they cannot be turned off.
"""

from __future__ import annotations

import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from stalwart.workers.reports import ProfileReport


def init_profiler_here() -> None:
    """Initialise the profiler (kineto) on the calling thread: the one that imported torch.

    Kineto initialises itself the first time a trace starts, and from any thread but the one
    torch registered it on it prints "ERROR: External init callback must run in same thread
    as registerClient" (harmless, and alarming on the driver's console). The training thread
    is such a thread, so the worker calls this on the actor's own thread first; it costs an
    empty trace (milliseconds), once per process.
    """
    global _initialised
    if not _initialised:
        empty = profile(activities=[ProfilerActivity.CPU])
        empty.start()
        empty.stop()
        _initialised = True


_initialised = False


class StepProfiler:
    def __init__(self, window: tuple[int, int] | None, *, rank: int, generation: int,
                 device: torch.device) -> None:
        self.window = window
        self.rank = rank
        self.generation = generation
        self.device = device
        self._profiler: profile | None = None
        self._span: Any = None  # the current step's record_function, while tracing
        self._first = 0

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def begin(self, step: int) -> None:
        """Before step `step`: start tracing at the window's first step in this world."""
        if self._profiler is None:
            if self.window is None or not self.window[0] <= step <= self.window[1]:
                return
            activities = [ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(ProfilerActivity.CUDA)
            # Shapes tell which matmul is which; Python stacks would cost more than the step.
            self._profiler = profile(activities=activities, record_shapes=True)
            self._profiler.start()
            self._first = step
        # A named span per step, so the trace shows where each step begins and ends.
        self._span = record_function(f"stalwart step {step}")
        self._span.__enter__()

    def end(self, step: int, *, stop: bool) -> list[ProfileReport]:
        """After step `step`: at the window's last step, or at a planned stop inside it,
        stop tracing and return the trace ([] otherwise)."""
        if self._profiler is None:
            return []
        self._close_span()
        assert self.window is not None
        if step < self.window[1] and not stop:
            return []
        t0 = time.perf_counter()
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        with tempfile.TemporaryDirectory(prefix="stalwart-profile-") as tmp:
            path = Path(tmp) / "trace.json"
            profiler.export_chrome_trace(str(path))
            data = zlib.compress(path.read_bytes(), 1)
        return [ProfileReport(rank=self.rank, generation=self.generation,
                              steps=(self._first, step), trace_zlib=data,
                              export_s=time.perf_counter() - t0)]

    def discard(self) -> None:
        """Stop tracing without a trace (the world failed inside the window)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        try:
            self._close_span()
            profiler.stop()
        except Exception:  # the thread is already unwinding from a failure: never mask it
            pass

    def _close_span(self) -> None:
        span, self._span = self._span, None
        if span is not None:
            span.__exit__(None, None, None)
