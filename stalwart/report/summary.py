"""Where a run's time went: the numbers `stalwart report` prints, from a run directory's
events and metrics rows. Pure functions: no files, no clock (`now` is passed in).

Goodput = productive step time / wall time, between 0 and 1:

- *productive step time* is the time the workers spent on the steps whose results the run
  kept. Every kept step's time is on record once: metrics rows carry the window of steps
  since the previous row (`window_s`, `steps_in_window`), and the steps a world ended with
  after its last row, when the next world goes on from them, are in `kept_unlogged` of the
  `workers_started` (or `stopped`) event. Work a restore went back on is not productive: a
  record of steps past a restore's `from_step` made before the failure that caused it
  (before the `resumed` event, for a resume) was lost, and its steps were trained again.
- *wall time* is the time from the run's first event to its last (now, while it is still
  running), summed over its invocations: the time between a run's end and its `--resume`
  is not the run's.

Steps with no time on record (a run that failed or was interrupted after its last row and
was resumed from a later checkpoint; a step its controller never saw) are counted in
`untimed_steps` and left out of productive time: goodput is then a lower bound.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from stalwart.core import events as ev

# Events that end an invocation of a run; without one after the last start, it is running.
END_EVENTS: tuple[type[ev.Event], ...] = (ev.Finished, ev.Failed, ev.Stopped, ev.Interrupted)


@dataclass(frozen=True, kw_only=True)
class Segment:
    """Steps `first_step..last_step` (inclusive) and the seconds they took, as recorded."""

    first_step: int
    last_step: int
    window_s: float | None
    """None for a row written before rows carried their window (an older stalwart)."""
    time: float
    """When it was recorded: a row's step end, or its event's time."""


@dataclass(frozen=True, kw_only=True)
class Rollback:
    """A restore that went back to `from_step`: work past it recorded before `cutoff` was lost."""

    cutoff: float
    from_step: int


@dataclass(frozen=True, kw_only=True)
class Summary:
    state: str
    """running, finished, failed, stopped or interrupted (the last invocation's end)."""
    wall_s: float
    steps_done: int
    """The last step the run reached."""
    steps_total: int | None
    """train.steps"""
    start_step: int
    """The step the run's first invocation started from (0 unless it started from a checkpoint)."""
    tokens_per_step: int | None
    tokens: int | None
    """Tokens of the steps the run trained (each step once)."""
    throughput_unit: str
    """What `tokens` counts: "tokens", or "samples" when the task's count_tokens counts one
    per sample (stalwart.progress.throughput_unit)."""
    last_metrics: dict[str, float]
    """The last row's loss and the task's own metrics, with the last validation's
    `val_loss` and `val_` metrics."""
    failures: list[dict[str, Any]]
    failures_by_kind: dict[str, int]
    recoveries_by_source: dict[str, int]
    detection_s_median: float | None
    recovery_s_median: float | None
    lost_steps: int
    resizes: list[dict[str, Any]]
    checkpoints: int
    checkpoint_save_s: float
    """Sum of the storage saves' durations (start of a save to its manifest)."""
    async_save: bool
    """True: the saves ran in the background while training went on (not a pause)."""
    productive_s: float | None
    """None when the rows carry no window (an older stalwart): goodput is then unknown."""
    untimed_steps: int | None
    """Kept steps with no time on record (None when the rows carry no window)."""
    goodput: float | None
    data_wait: float | None = None
    """The share of step time the steps waited for their data: the rows' data_wait_s over
    their window_s (None when no row carries data_wait_s)."""
    numerical_faults: list[dict[str, Any]] = field(default_factory=list)
    """Each `numerical_fault` event: step, fault, action, ranks, rollback_to."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rollbacks(events: list[ev.Event]) -> list[Rollback]:
    """Every restore that may have gone back: recoveries (cut at the failure that caused
    them; rows of the new world come after it) and resumes (cut at the resume)."""
    out: list[Rollback] = []
    last_failure: float | None = None
    for e in events:
        if isinstance(e, ev.Failure):
            last_failure = e.time
        elif isinstance(e, ev.Recovered):
            cutoff = last_failure if last_failure is not None else e.time - e.recovery_s
            out.append(Rollback(cutoff=cutoff, from_step=e.from_step))
            last_failure = None
        elif isinstance(e, ev.Resumed):
            out.append(Rollback(cutoff=e.time, from_step=e.from_step))
    return out


def is_kept(segment: Segment, backs: list[Rollback]) -> bool:
    """A record survives unless a later restore went back before its last step."""
    return not any(b.cutoff > segment.time and segment.last_step > b.from_step for b in backs)


def row_segment(row: ev.MetricsRow) -> Segment:
    n = row.steps_in_window if row.steps_in_window is not None else 1
    return Segment(first_step=row.step - n + 1, last_step=row.step, window_s=row.window_s,
                   time=row.time)


def segments(events: list[ev.Event], rows: list[ev.MetricsRow]) -> list[Segment]:
    """Every record of step time: the rows' windows and the events' kept unlogged steps."""
    out = [row_segment(r) for r in rows]
    for e in events:
        tail = e.kept_unlogged if isinstance(e, ev.WorkersStarted | ev.Stopped) else None
        if tail:
            out.append(Segment(first_step=tail.first_step, last_step=tail.last_step,
                               window_s=tail.window_s, time=e.time))
    return out


def kept_rows(events: list[ev.Event], rows: list[ev.MetricsRow]) -> list[bool]:
    """For each row: whether its steps' results were kept (False: a lost attempt)."""
    backs = rollbacks(events)
    return [is_kept(row_segment(r), backs) for r in rows]


def invocations(events: list[ev.Event]) -> list[list[ev.Event]]:
    """The events of each invocation of the run (a `--resume` starts a new one)."""
    out: list[list[ev.Event]] = []
    for e in events:
        if not out or isinstance(e, ev.Resumed):
            out.append([])
        out[-1].append(e)
    return out


def wall_time(events: list[ev.Event], rows: list[ev.MetricsRow], now: float,
              running: bool) -> float:
    """First event to last (or to now while running), over each invocation; a row written
    after its invocation's last event (a driver killed without a final event) extends it."""
    parts = invocations(events)
    total = 0.0
    for i, part in enumerate(parts):
        start = part[0].time
        next_start = parts[i + 1][0].time if i + 1 < len(parts) else float("inf")
        end = max([part[-1].time, *(r.time for r in rows if start <= r.time < next_start)])
        if running and i == len(parts) - 1:
            end = max(end, now)
        total += end - start
    return total


def run_state(events: list[ev.Event]) -> str:
    last = invocations(events)[-1] if events else []
    ends = [e.kind for e in last if isinstance(e, END_EVENTS)]
    return ends[-1] if ends else "running"


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are known (None left out); None when none is."""
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def tokens_per_step(rows: list[ev.MetricsRow]) -> int | None:
    """tokens_per_s x window_s / steps_in_window (the same for every step of a task)."""
    per_step = [r.tokens_per_s * r.window_s / r.steps_in_window
                for r in rows if r.window_s and r.steps_in_window]
    return round(statistics.median(per_step)) if per_step else None


def last_metrics(rows: list[ev.MetricsRow]) -> dict[str, float]:
    """The newest row's loss and task metrics, with the newest validation's values."""
    if not rows:
        return {}
    validation: dict[str, float] = {}
    for r in rows:
        if r.val_loss is not None:
            validation = {"val_loss": r.val_loss, **{k: v for k, v in r.task_metrics.items()
                                                     if k.startswith("val_")}}
    own = {k: v for k, v in rows[-1].task_metrics.items() if not k.startswith("val_")}
    return {"loss": rows[-1].loss, **validation, **own}


def unit(rows: list[ev.MetricsRow], per_step: int | None) -> str:
    """What the rows' tokens_per_s counts (every step trains samples_seen / step samples)."""
    from stalwart.progress import throughput_unit

    counted = [r for r in rows if r.step > 0]
    return throughput_unit(per_step, counted[-1].samples_seen / counted[-1].step
                           if counted else None)


def data_wait(rows: list[ev.MetricsRow]) -> float | None:
    """Sum of data_wait_s over sum of window_s, over the rows that carry both (every
    attempt's: a lost one waited too)."""
    timed = [r for r in rows if r.data_wait_s is not None and r.window_s is not None]
    window = sum(r.window_s or 0.0 for r in timed)
    if not timed or window <= 0:
        return None
    return sum(r.data_wait_s or 0.0 for r in timed) / window


def summarize(events: list[ev.Event], rows: list[ev.MetricsRow], *, now: float,
              steps_total: int | None = None, async_save: bool = True) -> Summary:
    if not events:
        raise ValueError("a run's summary needs at least one event")
    state = run_state(events)
    notes: list[str] = []

    backs = rollbacks(events)
    kept = [s for s in segments(events, rows) if is_kept(s, backs)]
    started = [e for e in events if isinstance(e, ev.Started)]
    start_step = started[0].start_step if started else 0
    ends = [e.step for e in invocations(events)[-1] if isinstance(e, END_EVENTS)]
    steps_done = max([start_step, *(s.last_step for s in kept), *ends[-1:]])
    timed_steps = sum(s.last_step - s.first_step + 1 for s in kept)
    untimed: int | None = max(0, steps_done - start_step - timed_steps)
    productive: float | None = sum(s.window_s for s in kept if s.window_s is not None)
    if any(s.window_s is None for s in kept):
        productive = untimed = None
        notes.append("goodput unknown: metrics rows without window_s (written by an older "
                     "stalwart)")
    elif untimed:
        notes.append(f"{untimed} step(s) have no time on record (trained after the last "
                     f"metrics row of a run that failed or was interrupted): goodput is a "
                     f"lower bound")
    wall = wall_time(events, rows, now, running=state == "running")
    goodput = None
    if productive is not None and wall > 0:
        # Rows are timed on rank 0's clock, events on the driver's: across machines a tiny
        # run could come out a hair above 1.
        goodput = min(1.0, productive / wall)

    per_step = tokens_per_step(rows)
    failures = [{"kind": e.failure_kind, "step": e.step, "ranks": e.ranks,
                 "detection_s": e.detection_s, "time": e.time}
                for e in events if isinstance(e, ev.Failure)]
    recovered = [e for e in events if isinstance(e, ev.Recovered)]
    saves = [e for e in events if isinstance(e, ev.CheckpointCommitted)]
    return Summary(
        state=state, wall_s=wall, steps_done=steps_done, steps_total=steps_total,
        start_step=start_step, tokens_per_step=per_step,
        tokens=None if per_step is None else per_step * (steps_done - start_step),
        throughput_unit=unit(rows, per_step), last_metrics=last_metrics(rows),
        failures=failures,
        failures_by_kind=dict(Counter(f["kind"] for f in failures)),
        recoveries_by_source=dict(Counter(e.source for e in recovered)),
        detection_s_median=median(f["detection_s"] for f in failures),
        recovery_s_median=median(e.recovery_s for e in recovered),
        lost_steps=sum(e.lost_steps for e in recovered),
        resizes=[{"step": e.step, "old_world_size": e.old_world_size,
                  "new_world_size": e.new_world_size, "reason": e.reason, "time": e.time}
                 for e in events if isinstance(e, ev.Resized)],
        checkpoints=len(saves), checkpoint_save_s=sum(e.save_s or 0.0 for e in saves),
        async_save=async_save, productive_s=productive, untimed_steps=untimed,
        goodput=goodput, data_wait=data_wait(rows), notes=notes,
        numerical_faults=[{"step": e.step, "fault": e.fault, "action": e.action,
                           "ranks": e.ranks, "rollback_to": e.rollback_to}
                          for e in events if isinstance(e, ev.NumericalFault)])
