"""One chaos run: launch `stalwart run`, fire its planned faults at their wall-clock moments,
resume it after each driver kill, and wait for it to end. The checks come after
(chaos_checks.py); this module only records what it did and when.

Deferrals (each is recorded in the fault's row, with the moment it finally fired):
- a worker fault waits for a live worker of the current driver (none while a driver starts);
- a driver kill waits for a committed checkpoint (`--resume` needs one) and for the faults
  fired before it to show up in events.jsonl (a driver killed first would take their
  record with it, and the soak could not tell a missed fault from a superseded one).
A fault still pending when the run ends is "not fired": the run was over before its moment.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

from bench import chaos_checks as checks
from bench import chaos_faults as cf
from bench import common
from stalwart.core import events as ev
from stalwart.core.events import read_jsonl

POLL_S = 0.1
DRIVER_DEFER_S = 90.0
"""How long a driver kill waits for a checkpoint and for earlier faults' records."""


class Launch:
    """The current `stalwart run` process of a run (one per invocation)."""

    def __init__(self, cmd: list[str], log: Path, run_dir: Path) -> None:
        self.skip = len(read_jsonl(run_dir / "events.jsonl")) if (run_dir / "events.jsonl"
                                                                   ).exists() else 0
        with log.open("a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                         cwd=common.ROOT, env=common.child_env(),
                                         start_new_session=True)
        self.t_launch = time.time()

    def running(self) -> bool:
        return self.proc.poll() is None


def run_with_faults(plan: cf.RunPlan, cmd: list[str], run_dir: Path, log: Path, *,
                    train_s: float, timeout: float) -> dict[str, Any]:
    """Run cmd with plan's faults; train_s: the seconds of training of the layout's
    failure-free reference. Returns the faults as fired and the driver's exit codes."""
    launch = Launch(cmd, log, run_dir)
    deadline = launch.t_launch + timeout
    # The plan's moments are on the training clock: from the run's first step (start-up
    # times vary too much from run to run to aim at a moment of training from the launch).
    t0 = _first_step_time(launch, run_dir, 0)
    fired: list[dict[str, Any]] = []
    hit: set[int] = set()
    codes: list[int] = []
    timed_out = False
    start = launch.t_launch
    for fault in plan.faults:
        row: dict[str, Any] = {"kind": fault.kind, "planned_s": round(fault.at * train_s, 2)}
        fired.append(row)
        due = t0 + fault.at * train_s
        while launch.running() and time.time() < due:
            time.sleep(POLL_S)
        if fault.kind == "driver":
            launch, shift = _driver_fault(row, launch, cmd, run_dir, log, fired, codes)
            t0 += shift
        else:
            _worker_fault(row, fault, launch, run_dir, hit)
        if time.time() > deadline:
            timed_out = True
            break
    while launch.running() and time.time() < deadline:
        time.sleep(POLL_S)
    if launch.running():
        timed_out = True
        row = {"kind": "timeout", "left": cf.kill_driver(launch.proc.pid)}
        fired.append(row)
    codes.append(launch.proc.wait())
    for pid in hit:  # never leave a process we stopped behind (its run is over)
        if cf.pid_alive(pid):
            cf.signal_worker(pid, "kill")
    return {"faults": fired, "exit_codes": codes, "timed_out": timed_out,
            "wall_s": round(time.time() - start, 1)}


def _worker_fault(row: dict[str, Any], fault: cf.PlannedFault, launch: Launch,
                  run_dir: Path, hit: set[int]) -> None:
    while launch.running():
        events = cf.invocation_events(run_dir, launch.skip)
        live = cf.live_workers(events, hit)
        if live:
            target = live[int(fault.pick * len(live))]
            row["time"] = time.time()
            if cf.signal_worker(target.pid, fault.kind):
                hit.add(target.pid)
                generation = [e for e in events if isinstance(e, ev.WorkersStarted)][-1]
                row.update(fired=True, pid=target.pid, rank=target.rank,
                           generation=generation.generation,
                           step=checks.last_logged_step(run_dir))
                return
        time.sleep(POLL_S)
    row.update(fired=False, why="the run had ended")


def _driver_fault(row: dict[str, Any], launch: Launch, cmd: list[str], run_dir: Path,
                  log: Path, fired: list[dict[str, Any]], codes: list[int]
                  ) -> tuple[Launch, float]:
    """Kill the driver's group, then `--resume`; returns the new launch and how far the
    plan's clock moves (the time from the kill to the resumed world's start)."""
    give_up = time.time() + DRIVER_DEFER_S
    while launch.running() and time.time() < give_up:
        events = cf.invocation_events(run_dir, 0)
        committed = any(isinstance(e, ev.CheckpointCommitted) for e in events)
        pending = [r for r in fired if r.get("fired") and r["kind"] != "driver"
                   and checks.worker_fault_record(r, events) is None]
        if committed and not pending:
            break
        time.sleep(POLL_S)
    if not launch.running():
        row.update(fired=False, why="the run had ended")
        return launch, 0.0
    if time.time() >= give_up:
        row.update(fired=False, why=f"no checkpoint or earlier faults unrecorded after "
                                    f"{DRIVER_DEFER_S:.0f}s")
        return launch, 0.0
    row["time"] = time.time()
    row["step"] = checks.last_logged_step(run_dir)
    row["left_processes"] = cf.kill_driver(launch.proc.pid)
    codes.append(launch.proc.wait())
    row["fired"] = True
    rows = len(read_jsonl(run_dir / "metrics.jsonl"))
    resumed = Launch([*cmd, "--resume"], log, run_dir)
    row["events_before_resume"] = resumed.skip
    return resumed, _first_step_time(resumed, run_dir, rows) - row["time"]


def _first_step_time(launch: Launch, run_dir: Path, rows_before: int) -> float:
    """When the launch logged its first step (now, if it ended first)."""
    while launch.running() and len(read_jsonl(run_dir / "metrics.jsonl")) <= rows_before:
        time.sleep(POLL_S)
    return time.time()
