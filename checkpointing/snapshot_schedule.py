"""Which steps the memory tier snapshots: every N steps, or with `snapshot_every = "auto"`
every N steps for the smallest N whose cost stays under a budget of the step time.

What a snapshot costs the step is what the training thread pays for it, measured on each
rank over a *window* (from staging one snapshot to staging the next):

- `stage_s`: the training thread inside `MemoryTier.snapshot` (on a CPU the staging copy
  itself; on a GPU the launch of its device-to-host copy, and a CRC32 where no peer exists);
- `wait_s`: the training thread blocked in `wait_copy_done` and `wait_replicated` (the step
  could not go on before the copy or the exchange was done);
- `contended_s`: what the exchange took from the steps it ran beside, measured as the
  difference it made: the steps during which the exchange started and ended (its CPU work,
  the CRC32, the message's encoding, the peer's checks, is there; in between it waits on the
  wire) against the median of the window's other steps, each step's own time less its waits;
  the median of the last 16 windows' (one window's is as noisy as a step), once 5 are in.
  Its thread's CPU time alone (`busy_s`, `time.thread_time`) undercounts it: with the tiny
  reference model on 2 shared CPU cores the steps beside an exchange lost 4 to 28 ms (staging
  included) where staging and the exchange thread used about 7 ms of CPU, the rest gloo's
  own threads and the training thread waiting for the interpreter's lock. Until windows with
  a step clear of the exchange have measured it (none can at an interval of 1, nor at 2 on a
  slow link), `busy_s` counts, at `cpu_share` of a second per second (1 on a CPU worker,
  whose torch threads use the cores the exchange runs on; 0 on a GPU worker, whose step runs
  on the device while its host thread mostly waits);
- `exchange_s`: the exchange's wall time, from its start to its end (on the wire, sleeps
  included): what decides how many steps must pass before the next snapshot can start
  without a wait.

The device time of a GPU's copy is not host time: it runs on its own stream, overlapped with
the next step's forward and backward, and only a step too short to hide it waits (before its
update, where the step time shows it, not these figures).

The overhead of a window of `steps` steps is `(stage_s + wait_s + contended_s) / (steps x
step_s)` (`cpu_share x busy_s` for an unmeasured `contended_s`), where `step_s` is the median
step's own time (its report's, less the waits above).

In auto mode the tier waits for an exchange only before the all-reduce that ends the step of
the next snapshot (not the step after it, as with a fixed interval): a slow link has the
whole interval to carry a snapshot. The cost of interval `k` is then modelled as

    stage_s + contended_s + max(0, exchange_s - (k - 1/2) x step_s)

(the exchange starts as a snapshot's step ends and is waited for in the k-th step after it,
late in that step: half of it is a cautious guess). A window whose wait was longer than that
counts its exchange as `wait_s + (k - 1/2) x step_s` long: whatever held the training thread
(an exchange that started late, a slower copy) more steps in between would hide too. The
overhead predicted falls with k, so the smallest k under a target is a bisection.

Every rank must snapshot the same steps (replication pairs each send with a receive), so the
interval is decided from figures every rank holds: each exchange carries its rank's last
window to a MAX all-reduce on the replication group, on the exchange's own thread
(checkpointing/memory/replication.py: one all-reduce of 8 floats per snapshot, off the
training thread), and the decision taken at a snapshot uses the window the exchange before
agreed on. The figures are the same on every rank, and so are this module's decisions:
nothing here reads a clock.

A decision looks at the last HISTORY windows. The interval grows when the median figures put
the current one over the budget (to the shortest under 0.8 x budget); it shrinks only when
even the worst figures (the shortest step, the longest costs) allow a shorter one under half
the budget (to that one); between the two, it holds. One window held up by the machine
(another process, a collection) moves no median, and a link that was slow in any recent
window holds the interval up. 1 <= k <= checkpoint.persist_every, and the snapshots up to a
persist step (a storage checkpoint is written from a snapshot) or the last step are spread
evenly, at most k apart.

A new world starts at interval 1 (its workers may be new, and know no figures), and decides
once it has HISTORY windows after its first (which measures the world's set-up): at its
sixth snapshot.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING

from stalwart.core.config.sections import SNAPSHOT_AUTO as AUTO

if TYPE_CHECKING:
    import torch

    from stalwart.core.config import JobConfig

# The overheads aimed at: a grown interval is the shortest under GROW_TARGET x budget with
# the exchange taken as GROW_MARGIN x as long as measured, a shrink goes to the shortest under
# SHRINK_TARGET x budget with the exchange SHRINK_MARGIN x as long; between them, the interval
# holds. When the exchange dominates, the overhead falls off a cliff once the interval hides
# it (about exchange_s / step_s steps): the margins keep a step time that wavers by a few
# percent from moving the interval back and forth across that cliff.
GROW_TARGET, GROW_MARGIN = 0.8, 1.25
SHRINK_TARGET, SHRINK_MARGIN = 0.5, 1.25
# The windows after a world's first snapshot measure its set-up (the layout built, the peers'
# claims exchanged, buffers allocated; a restored step's exchange waited for at once): left out.
WARMUP_WINDOWS = 1
# Windows whose figures are taken together (each the median of them): a decision needs them
# all, and one window held up by something else moves none of its figures.
HISTORY = 3
# Windows a world's reading is the median of (the last ones).
READING_WINDOWS = 64
# Seconds of exchange thread CPU time charged to the step per CPU second, where the steps
# could not measure what the exchange took from them (see above).
CPU_SHARE = {"cpu": 1.0}
# A window's contended_s when it has no step clear of the exchange to measure against.
UNMEASURED = -1.0


def cpu_share(device_type: str) -> float:
    return CPU_SHARE.get(device_type, 0.0)


@dataclass(frozen=True)
class Window:
    """What one rank measured from staging one snapshot to staging the next (after the
    all-reduce: the most any rank measured, field by field)."""

    steps: int
    """Steps in the window: the snapshot's interval, or fewer before a persist step."""
    interval: int
    """The interval in force when the window began (the same on every rank)."""
    step_s: float
    """The median time of the window's steps, less the waits below (a median: one step
    held up by something else, a stalled read or a collection, says nothing of the rest)."""
    stage_s: float
    wait_s: float
    busy_s: float
    exchange_s: float
    contended_s: float = UNMEASURED
    """UNMEASURED when no step of the window was clear of the exchange."""

    def to_list(self) -> list[float]:
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def from_list(cls, values: list[float]) -> Window:
        names = [f.name for f in fields(cls)]
        if len(values) != len(names):
            raise ValueError(f"a window has {len(names)} figures, not {len(values)}")
        kwargs = dict(zip(names, values, strict=True))
        return cls(**{**kwargs, "steps": int(kwargs["steps"]),
                      "interval": int(kwargs["interval"])})

    def contention(self, share: float) -> float:
        """What the exchange took from the steps beside it: measured, else its CPU time."""
        return self.contended_s if self.contended_s >= 0 else share * self.busy_s

    def overhead(self, share: float) -> float:
        """The fraction of the window's step time its snapshot cost."""
        spent = self.stage_s + self.wait_s + self.contention(share)
        return spent / max(self.steps * self.step_s, 1e-12)


