"""Goodput under a kill every minute: stalwart against Ray Train, side by side."""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import common
from bench.harness import Launch, attempts_pid, signal_pid, stalwart_rank_pid, stalwart_steps
from bench.peers import raytrain_recovery as rt
from bench.peers import raytrain_worker as rw
from stalwart.core import events as ev
from stalwart.core.events import read_events, read_jsonl, read_metrics
from stalwart.report.summary import median

STALWART_OVERRIDES = ["train.steps=1000000", "failure.max_failures=-1", "run.log_every=1",
                      "data.val_every=0", "run.progress=false"]
POLL_S = 0.5


def goodput(steps: list[tuple[int, float, Any]], starts: dict[Any, float], t0: float,
            t_stop: float) -> dict[str, Any]:
    """Productive time of the final trajectory over t_stop - t0. steps: (step, end time, world)
    in completion order; starts: when each world was ready. A world's steps without a row
    (their report dropped when it ended) share the time from its previous row to its next."""
    durations: dict[int, float] = {}
    last_end: dict[Any, tuple[int, float]] = {}
    final = trained = 0
    for step, end, world in steps:
        if end > t_stop:  # the step in flight when the run was asked to stop
            break
        prev = last_end.get(world)
        first, begin = ((prev[0] + 1, prev[1]) if prev is not None and prev[0] < step
                        else (step, starts.get(world, end)))
        for s in range(first, step + 1):  # a later completion of the same step replaces it
            durations[s] = (end - begin) / (step - first + 1)
        trained += step - first + 1
        last_end[world] = (step, end)
        final = step
    productive, wall = sum(d for s, d in durations.items() if s <= final), t_stop - t0
    return {"goodput": productive / wall if wall > 0 else None, "productive_s": productive,
            "wall_s": wall, "final_step": final, "steps_trained": trained,
            "steps_redone": trained - final}


def kill_on_schedule(running: Callable[[], bool], rank_pid: Callable[[], int | None],
                     t0: float, args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """SIGKILL rank 1 every --kill-every s until --duration s after t0: (the kills, the stop)."""
    kills: list[dict[str, Any]] = []
    next_kill = t0 + args.kill_every
    while running() and time.time() < t0 + args.duration:
        if time.time() >= next_kill:
            next_kill += args.kill_every
            if (pid := rank_pid()) is not None and signal_pid(pid, signal.SIGKILL):
                kills.append({"time": time.time(), "pid": pid})
    return kills, time.time()


def run_stalwart(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    run_dir = work / "stalwart"
    run = Launch(common.stalwart_command(str(common.DEFAULT_CONFIG), STALWART_OVERRIDES,
                                         run_dir), work / "stalwart.log")

    def running() -> bool:
        time.sleep(POLL_S)
        return run.running()

    kills, t_stop = kill_on_schedule(running, lambda: stalwart_rank_pid(run_dir, 1), run.time, args)
    code = run.stop(signal.SIGINT)  # stop after the step in flight, checkpoint it
    events, rows = read_events(run_dir / "events.jsonl"), stalwart_steps(run_dir)
    # A world is ready when its first step starts: that row's window_s is the step's own time.
    starts: dict[Any, float] = {}
    for row, m in zip(rows, read_metrics(run_dir / "metrics.jsonl"), strict=True):
        starts.setdefault(row.world, m.time - (m.window_s or 0.0))
    recovered = [e for e in events if isinstance(e, ev.Recovered)]
    out = {"system": "stalwart", "exit_code": code, "kills": len(kills),
           "failures": sum(isinstance(e, ev.Failure) for e in events),
           "recoveries": len(recovered), "lost_steps": sum(e.lost_steps for e in recovered),
           "median_recovery_s": median(e.recovery_s for e in recovered),
           **goodput(rows, starts, run.time, t_stop), "run_dir": str(run_dir)}
    report = subprocess.run([str(common.STALWART), "report", str(run_dir), "--json"],
                            capture_output=True, text=True)
    if report.returncode == 0:  # stalwart's own report of the same run, for comparison
        out["stalwart_report"] = json.loads(report.stdout)
    return out


def run_raytrain(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Ray Train on the same schedule: a local Ray of 2 CPUs, the bench train loop."""
    workdir = work / "raytrain"
    workdir.mkdir()
    _, job = common.tokens_per_step(str(common.DEFAULT_CONFIG), [])  # tokenizes the data
    with rt.ray_train(workdir, {
            "config": str(common.DEFAULT_CONFIG), "overrides": ["train.steps=1000000"],
            "fault": "kill", "fault_step": 0, "checkpoint_every": job.checkpoint.persist_every},
            name="raytrain-goodput", max_failures=-1,
            head_cpus=rw.NUM_WORKERS) as (_, thread, fit_out):
        t0 = fit_out["start"]  # the fit's start, after Ray and the trainer are up

        def running() -> bool:
            thread.join(POLL_S)
            return thread.is_alive()

        kills, t_stop = kill_on_schedule(
            running, lambda: attempts_pid(workdir / rw.ATTEMPTS_FILE, 1, event="ready"), t0,
            args)
        (workdir / rw.STOP_FILE).write_text(json.dumps({"time": t_stop}))
        thread.join(180)
    ready = [a for a in read_jsonl(workdir / rw.ATTEMPTS_FILE)
             if a["event"] == "ready" and a["rank"] == 0]
    steps = [(s["step"], s["time"], s["pid"]) for s in read_jsonl(workdir / rw.STEPS_FILE)]
    return {"system": "ray_train", "kills": len(kills), "recoveries": len(ready[1:]),
            "fit_error": fit_out.get("error"),
            **goodput(steps, {a["pid"]: a["time"] for a in ready}, t0, t_stop),
            "workdir": str(workdir)}


def main() -> int:
    p = common.parser(__doc__, __spec__, "goodput.json")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of training per run")
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between kills")
    p.add_argument("--only", choices=("stalwart", "raytrain"), help="run one side only")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="goodput-") as tmp:
        if args.only in (None, "stalwart"):
            results.append(run_stalwart(args, Path(tmp)))
        if args.only in (None, "raytrain"):
            results.append(run_raytrain(args, Path(tmp)))
        print(f"{'system':10} {'goodput':>8} {'kills':>6} {'recov':>6} {'steps':>7} "
              f"{'redone':>7} {'productive s':>13} {'wall s':>8}")
        for r in results:
            print(f"{r['system']:10} {r['goodput']:8.3f} {r['kills']:6d} {r['recoveries']:6d} "
                  f"{r['final_step']:7d} {r['steps_redone']:7d} {r['productive_s']:13.1f} "
                  f"{r['wall_s']:8.1f}")
            if "stalwart_report" in r:  # its own definition: wall from the first event
                own = r["stalwart_report"]
                print(f"  `stalwart report` of that run: goodput {own['goodput']:.3f} (wall "
                      f"{own['wall_s']:.1f} s from its first event: Ray's start-up excluded)")
        common.write_report(args.out, {"duration_s": args.duration, "kill_every_s": args.kill_every,
                                       "target": {"stalwart_goodput": 0.95}}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
