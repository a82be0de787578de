"""The chaos soak's faults: which ones a run gets (from one seed), and firing them from outside."""

from __future__ import annotations

import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.chaos_checks import last_logged_step, worker_fault_record
from bench.harness import Launch, kill_tree, pid_alive, signal_pid
from stalwart.core import events as ev
from stalwart.core.events import read_events, read_jsonl

WORKER_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
KINDS = (*WORKER_SIGNALS, "driver")
MIN_FAULTS, MAX_FAULTS = 2, 4
MIN_GAP = 0.04  # between two faults of a run, as a fraction of the training window
POLL_S = 0.1
DRIVER_DEFER_S = 90.0  # how long a driver kill waits for a checkpoint and earlier faults' records


@dataclass(frozen=True, kw_only=True)
class PlannedFault:
    kind: str  # kill, stop, term (a signal to a worker process) or driver
    at: float  # when, as a fraction of the failure-free training window (0: its first step)
    pick: float  # in [0, 1): which of the live workers is hit, by index in rank order


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    index: int
    layout: str
    faults: tuple[PlannedFault, ...]


def plan_soak(seed: int, runs: int, layouts: list[str]) -> list[RunPlan]:
    """Every run's layout and faults, all from one random.Random(seed)."""
    rng = random.Random(seed)
    plans = []
    for index in range(runs):
        layout = rng.choice(layouts)
        kinds = [rng.choice(KINDS) for _ in range(rng.randint(MIN_FAULTS, MAX_FAULTS))]
        plans.append(RunPlan(index=index, layout=layout, faults=tuple(
            PlannedFault(kind=k, at=a, pick=rng.random())
            for k, a in zip(kinds, _moments(rng, len(kinds)), strict=True))))
    return plans


def _moments(rng: random.Random, n: int) -> list[float]:
    """n sorted moments in [0, 0.9] (later ones would mostly land after the end), MIN_GAP apart."""
    while True:
        at = sorted(round(rng.uniform(0.0, 0.9), 4) for _ in range(n))
        if all(b - a >= MIN_GAP for a, b in zip(at, at[1:], strict=False)):
            return at


def live_workers(events: list[ev.Event], exclude: set[int]) -> list[ev.WorkerPlace]:
    """The newest world's live workers but `exclude` (already hit: a second SIGSTOP is no fault)."""
    started = [e for e in events if isinstance(e, ev.WorkersStarted)]
    return [w for w in started[-1].workers
            if w.pid not in exclude and pid_alive(w.pid)] if started else []


class Invocation(Launch):
    """One `stalwart run` of a run: the events before it are earlier invocations'."""

    def __init__(self, cmd: list[str], log: Path, run_dir: Path) -> None:
        self.skip = len(read_jsonl(run_dir / "events.jsonl"))
        super().__init__(cmd, log)


def run_with_faults(plan: RunPlan, cmd: list[str], run_dir: Path, log: Path, *,
                    train_s: float, timeout: float) -> dict[str, Any]:
    """Run cmd with plan's faults (train_s: the failure-free reference's seconds of training)."""
    run = Invocation(cmd, log, run_dir)
    start, deadline = run.time, run.time + timeout
    # The plan's moments are on the training clock, from the run's first step: start-up
    # times vary too much from run to run to aim at a moment of training from the launch.
    t0 = _first_step_time(run, run_dir, 0)
    fired: list[dict[str, Any]] = []
    hit: set[int] = set()
    codes: list[int] = []
    for fault in plan.faults:
        row: dict[str, Any] = {"kind": fault.kind, "planned_s": round(fault.at * train_s, 2)}
        fired.append(row)
        while run.running() and time.time() < t0 + fault.at * train_s:
            time.sleep(POLL_S)
        if fault.kind == "driver":
            run, shift = _driver_fault(row, run, cmd, run_dir, log, fired, codes)
            t0 += shift
        else:
            _worker_fault(row, fault, run, run_dir, hit)
        if time.time() > deadline:
            break
    while run.running() and time.time() < deadline:
        time.sleep(POLL_S)
    timed_out = run.running() or time.time() > deadline
    if run.running():
        fired.append({"kind": "timeout", "left": kill_tree(run.proc.pid)})
    codes.append(run.proc.wait())
    for pid in hit:  # never leave a process we stopped behind (its run is over)
        signal_pid(pid, signal.SIGKILL)
    return {"faults": fired, "exit_codes": codes, "timed_out": timed_out,
            "wall_s": round(time.time() - start, 1)}


def _worker_fault(row: dict[str, Any], fault: PlannedFault, run: Invocation, run_dir: Path,
                  hit: set[int]) -> None:
    while run.running():
        events = read_events(run_dir / "events.jsonl")[run.skip:]
        if live := live_workers(events, hit):
            target = live[int(fault.pick * len(live))]
            row["time"] = time.time()
            if signal_pid(target.pid, WORKER_SIGNALS[fault.kind]):
                hit.add(target.pid)
                generation = [e for e in events if isinstance(e, ev.WorkersStarted)][-1]
                row.update(fired=True, pid=target.pid, rank=target.rank,
                           generation=generation.generation, step=last_logged_step(run_dir))
                return
        time.sleep(POLL_S)
    row.update(fired=False, why="the run had ended")


def _driver_fault(row: dict[str, Any], run: Invocation, cmd: list[str], run_dir: Path, log: Path,
                  fired: list[dict[str, Any]], codes: list[int]) -> tuple[Invocation, float]:
    """Kill the driver, then `--resume`: (the new invocation, the kill -> resumed start s)."""
    give_up = time.time() + DRIVER_DEFER_S
    while run.running() and time.time() < give_up:
        events = read_events(run_dir / "events.jsonl")
        committed = any(isinstance(e, ev.CheckpointCommitted) for e in events)
        pending = [r for r in fired if r.get("fired") and r["kind"] != "driver"
                   and worker_fault_record(r, events) is None]
        if committed and not pending:
            break
        time.sleep(POLL_S)
    if not run.running() or time.time() >= give_up:
        row.update(fired=False, why="the run had ended" if not run.running() else
                   f"no checkpoint or earlier faults unrecorded after {DRIVER_DEFER_S:.0f}s")
        return run, 0.0
    row.update(time=time.time(), step=last_logged_step(run_dir))
    row["left_processes"] = kill_tree(run.proc.pid)
    codes.append(run.proc.wait())
    row["fired"] = True
    rows = len(read_jsonl(run_dir / "metrics.jsonl"))
    resumed = Invocation([*cmd, "--resume"], log, run_dir)
    row["events_before_resume"] = resumed.skip
    return resumed, _first_step_time(resumed, run_dir, rows) - row["time"]


def _first_step_time(run: Invocation, run_dir: Path, rows_before: int) -> float:
    """When the invocation logged its first step (now, if it ended first)."""
    while run.running() and len(read_jsonl(run_dir / "metrics.jsonl")) <= rows_before:
        time.sleep(POLL_S)
    return time.time()
