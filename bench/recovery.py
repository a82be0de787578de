"""Recovery: how fast stalwart, Ray Train's TorchTrainer and torchrun recover from a fault.

The reference task on 2 workers, 40 steps, a storage checkpoint every 10, one fault on rank 1
at step 25 (docs/benchmarks.md has the method and the last figures):

  kill          SIGKILL the worker process (`stalwart run --inject kill:...`)
  hang          SIGSTOP it: alive, silent, holding its peer in the all-reduce
  node          a local multi-node cluster loses rank 1's node: its raylet and every process
  freeze        the same cluster; rank 1's node is SIGSTOPped instead (stalwart only)
  outside-kill  the harness (bench/harness.py) SIGKILLs rank 1's process by its PID once step
                25 is in the run's own step log, then times the next completed step, for
                stalwart (warm spare, memory tier), Ray Train and `torchrun --max-restarts`
                alike, on the reference config's own model

Every row is one run on its own Ray (bench/recovery_rows.py), the order of the rows flipping
every round; bench/recovery_report.py takes the medians, judges the targets and draws the
chart. Targets: a kill recovered >= 10x faster than Ray Train; a hang detected within 10 s; a
frozen node noticed within 1 s; zero lost steps with the memory tier; outside-kill: stalwart's
kill -> next step <= one normal step + 0.5 s, Ray Train >= 20x and torchrun >= 10x that.

    python -m bench.recovery [--rounds 1] [--faults kill hang node freeze outside-kill] [--keep]
                             [--out bench/results/recovery.json] [--png bench/results/recovery.png]

The exit code is 0 whether or not the targets are met; 1 only if a run produced no measurement.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.harness import OUTSIDE_KILL
from bench.harness import POLL_S as KILL_POLL_S
from bench.peers.torchrun_recovery import MAX_RESTARTS
from bench.recovery_report import (
    one_line,
    plot,
    print_outside,
    print_table,
    summarise,
    verdicts,
)
from bench.recovery_rows import (
    ELASTIC,
    FAULT_STEP,
    FAULTS,
    HANG_WAIT_S,
    INJECT,
    OUTSIDE_MODEL,
    OUTSIDE_STALWART,
    PERSIST_EVERY,
    RUNNERS,
    SPARE,
    STALWART_OVERRIDES,
    STEPS,
    TARGET_NEXT_STEP_SLACK_S,
    TARGET_OUTSIDE_RATIOS,
    WORKERS,
    run_row,
    stalwart_overrides,
)


def parse_args() -> argparse.Namespace:
    p = common.parser(__doc__, __spec__)
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every measurement this many times; medians are reported")
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS),
                   help="faults to measure (default: all)")
    common.add_config_args(p, sets=False)
    p.add_argument("--out", default=str(common.RESULTS / "recovery.json"),
                   help="JSON result file")
    p.add_argument("--png", default=str(common.RESULTS / "recovery.png"), help="bar chart")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    p.add_argument("--keep", action="store_true", help="keep the temporary run directories")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    args.faults = [f for f in FAULTS if f in args.faults]
    return args


def git_revision() -> dict[str, Any]:
    """The commit the runs used (stalwart is installed in editable mode) and tracked changes."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=common.ROOT, capture_output=True,
                              text=True).stdout.rstrip("\n")

    return {"commit": git("rev-parse", "HEAD").strip() or None,
            "modified": sorted(line[3:] for line in git(
                "status", "--porcelain", "--untracked-files=no").splitlines())}


