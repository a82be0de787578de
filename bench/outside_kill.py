"""The outside-kill measure of bench/recovery.py, the same for every system: SIGKILL rank 1's
process by its PID once a step is logged, then read the run's own step log for the time from
the kill to the next completed step, the steps lost and a normal step's time.

Each system brings its step rows (step, end time, world) and its way to find the PID:
stalwart's metrics.jsonl and `workers_started` events, Ray Train's and torchrun's step and
attempt logs (bench/peers/raytrain_worker.py, bench/peers/torchrun_recovery.py). A world is whatever tells
the processes of one start of the training apart (stalwart's generation, Ray Train's rank-0
pid, torchrun's restart count).
"""

from __future__ import annotations

import os
import signal
import statistics
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, NamedTuple

OUTSIDE_KILL = "outside-kill"  # the fault's name in bench/recovery.py and run_raytrain
POLL_S = 0.05  # how often the harness reads the step log: the kill lands within a step or two


class StepRow(NamedTuple):
    step: int
    time: float
    """The step's end (time.time())."""
    world: Hashable


class OutsideKill:
    """Kills once: call tick() every poll. Once `logged_step()` reaches `after_step` and
    `rank_pid()` names a process, it SIGKILLs that process and records when (the clock read
    just before the signal), the pid and the step that was logged."""

    def __init__(self, *, after_step: int, logged_step: Callable[[], int | None],
                 rank_pid: Callable[[], int | None]) -> None:
        self.after_step = after_step
        self.logged_step = logged_step
        self.rank_pid = rank_pid
        self.time: float | None = None
        self.pid: int | None = None
        self.step_logged: int | None = None
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.time is not None or self.error is not None

    def tick(self) -> None:
        if self.done:
            return
        step = self.logged_step()
        if step is None or step < self.after_step:
            return
        pid = self.rank_pid()
        if pid is None:
            return
        now = time.time()
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            self.error = f"rank 1's process {pid} was gone when step {step} was logged"
            return
        self.time, self.pid, self.step_logged = now, pid, step

    def record(self) -> dict[str, Any]:
        return {"kill_time": self.time, "killed_pid": self.pid,
                "kill_after_step_logged": self.step_logged, "kill_error": self.error}


def split_worlds(rows: list[tuple[int, float]], world_starts: list[float]) -> list[StepRow]:
    """Rows of a log without a world id (stalwart's metrics.jsonl), each given the number of
    worlds started at or before its end: world_starts are the launch times of the worlds."""
    starts = sorted(world_starts)
    return [StepRow(step, t, sum(1 for s in starts if s <= t)) for step, t in rows]


def measure_kill(rows: list[StepRow], kill_time: float | None) -> dict[str, Any]:
    """kill -> the next completed step, from a run's step rows.

    The killed world is the one that completed the last step before the kill. The next
    completed step is the first one of another world that ends after the kill: the killed
    world's rank 0 may still log the step in flight a few ms after the kill (its all-reduce
    had finished), which is not a recovery; that step counts as completed before the kill.
    lost_steps = the killed world's last step - the step resumed from (the next completed
    step - 1). normal_step_s: the median time between consecutive steps of the killed world
    that ended before the kill (checkpoint steps included, as they come).
    """
    out: dict[str, Any] = {"steps_before_kill": None, "last_step_of_killed_world": None,
                           "first_step_after": None, "recovery_s": None,
                           "resumed_from": None, "lost_steps": None, "normal_step_s": None,
                           "final_step": max((r.step for r in rows), default=0)}
    if kill_time is None:
        return out
    before = sorted((r for r in rows if r.time <= kill_time), key=lambda r: r.time)
    if not before:
        return out
    killed = before[-1].world
    out["steps_before_kill"] = max(r.step for r in before)
    out["last_step_of_killed_world"] = max(r.step for r in rows if r.world == killed)
    own = [r for r in before if r.world == killed]
    gaps = [b.time - a.time for a, b in zip(own, own[1:], strict=False) if b.step == a.step + 1]
    out["normal_step_s"] = statistics.median(gaps) if gaps else None
    after = [r for r in rows if r.world != killed and r.time > kill_time]
    if after:
        first = min(after, key=lambda r: r.time)
        out["first_step_after"] = first.step
        out["recovery_s"] = first.time - kill_time
        out["resumed_from"] = first.step - 1
        out["lost_steps"] = out["last_step_of_killed_world"] - out["resumed_from"]
    return out


def last_logged(rows: list[dict[str, Any]]) -> int | None:
    """The highest step of a step log's rows so far (None before the first)."""
    return max((r["step"] for r in rows), default=None)


def rank_pid(attempts: list[dict[str, Any]], rank: int) -> int | None:
    """The pid of `rank` in the newest attempt that has logged its start."""
    starts = [a for a in attempts if a["event"] == "start" and a["rank"] == rank
              and not a.get("stopping")]
    return starts[-1]["pid"] if starts else None


def stalwart_rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of `rank` in a stalwart run's newest world (its last `workers_started`)."""
    from stalwart.core import events as ev

    started = [e for e in ev.read_events(run_dir / "events.jsonl")
               if isinstance(e, ev.WorkersStarted)]
    if not started:
        return None
    return next((w.pid for w in started[-1].workers if w.rank == rank), None)
