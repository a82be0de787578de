"""Straggler detection: a rank whose own work per step stays well above its peers'.

In a synchronous step every rank waits for the slowest, so step times are equal on all ranks
and say nothing about which one is slow. What differs is each rank's *local* time: the part
of the step before its first gradient synchronisation (data, forward, backward of the
micro-batches that do not sync; workers/engine.py measures it). A rank whose local time is
above `factor` x the median of the other ranks' for `steps` steps in a row is a straggler.

The other ranks' median (not the whole world's) so that a world of two can tell which of
its ranks is slow. A small absolute margin keeps scheduler jitter of millisecond-long steps
from counting.

A rank is reported once per slow spell: after its report it must be back within the factor
for `steps` steps in a row before a new streak can report it again. Without that, one noisy
step of a peer (a shared, loaded host) would split a single slow spell into several reports.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

# Below this much extra local time per step a rank is not called slow, whatever the ratio.
MIN_EXCESS_S = 0.005


@dataclass(frozen=True)
class Straggler:
    rank: int
    step: int
    """The step at which the streak reached `steps`."""
    local_s: float
    peers_median_s: float
    ratio: float
    steps: int
    """Consecutive steps above the factor."""


def median_without(ordered: list[float], value: float) -> float:
    """The median of `ordered` (sorted, holding `value`) with one `value` left out: what
    statistics.median of the other ranks' times gives, in O(log n) instead of O(n log n) per
    rank (a world of 4,096 ranks made each step's check quadratic: seconds per poll)."""
    skip = bisect_left(ordered, value)
    n = len(ordered) - 1

    def at(i: int) -> float:  # the i-th of the others
        return ordered[i] if i < skip else ordered[i + 1]

    if n % 2:
        return at(n // 2)
    return (at(n // 2 - 1) + at(n // 2)) / 2


class StragglerDetector:
    def __init__(self, factor: float, steps: int) -> None:
        self.factor = factor
        self.steps = steps
        self.world_size = 0
        self._times: dict[int, dict[int, float]] = {}  # step -> rank -> local seconds
        self._streak: dict[int, int] = {}
        # Reported ranks -> consecutive steps back within the factor since (see module doc).
        self._reported: dict[int, int] = {}
        self._checked = 0  # steps up to here are judged

    @property
    def enabled(self) -> bool:
        return self.factor > 0

    def reset(self, world_size: int) -> None:
        """A new world: ranks are renumbered, so streaks start again."""
        self.world_size = world_size
        self._times.clear()
        self._streak.clear()
        self._reported.clear()
        self._checked = 0

    def observe(self, rank: int, step: int, local_s: float) -> None:
        if self.enabled and self.world_size > 1 and step > self._checked:
            self._times.setdefault(step, {})[rank] = local_s

    def check(self) -> list[Straggler]:
        """Judge every step all ranks have reported, in order; the stragglers whose streak
        reached `steps` on one of them (once per slow spell)."""
        found = []
        for step in sorted(s for s, t in self._times.items() if len(t) == self.world_size):
            times = self._times.pop(step)
            self._checked = max(self._checked, step)
            ordered = sorted(times.values())  # once per step: each rank's peers are all but it
            for rank, local in times.items():
                peers = median_without(ordered, local)
                slow = local > self.factor * peers and local - peers > MIN_EXCESS_S
                self._streak[rank] = self._streak.get(rank, 0) + 1 if slow else 0
                if rank in self._reported:
                    self._reported[rank] = 0 if slow else self._reported[rank] + 1
                    if self._reported[rank] >= self.steps:  # the spell is over
                        del self._reported[rank]
                    continue
                if self._streak[rank] == self.steps:
                    self._reported[rank] = 0
                    found.append(Straggler(rank=rank, step=step, local_s=local,
                                           peers_median_s=peers, steps=self.steps,
                                           ratio=local / peers if peers > 0 else float("inf")))
        for step in [s for s in self._times if s <= self._checked]:  # a rank that left
            del self._times[step]
        return found
