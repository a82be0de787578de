"""How long a rank's own work in a step takes, before it first waits for its peers.

Straggler detection compares this across ranks (orchestrator/stragglers.py): step times are
equal on every rank of a synchronous step, local times are not. On a GPU the work is timed
with CUDA events, so measuring adds no host synchronisation; they are read after the step's
final all-reduce has synchronised anyway.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class LocalTimer:
    def __init__(self, device: torch.device,
                 after_local_work: Callable[[float], None] | None = None) -> None:
        # Told the seconds of local work when it ends, and counted in them (so a rank made
        # a straggler there, by fault injection, is timed as one).
        self._after_local_work = after_local_work
        self._t0 = time.perf_counter()
        self._local = 0.0
        self._cuda = device.type == "cuda"
        self._start = self._end = None
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()

    def done(self) -> None:
        """The local work ends here (the first gradient synchronisation comes next)."""
        if self._after_local_work is not None:
            self._after_local_work(time.perf_counter() - self._t0)
        if self._cuda:
            self._end = torch.cuda.Event(enable_timing=True)
            self._end.record()
        else:
            self._local = time.perf_counter() - self._t0

    def seconds(self) -> float:
        """The local time; on a GPU, call it after the step has synchronised the host."""
        if self._start is not None and self._end is not None:
            return self._start.elapsed_time(self._end) / 1000.0
        return self._local
