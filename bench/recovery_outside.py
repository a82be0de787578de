"""The outside-kill rows of bench/recovery.py for stalwart and torchrun (Ray Train's goes through
run_raytrain's own outside-kill fault): start the run as a user types it, SIGKILL rank 1's
process by its PID once step FAULT_STEP is logged, and measure kill -> the next completed step
from the run's own step log (bench/outside_kill.py, the same measure for every system). Every
side trains the reference config's own model and batch (OUTSIDE_MODEL: no overrides).

  stalwart  `stalwart run CONFIG --set ... --run-dir DIR` with no --inject; the step log is
            DIR/metrics.jsonl (a row every step), split into worlds at each `workers_started`
            event; rank 1's pid is in the newest `workers_started` event
  torchrun  `python -m torch.distributed.run --standalone --nproc_per_node 2 --max-restarts 3
            -m bench.peers.torchrun_recovery ...`; its steps.jsonl and attempts.jsonl
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

from bench import common
from bench.outside_kill import (
    OUTSIDE_KILL,
    POLL_S,
    OutsideKill,
    StepRow,
    last_logged,
    measure_kill,
    rank_pid,
    split_worlds,
    stalwart_rank_pid,
)
from bench.peers.torchrun_recovery import ATTEMPTS_FILE, STEPS_FILE, torchrun_command
from bench.recovery_runs import run_cli
from bench.recovery_setup import (
    FAULT_STEP,
    OUTSIDE_MODEL,
    OUTSIDE_STALWART,
    PERSIST_EVERY,
    STEPS,
    WORKERS,
)
from stalwart.core import events as ev
from stalwart.core.events import read_events, read_jsonl, read_metrics


def _failed(result: dict[str, Any], exc: Exception) -> dict[str, Any]:
    import traceback

    result.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                  completed=False, detected=False, detection_s=None, restart_s=None,
                  recovery_s=None, lost_steps=None, fault_time=None)
    return result


def run_stalwart_outside(runner: str, args: argparse.Namespace, work: Path,
                         rnd: int) -> dict[str, Any]:
    tag = f"r{rnd}-{OUTSIDE_KILL}-{runner}"
    run_dir, log = work / tag, work / f"{tag}.log"
    cmd = common.stalwart_command(args.config, OUTSIDE_STALWART, run_dir)
    result: dict[str, Any] = {"system": "stalwart", "runner": runner, "fault": OUTSIDE_KILL,
                              "round": rnd, "load_before": os.getloadavg()[0],
                              "log": str(log), "run_dir": str(run_dir), "command": cmd}
    killer = OutsideKill(
        after_step=FAULT_STEP,
        logged_step=lambda: max((r.step for r in read_metrics(run_dir / "metrics.jsonl")),
                                default=None),
        rank_pid=lambda: stalwart_rank_pid(run_dir, 1))
    try:
        code, wall = run_cli(cmd, log, args.timeout, killer.tick, poll_s=POLL_S)
    except Exception as exc:  # recorded, the other runs go on
        return _failed(result, exc)
    result.update(exit_code=code, wall_s=wall, **killer.record())
    result.update(analyse_stalwart_outside(run_dir, killer.time))
    result["completed"] = code == 0 and result["finished"]
    if code != 0 or result["missing_events"]:
        result["log_tail"] = common.tail(log, 25)
    return result


def analyse_stalwart_outside(run_dir: Path, kill_time: float | None) -> dict[str, Any]:
    """The outside-kill measure from metrics.jsonl, and stalwart's own account of the same
    recovery from events.jsonl (the `failure` and `recovered` events after the kill)."""
    events = read_events(run_dir / "events.jsonl")
    started = [e for e in events if isinstance(e, ev.WorkersStarted)]
    rows = split_worlds([(r.step, r.time) for r in read_metrics(run_dir / "metrics.jsonl")],
                        [e.time for e in started])
    out = measure_kill(rows, kill_time)
    kinds = [e.kind for e in events]
    out.update(fault_time=kill_time, event_kinds=kinds, detected=False, detection_s=None,
               restart_s=None, restored_from_step=out["resumed_from"], lost_steps_bound=0,
               finished=bool(kinds) and kinds[-1] == "finished", missing_events=[])
    if kill_time is None:
        out["missing_events"].append("no kill")
        return out
    later = [e for e in events if e.time > kill_time]
    failure = next((e for e in later if isinstance(e, ev.Failure)), None)
    recovered = next((e for e in later if isinstance(e, ev.Recovered)), None)
    start = next((e for e in later if isinstance(e, ev.WorkersStarted)), None)
    if failure is not None:  # kill -> the controller decides it is a failure, from outside
        out.update(detected=True, detection_s=failure.time - kill_time,
                   failure={k: v for k, v in failure.to_row().items() if k != "message"})
    if start is not None:
        out["restart_s"] = start.time - kill_time
    if recovered is not None:
        out.update(source=recovered.source, phases=recovered.phases,
                   restore_s=recovered.phases.get("restore"),
                   stalwart_recovery_s=recovered.recovery_s,
                   stalwart_from_step=recovered.from_step,
                   stalwart_lost_steps=recovered.lost_steps)
    out["missing_events"] = [k for k, e in (("failure", failure), ("recovered", recovered))
                             if e is None]
    if not out["finished"]:
        out["missing_events"].append(f"finished (last event: {kinds[-1] if kinds else 'none'})")
    return out


def run_torchrun_outside(args: argparse.Namespace, work: Path, rnd: int) -> dict[str, Any]:
    tag = f"r{rnd}-{OUTSIDE_KILL}-torchrun"
    workdir, log = work / tag, work / f"{tag}.log"
    workdir.mkdir(parents=True)
    cmd = torchrun_command(workdir, nproc=WORKERS, steps=STEPS, checkpoint_every=PERSIST_EVERY,
                           config=args.config, overrides=list(OUTSIDE_MODEL))
    result: dict[str, Any] = {"system": "torchrun", "runner": "torchrun", "fault": OUTSIDE_KILL,
                              "round": rnd, "load_before": os.getloadavg()[0],
                              "log": str(log), "command": cmd}
    killer = OutsideKill(
        after_step=FAULT_STEP,
        logged_step=lambda: last_logged(read_jsonl(workdir / STEPS_FILE)),
        rank_pid=lambda: rank_pid(read_jsonl(workdir / ATTEMPTS_FILE), 1))
    try:
        code, wall = run_cli(cmd, log, args.timeout, killer.tick, poll_s=POLL_S)
    except Exception as exc:  # recorded, the other runs go on
        return _failed(result, exc)
    result.update(exit_code=code, wall_s=wall, **killer.record())
    result.update(analyse_torchrun(workdir, killer.time))
    result["completed"] = code == 0 and result["final_step"] == STEPS
    if not result["completed"] or result["recovery_s"] is None:
        result["log_tail"] = common.tail(log, 25)
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        result["workdir"] = str(workdir)
    return result


def analyse_torchrun(workdir: Path, kill_time: float | None) -> dict[str, Any]:
    """The outside-kill measure from steps.jsonl (worlds: torchrun's restart count), and when
    the restarted processes started and were ready (attempts.jsonl)."""
    steps = read_jsonl(workdir / STEPS_FILE)
    attempts = read_jsonl(workdir / ATTEMPTS_FILE)
    out = measure_kill([StepRow(r["step"], r["time"], r["attempt"]) for r in steps], kill_time)
    out.update(fault_time=kill_time, restored_from_step=out["resumed_from"],
               attempts=sorted({a["attempt"] for a in attempts}),
               restarts=max((a["attempt"] for a in attempts), default=0), detected=False,
               detection_s=None, restart_s=None, ready_s=None)
    if kill_time is None:
        return out
    killed = max((a["attempt"] for a in attempts if a["time"] <= kill_time), default=None)
    later = [a for a in attempts if killed is not None and a["attempt"] > killed]
    starts = [a["time"] for a in later if a["event"] == "start"]
    readies = [a for a in later if a["event"] == "ready"]
    if starts:
        # kill -> the restarted processes exist: the agent noticed, stopped the group, ran
        # the rendezvous and spawned them. An upper bound of its detection.
        out.update(detected=True, restart_s=min(starts) - kill_time)
    if readies:
        out["ready_s"] = min(a["time"] for a in readies) - kill_time  # imported, restored
        out["restored_from_checkpoint"] = readies[0]["restored_from"]
    return out