@dataclass(frozen=True)
class Decision:
    """One decision on the interval, from one agreed window."""

    step: int
    """The snapshot step at which it was taken."""
    interval: int
    previous: int
    step_s: float
    """The typical (median) step time it used."""
    cost_s: float
    """The modelled cost of one snapshot at the interval chosen, from the typical figures."""
    overhead: float
    """Measured: the window's cost over its step time, at the interval it ran with."""
    expected: float
    """Modelled: the overhead at `interval`."""


@dataclass(frozen=True)
class Figures:
    """What a decision models from: a step's time, and one snapshot's fixed cost (staging
    and what the exchange took from the steps) and exchange time."""

    step_s: float
    fixed_s: float
    exchange_s: float

    def cost(self, k: int, margin: float = 1.0) -> float:
        """Modelled seconds one snapshot costs the step at interval k, the exchange taken as
        `margin` x as long."""
        return self.fixed_s + max(0.0, margin * self.exchange_s - (k - 0.5) * self.step_s)

    def overhead(self, k: int, margin: float = 1.0) -> float:
        return self.cost(k, margin) / (k * self.step_s) if self.step_s > 0 else 0.0


class IntervalPolicy:
    """The interval from agreed windows: pure and deterministic (module docstring)."""

    def __init__(self, *, budget: float, most: int, share: float, interval: int = 1) -> None:
        if not 0 < budget < 1:
            raise ValueError(f"budget = {budget!r}: must be between 0 and 1")
        self.budget = budget
        self.most = max(1, most)
        self.share = share
        self.interval = min(max(1, interval), self.most)
        self._history: deque[Figures] = deque(maxlen=HISTORY)

    @property
    def ready(self) -> bool:
        """Whether enough windows are in to decide on."""
        return len(self._history) == HISTORY

    @property
    def typical(self) -> Figures:
        """Each figure the median of the recent windows' (zeros before any)."""
        if not self._history:
            return Figures(step_s=0.0, fixed_s=0.0, exchange_s=0.0)
        return Figures(*(statistics.median(column) for column in zip(
            *((f.step_s, f.fixed_s, f.exchange_s) for f in self._history), strict=True)))

    @property
    def worst(self) -> Figures:
        """The shortest step time and the longest costs of the recent windows."""
        return Figures(step_s=min(f.step_s for f in self._history),
                       fixed_s=max(f.fixed_s for f in self._history),
                       exchange_s=max(f.exchange_s for f in self._history))

    def expected(self, k: int) -> float:
        """Modelled overhead at interval k from the typical figures (0 before any)."""
        return self.typical.overhead(k)

    def shortest_under(self, target: float, figures: Figures, margin: float = 1.0) -> int:
        """The smallest interval whose modelled overhead is at most `target` (`most` if none
        is): the overhead falls with k, so a bisection finds it."""
        lo, hi = 1, self.most
        if figures.overhead(hi, margin) > target:
            return hi
        while lo < hi:
            mid = (lo + hi) // 2
            if figures.overhead(mid, margin) <= target:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def observe(self, window: Window) -> None:
        """Add one agreed window's figures to the recent ones. A wait longer than the model
        gives its exchange counts as an exchange that long: the training thread waited for
        it as if it were (an exchange that started late, a copy that took the link's time)."""
        covered = (window.steps - 0.5) * window.step_s
        exchange_s = max(window.exchange_s, window.wait_s + covered if window.wait_s else 0.0)
        self._history.append(Figures(
            step_s=window.step_s, fixed_s=window.stage_s + window.contention(self.share),
            exchange_s=exchange_s))

    def decide(self, window: Window, step: int) -> Decision:
        """The interval after this window (also kept as `self.interval`): longer when the
        typical figures put the current one over the budget; shorter only when even the
        worst recent figures allow a shorter one under half of it."""
        previous = self.interval
        usable = window.step_s > 0 and math.isfinite(window.step_s) and window.steps > 0
        if usable:
            self.observe(window)
        if usable and self.ready:
            typical = self.typical
            if typical.overhead(previous) > self.budget:
                self.interval = max(previous, self.shortest_under(
                    GROW_TARGET * self.budget, typical, GROW_MARGIN))
            else:
                self.interval = min(previous, self.shortest_under(
                    SHRINK_TARGET * self.budget, self.worst, SHRINK_MARGIN))
        typical = self.typical
        return Decision(step=step, interval=self.interval, previous=previous,
                        step_s=typical.step_s, cost_s=typical.cost(self.interval),
                        overhead=window.overhead(self.share),
                        expected=typical.overhead(self.interval))