def run_all(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for fault in args.faults:
            runners = [r for r, _ in RUNNERS[fault]]
            # The order flips every round, so a drift in machine load favours no side.
            order = runners if rnd % 2 == 0 else runners[::-1]
            print(f"round {rnd + 1}/{args.rounds}, {fault}: {' -> '.join(order)}", flush=True)
            for runner in order:
                r = run_row(runner, fault, args, work, rnd)
                results.append(r)
                print(one_line(r), flush=True)
                if r.get("log_tail"):
                    print(f"    last lines of {r['log']}:\n" + "\n".join(
                        "      " + line for line in r["log_tail"].splitlines()), flush=True)
    return results


def ray_health_checks() -> dict[str, Any]:
    from ray._raylet import Config

    return {"health_check_period_ms": Config.health_check_period_ms(),
            "health_check_failure_threshold": Config.health_check_failure_threshold(),
            "health_check_initial_delay_ms": Config.health_check_initial_delay_ms(),
            "health_check_timeout_ms": Config.health_check_timeout_ms()}


def notes(results: list[dict[str, Any]], health: dict[str, Any]) -> list[str]:
    """What a reader of the figures needs to know about how they were taken."""
    period, threshold = health["health_check_period_ms"], health["health_check_failure_threshold"]
    out = [
        "Ray Train runs with commit_checkpoints=True: rank 0 waits until each checkpoint is "
        "registered by the controller, so that Ray Train restores from its newest checkpoint "
        "(the plain loop of its docs loses the step-20 checkpoint to a registration race "
        "when the fault comes before the controller's next 2 s poll).",
        "Ray Train detection_s is its controller's FailurePolicy decision (controller_failure_s); "
        "restart_s is the first train-loop start of a new attempt (run_raytrain's detection_s).",
        f"Ray Train does not detect the hang: its worker health check times out after "
        f"600 s by default and the torch process group after 1800 s; the harness waited "
        f"{HANG_WAIT_S:g} s, then stopped the run.",
        "Node loss: both sides on a local ray.cluster_utils.Cluster (a 0-CPU head, one 1-CPU "
        f"node per worker) with Ray's default node health checks (health_check_period_ms="
        f"{period}, failure_threshold={threshold}); the stalwart cluster also sets "
        "worker_niceness=0. A replacement 1-CPU node is added as soon as the GCS reports the "
        "lost node dead, on both sides.",
        f"{OUTSIDE_KILL}: the harness SIGKILLs rank 1's process by its PID once step "
        f"{FAULT_STEP} is in the system's own step log (read every 50 ms), so the kill lands "
        "a step or two later on every side; the kill time is read just before the signal. "
        "torchrun: its elastic agent's defaults (--monitor-interval 0.1) with --max-restarts 3.",
        "stalwart's fault time is the controller's acknowledgement of the fault (the worker "
        "carries it out right after); Ray Train's is written by the worker just before it.",
        "freeze: stalwart only, on the node-loss cluster. A frozen raylet still accepts "
        f"connections and Ray's node health check gives up on it after about "
        f"{period * threshold / 1000:g} s; stalwart's rule is its node agent, "
        "failure.node_silent_timeout_s late while the other nodes' agents answer.",
    ]
    for r in results:
        if (r["runner"] == "stalwart-elastic" and r["fault"] == "node" and r.get("completed")
                and not any(e["reason"] == "grow" for e in r.get("resized", []))):
            why = ("before the GCS reported the lost node dead (Ray's default node health "
                   "checks), so no replacement node was added"
                   if r.get("replacement_added_s") is None else
                   f"though a replacement node was added {r['replacement_added_s']:.1f} s "
                   "after the fault")
            out.append(
                f"round {r['round'] + 1}, node: stalwart detected the loss by probing the "
                f"raylet, shrank to 1 worker and finished the run "
                f"{common.fmt(r.get('finished_s'), '.1f')} s after the fault on the surviving "
                f"worker, {why}: it did not grow back (the grow path is what "
                "tests/ray/test_cli_node_loss.py covers, on a longer run).")
    return out


def changed_note(start: dict[str, Any], end: dict[str, Any]) -> str | None:
    """Someone committed or edited files while the benchmark ran."""
    if end == start:
        return None
    changed = sorted(set(start["modified"]) ^ set(end["modified"]))
    return ("the checkout changed during the benchmark: " + "; ".join(filter(None, [
        f"commit {start['commit']} -> {end['commit']}" if start["commit"] != end["commit"]
        else "", f"files modified or reverted: {', '.join(changed)}" if changed else ""]))
        + " (runs after the change may have used different code)")


def settings(args: argparse.Namespace, tps: int, health: dict[str, Any]) -> dict[str, Any]:
    return {
        "rounds": args.rounds, "faults": args.faults, "steps": STEPS, "fault_step": FAULT_STEP,
        "persist_every": PERSIST_EVERY, "workers": WORKERS, "tokens_per_step": tps,
        "config": args.config, "stalwart_overrides": STALWART_OVERRIDES, "stalwart_spare": SPARE,
        "stalwart_elastic": ELASTIC, "inject": INJECT, "hang_wait_s": HANG_WAIT_S,
        OUTSIDE_KILL: {"kill_after_step_logged": FAULT_STEP, "poll_s": KILL_POLL_S,
                       "stalwart_overrides": OUTSIDE_STALWART, "model_overrides": OUTSIDE_MODEL,
                       "torchrun": {"max_restarts": MAX_RESTARTS,
                                    "checkpoint_every": PERSIST_EVERY},
                       "targets": {"next_step_slack_s": TARGET_NEXT_STEP_SLACK_S,
                                   "ratios": TARGET_OUTSIDE_RATIOS}},
        "raytrain": {"commit_checkpoints": True, "hang_wait_s": HANG_WAIT_S,
                     "replace_node_after": "dead", "overrides": common.TINY,
                     "checkpoint_every": PERSIST_EVERY},
        "ray_node_health_checks": health}


def main() -> int:
    args = parse_args()
    t_start, revision = time.time(), git_revision()
    tps, _ = common.tokens_per_step(args.config, stalwart_overrides("stalwart"))
    work = Path(tempfile.mkdtemp(prefix="stalwart-recovery-"))
    print(f"recovery: {args.rounds} round(s) x faults {args.faults}, {STEPS} steps, fault on "
          f"rank 1 at step {FAULT_STEP}, checkpoint every {PERSIST_EVERY}, {WORKERS} workers, "
          f"{os.cpu_count()} CPUs; runs in {work}", flush=True)
    results = run_all(args, work)
    med = summarise(results, args.faults)
    print_table(med)
    if OUTSIDE_KILL in med:
        print_outside(med)
    checks = verdicts(results, med)
    print()
    for v in checks:
        print(f"target {v['target']}: {'MET' if v['met'] else 'NOT MET'} "
              f"(value {common.fmt(v['value'], '.2f')}; {v['detail']})")
    health, end_revision = ray_health_checks(), git_revision()
    report_notes = notes(results, health)
    if note := changed_note(revision, end_revision):
        report_notes.append(note)
    print("\nnotes:\n" + "\n".join(f"- {n}" for n in report_notes))
    png = plot(args.png, med)
    if png:
        print(f"wrote {png}")
    # Runs that went wrong (Ray Train not noticing the hang is the measurement, not a failure).
    failed = [r for r in results if r.get("error") or r.get("missing_events") or (
        not r.get("completed") and not (r["system"] == "ray-train" and r["fault"] == "hang"
                                        and not r.get("detected")))]
    import importlib.metadata

    import matplotlib
    import ray
    import torch

    wall = time.time() - t_start
    report = {
        "bench": "recovery", "time": t_start, "wall_s": wall, "targets": checks,
        "all_targets_met": all(v["met"] for v in checks), "medians": med,
        "notes": report_notes, "settings": settings(args, tps, health),
        "git": {"at_start": revision, "at_end": end_revision},
        "versions": {"stalwart": importlib.metadata.version("stalwart"),
                     "torch": torch.__version__, "ray": ray.__version__,
                     "matplotlib": matplotlib.__version__},
        "png": png}
    if not args.keep and not failed:
        shutil.rmtree(work, ignore_errors=True)
        for r in results:
            r.pop("log", None)
            r.pop("run_dir", None)
    elif failed:
        print(f"kept {work}: {len(failed)} run(s) did not complete or missed events")
    common.write_report(args.out, report, results)
    print(f"whole benchmark: {wall / 60:.1f} min")
    return 1 if any(r.get("error") or r.get("fault_time") is None for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
