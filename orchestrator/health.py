"""Hang detection: a rank that sends no heartbeat for too long is hung.

A heartbeat is a poll answered with progress (a completed step or a checkpoint commit).
A process that is stopped (SIGSTOP), stuck in the kernel or on a dead node does not answer
polls at all; a rank whose training thread is stuck (a deadlock in user code, a collective
with a silent peer) answers but makes no progress. Both are hangs. The limit adapts to the
job: max(hang_timeout_floor_s, hang_factor x median step time), so a model with 30 s steps is
not declared hung after 10 s, and a 50 ms step does not take minutes to notice.

Before the first step of a generation the limit is at least scaling.start_timeout_s: the
first step may compile, warm up caches or wait for storage. So is it while a rank says it is
busy between steps (saving a checkpoint behind a slow store, validating): that is slow work,
not a stuck thread, and its peers wait for it in their next collective.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Hang:
    ranks: tuple[int, ...]
    """The ranks to blame: those that stopped answering; every rank when all answer but none
    progresses (the stuck one cannot be told apart from the peers it holds up)."""
    silent_s: float
    """Seconds since the last heartbeat of the blamed ranks."""
    limit_s: float
    last_heartbeat: float
    """time.time() of that heartbeat: the last moment the ranks were known to be well."""
    answering: bool
    """True when the blamed ranks still answer polls (stuck thread, live process)."""


class HangDetector:
    # Enough steps for a stable median, few enough to follow a change of world size.
    WINDOW = 50

    def __init__(self, *, floor_s: float, factor: float, start_timeout_s: float) -> None:
        self.floor_s = floor_s
        self.factor = factor
        self.start_timeout_s = start_timeout_s
        self._step_times: deque[float] = deque(maxlen=self.WINDOW)
        self._answered: dict[int, float] = {}
        self._progress: dict[int, float] = {}
        self._busy: set[int] = set()
        self._stepped = False

    def reset(self, ranks: range, now: float) -> None:
        """A new generation starts: every rank counts as well now; the median is kept."""
        self._answered = {r: now for r in ranks}
        self._progress = {r: now for r in ranks}
        self._busy = set()
        self._stepped = False

    def step_time(self, seconds: float) -> None:
        self._step_times.append(seconds)
        self._stepped = True

    def answered(self, rank: int, now: float, *, progressed: bool, busy: bool = False) -> None:
        self._answered[rank] = now
        if progressed:
            self._progress[rank] = now
        if busy:
            self._busy.add(rank)
        else:
            self._busy.discard(rank)

    def finished(self, rank: int) -> None:
        """The rank's loop has ended: it waits for its peers and makes no progress of its own."""
        self._progress.pop(rank, None)

    def limit_s(self) -> float:
        limit = self.floor_s
        if self._step_times:
            limit = max(limit, self.factor * statistics.median(self._step_times))
        if not self._stepped:
            limit = max(limit, self.start_timeout_s)
        return limit

    def progress_limit_s(self) -> float:
        """The limit for making no progress: longer while a rank is busy between steps."""
        limit = self.limit_s()
        return max(limit, self.start_timeout_s) if self._busy else limit

    def check(self, now: float) -> Hang | None:
        limit = self.limit_s()
        silent = [r for r, t in self._answered.items() if now - t > limit]
        if silent:
            last = max(self._answered[r] for r in silent)
            return Hang(ranks=tuple(sorted(silent)), silent_s=now - last, limit_s=limit,
                        last_heartbeat=last, answering=False)
        # Everyone answers; progress is made together (a step ends with a collective), so
        # one stuck rank stalls them all: blame the whole group.
        limit = self.progress_limit_s()
        if self._progress and all(now - t > limit for t in self._progress.values()):
            last = max(self._progress.values())
            return Hang(ranks=tuple(sorted(self._progress)), silent_s=now - last,
                        limit_s=limit, last_heartbeat=last, answering=True)
        return None