class Reading:
    """What the tier cost a world once its schedule took over: the median overhead of the
    windows run with a decided interval (of the last READING_WINDOWS). A median: the typical
    window's, not a hiccup's of the machine, nor a link's until the interval caught up."""

    def __init__(self) -> None:
        self.windows = 0
        self._overheads: deque[float] = deque(maxlen=READING_WINDOWS)

    def add(self, window: Window, share: float) -> None:
        self._overheads.append(window.overhead(share))
        self.windows += 1

    @property
    def overhead(self) -> float | None:
        return statistics.median(self._overheads) if self._overheads else None


@dataclass(frozen=True)
class ScheduleReport:
    """What a worker tells the controller of its schedule at a poll (auto mode only)."""

    changes: tuple[Decision, ...]
    """Decisions that changed the interval since the last poll."""
    interval: int
    step: int
    """The snapshot step of the last decision (0: none yet)."""
    overhead: float | None
    """The world's reading: the median overhead of its windows run with a decided interval
    (None: none yet)."""
    windows: int
    expected: float
    budget: float
    step_s: float
    cost_s: float


@dataclass
class SnapshotSchedule:
    """The steps one world snapshots, and the steps whose all-reduce waits for an exchange.

    `every`: an interval, or "auto". Fixed: a snapshot every `every` steps, each exchange
    waited for before the all-reduce of the step after it (replication.py's ordering). Auto:
    the next snapshot is `interval` steps after the last one, at the next persist step or at
    the last step, whichever comes first; an exchange is waited for before the all-reduce of
    the next snapshot's step (or of the step after a restored snapshot, whose older
    generations are dropped after that step). A snapshot outside that plan (a stop) first
    waits for every rank's exchange (`unplanned`).
    """

    every: int | str
    persist_every: int
    last_step: int
    budget: float = 0.02
    share: float = 0.0
    policy: IntervalPolicy = field(init=False)
    anchor: int | None = field(default=None, init=False)
    """The step of the world's last snapshot (None: none yet)."""
    wait_next: bool = field(default=False, init=False)
    snapshots: int = field(default=0, init=False)
    changes: deque[Decision] = field(default_factory=deque, init=False)
    """Decisions that changed the interval, until reported (the training thread appends,
    the worker's poll drains)."""
    reading: Reading = field(default_factory=Reading, init=False)
    _first: int | None = field(default=None, init=False)
    """Snapshots taken before the first decision (None: none yet)."""
    _latest: ScheduleReport = field(init=False)
    """The reading after the last decision, whole: the poll's thread reads it while the
    training thread decides the next."""

    def __post_init__(self) -> None:
        self.policy = IntervalPolicy(budget=self.budget, most=self.persist_every,
                                     share=self.share)
        self._latest = ScheduleReport(changes=(), interval=self.policy.interval, step=0,
                                      overhead=None, windows=0, expected=0.0,
                                      budget=self.budget, step_s=0.0, cost_s=0.0)

    @property
    def auto(self) -> bool:
        return self.every == AUTO

    @property
    def interval(self) -> int:
        return self.policy.interval if self.auto else int(self.every)

    def next_step(self) -> int:
        """The step of the next planned snapshot (auto): the snapshots up to the next persist
        step (or the last step) are spread evenly, at most `interval` apart, so that none
        lands just before it (its exchange would have a step or two to finish in, not an
        interval)."""
        anchor = self.anchor or 0
        persist = (anchor // self.persist_every + 1) * self.persist_every
        end = min(persist, max(self.last_step, anchor + 1))
        gaps = -(-(end - anchor) // self.policy.interval)  # ceil: snapshots up to `end`
        return anchor + -(-(end - anchor) // gaps)

    def due(self, step: int) -> bool:
        """Whether `step` ends with a planned snapshot."""
        if not self.auto:
            return step % int(self.every) == 0
        return step >= self.next_step()

    def must_wait(self, step: int) -> bool:
        """Whether the all-reduce that ends `step` must find the exchange in flight done."""
        if not self.auto or self.wait_next:
            return True
        return self.anchor is not None and step >= self.next_step()

    def unplanned(self, step: int) -> bool:
        """Whether a snapshot of `step` needs every rank's exchange done first: auto, not
        planned, and an exchange of this world may be in flight (the same on every rank)."""
        return self.auto and self.anchor is not None and not self.due(step)

    def taken(self, step: int, *, restored: bool = False) -> None:
        """A snapshot of `step` was staged (and its exchange started)."""
        self.anchor, self.wait_next = step, restored
        self.snapshots += 1

    def waited(self) -> None:
        """The all-reduce after a restored snapshot has waited for its exchange."""
        self.wait_next = False

    def agreed(self, window: Window, step: int) -> Decision | None:
        """Decide from a window every rank agreed on, at the snapshot of `step` (before it is
        taken). The world's first windows measure its set-up and are left out."""
        if not self.auto or self.snapshots <= WARMUP_WINDOWS + 1:
            return None
        measured = window.steps > 0 and window.step_s > 0
        if measured and self._first is not None and self.snapshots >= self._first + 2:
            # The window began at or after the snapshot of the first decision: it ran with
            # a decided interval (the one agreed at the next snapshot still did not).
            self.reading.add(window, self.share)
        decision = self.policy.decide(window, step)
        if self.policy.ready:
            if self._first is None:
                self._first = self.snapshots
            self._latest = ScheduleReport(
                changes=(), interval=decision.interval, step=step,
                overhead=self.reading.overhead, windows=self.reading.windows,
                expected=decision.expected, budget=self.budget, step_s=decision.step_s,
                cost_s=decision.cost_s)
        if decision.interval != decision.previous:
            self.changes.append(decision)
        return decision

    def report(self) -> ScheduleReport | None:
        """The decisions since the last report and the current reading (None: not auto).
        Safe from another thread than the one deciding."""
        if not self.auto:
            return None
        changes = tuple(self.changes.popleft() for _ in range(len(self.changes)))
        return replace(self._latest, changes=changes)


def replay(changes: list[tuple[int, int]], *, persist_every: int, last_step: int,
           start: int = 0, up_to: int | None = None) -> list[int]:
    """The snapshot steps of an auto schedule from its interval changes ((step, interval),
    as `snapshot_interval` events record them), starting after `start` (a restored step, or 0):
    what every rank of that world staged, up to `up_to` (default: the last step)."""
    schedule = SnapshotSchedule(AUTO, persist_every=persist_every, last_step=last_step)
    at = dict(changes)
    if start:
        schedule.taken(start)
    steps = []
    for step in range(start + 1, (up_to or last_step) + 1):
        if not schedule.due(step):
            continue
        if step in at:
            schedule.policy.interval = at[step]
        schedule.taken(step)
        steps.append(step)
    return steps


def snapshot_schedule(config: JobConfig, device: torch.device | str) -> SnapshotSchedule:
    """The schedule a worker's world follows, from the job's config and its device."""
    ck = config.checkpoint
    kind = device if isinstance(device, str) else device.type
    return SnapshotSchedule(ck.snapshot_every, persist_every=ck.persist_every,
                            last_step=config.train.steps, budget=ck.snapshot_budget,
                            share=cpu_share(kind))
