"""Recovery: how fast stalwart and Ray Train's TorchTrainer notice and recover from a fault.

The reference task (`examples/gpt/config.toml`) with the tiny model of tests/cli_helpers.py
(seq_len 64, d_model 64, 2 blocks, 2 heads, global batch 8, micro batch 2) on 2 workers,
40 steps, a storage checkpoint every 10 steps, one fault on rank 1 at the start of step 25:

  kill   SIGKILL the worker process
  hang   SIGSTOP the worker process (alive, silent, holding its peer in the all-reduce)
  node   lose a whole node: on a local multi-node cluster (ray.cluster_utils.Cluster: a
         0-CPU head for the driver, one 1-CPU node per worker) the node of rank 1 loses its
         raylet and every process on it at once
  freeze the same cluster; the node of rank 1 freezes instead: its raylet and every process
         on it are SIGSTOPped (`--inject freeze-node:node=2,step=25`); stalwart only
  outside-kill
         the same SIGKILL, sent by this harness to rank 1's process (its PID) once step 25
         is logged, for all three systems alike (see below)

Rows, each measured on its own Ray:

  stalwart          `stalwart run examples/gpt/config.toml --set ... --inject FAULT --run-dir DIR`
                    exactly as a user types it, with the in-memory checkpoint tier (the
                    default: a snapshot every step, replicated to a peer; restored first) and
                    no spare (`scaling.spare_workers=0`): the
                    replacement is a cold actor (own embedded Ray with 2 CPUs); everything is
                    read from DIR/events.jsonl (`fault_injected`, `failure`, `recovered`,
                    `resized`, `finished`) and DIR/metrics.jsonl
  stalwart+spare    the same with one warm spare (`scaling.spare_workers=1`; the embedded Ray
                    adds a logical CPU for it, since it idles); kill, hang
  stalwart+spare, storage only
                    the same with the memory tier off (`checkpoint.snapshot_every=0`): it
                    restores from the storage checkpoint (every 10 steps); kill
  stalwart elastic  node only: `--address <cluster>` `--inject kill-node:node=2,step=25`
                    `scaling.min_workers=1 scaling.resize_check_s=2`: it shrinks to the
                    surviving worker at once; a replacement 1-CPU node is added as soon as the
                    GCS reports the lost node dead (the same policy as the Ray Train side), so
                    that it can grow back; and the same with the memory tier off
  ray-train         bench/peers/raytrain_recovery.py `run_raytrain(fault, commit_checkpoints=True,
                    hang_wait_s=60)`: TorchTrainer, FailureConfig(max_failures=3), a checkpoint
                    every 10 steps which rank 0 waits to see registered (else Ray Train loses
                    the newest one to a registration race and restores an older one)

outside-kill (the issue's side-by-side table; bench/outside_kill.py, recovery_outside.py):

  Every side trains examples/gpt/config.toml's own model and batch (the issue's "reference
  run"; the rows above use the tiny model), 40 steps, a checkpoint every 10.
  stalwart+spare    `stalwart run ... --run-dir DIR` with one warm spare and the memory tier,
                    no --inject: step log DIR/metrics.jsonl (split into worlds at each
                    `workers_started`), rank 1's pid from the newest `workers_started` event
  ray-train         run_raytrain("outside-kill", commit_checkpoints=True): step log
                    steps.jsonl, rank 1's pid from attempts.jsonl
  torchrun          `python -m torch.distributed.run --standalone --nproc_per_node 2
                    --max-restarts 3 -m bench.peers.torchrun_recovery` (rank 0 saves a checkpoint
                    atomically every 10 steps; every restart resumes from the newest): its
                    steps.jsonl, rank 1's pid from its attempts.jsonl

  The harness reads the step log every 50 ms; once step 25 is there it SIGKILLs the pid and
  takes the kill time just before. recovery_s: kill -> the end of the first step completed by
  the restarted world (the killed world's rank 0 may log its step in flight just after the
  kill: that one counts as done before it); lost_steps: the killed world's last step - the step
  resumed from; normal_step_s: the median step time of the same run before the kill. Targets:
  stalwart's recovery_s <= normal_step_s + 0.5 s, Ray Train's >= 20x stalwart's, torchrun's
  >= 10x (medians). About 3 minutes per round on 2 cores.

Both sides use Ray's default node health checks (no `_system_config` for them on either
cluster); Ray Train's own worker health check keeps its default (600 s).

Measured per run (seconds, one machine's time.time()):

  detection_s   fault -> the controller decides it is a failure. stalwart: `failure`
                event's detection_s; Ray Train: its controller's FailurePolicy decision
                (controller_failure_s of run_raytrain); a hang Ray Train does not notice
                within 60 s is "not detected"
  restart_s     fault -> the new world is up (stalwart: the next `workers_started`; Ray
                Train: the first train-loop start of a new attempt, run_raytrain's own
                detection_s, an upper bound of its detection)
  recovery_s    fault -> the first step completed after the fault (stalwart: the
                `recovered` event's recovery_s, cross-checked against metrics.jsonl)
  lost_steps    steps completed before the fault - the step restored from

    python -m bench.recovery [--rounds 1] [--faults kill hang node freeze outside-kill] [--keep]
                             [--out bench/results/recovery.json] [--png bench/results/recovery.png]

Targets (printed with MET / NOT MET): a kill recovered at least 10x faster than Ray Train
(median recovery_s of Ray Train / median of stalwart, for each stalwart row); a hang detected
within 10 s (every round, each stalwart row); zero lost completed steps with the memory tier,
and no more than the steps since the last storage checkpoint due without it (every round,
every stalwart row). The exit code is 0 whether or
not the targets are met; 1 only if a run produced no measurement.

This file is the command line; beside it, recovery_setup.py holds the scenario (faults,
runners, targets), recovery_runs.py runs one row, recovery_measure.py measures it and takes
the medians and targets, recovery_report.py prints the table and draws the chart.
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
from bench.outside_kill import POLL_S as KILL_POLL_S
from bench.peers.raytrain_recovery import TINY
from bench.peers.torchrun_recovery import MAX_RESTARTS
from bench.recovery_measure import summarise, verdicts
from bench.recovery_outside import run_stalwart_outside, run_torchrun_outside
from bench.recovery_report import one_line, plot, print_outside, print_table
from bench.recovery_runs import run_ray_train, run_stalwart
from bench.recovery_setup import (
    ELASTIC,
    FAULT_STEP,
    FAULTS,
    HANG_WAIT_S,
    INJECT,
    OUTSIDE_KILL,
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
    stalwart_overrides,
)

DEFAULT_OUT = common.ROOT / "bench" / "results" / "recovery.json"
DEFAULT_PNG = common.ROOT / "bench" / "results" / "recovery.png"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every measurement this many times; medians are reported")
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS),
                   help="faults to measure (default: all)")
    p.add_argument("--config", default=str(common.DEFAULT_CONFIG), help="stalwart TOML config")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON result file")
    p.add_argument("--png", default=str(DEFAULT_PNG), help="bar chart")
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


def main() -> int:
    args = parse_args()
    t_start = time.time()
    revision = git_revision()
    import ray
    import ray._raylet

    # Tokenize once up front (both sides read the same token files).
    tps, _ = common.tokens_per_step(args.config, stalwart_overrides("stalwart"))
    work = Path(tempfile.mkdtemp(prefix="stalwart-recovery-"))
    print(f"recovery: {args.rounds} round(s) x faults {args.faults}, {STEPS} steps, fault on "
          f"rank 1 at step {FAULT_STEP}, checkpoint every {PERSIST_EVERY}, {WORKERS} workers, "
          f"{os.cpu_count()} CPUs; runs in {work}", flush=True)

    results: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for fault in args.faults:
            runners = [r for r, _ in RUNNERS[fault]]
            # The order flips every round, so a drift in machine load favours no side.
            order = runners if rnd % 2 == 0 else runners[::-1]
            print(f"round {rnd + 1}/{args.rounds}, {fault}: {' -> '.join(order)}", flush=True)
            for runner in order:
                if runner == "ray-train":
                    r = run_ray_train(fault, args, work, rnd)
                elif runner == "torchrun":
                    r = run_torchrun_outside(args, work, rnd)
                elif fault == OUTSIDE_KILL:
                    r = run_stalwart_outside(runner, args, work, rnd)
                else:
                    r = run_stalwart(runner, fault, args, work, rnd)
                results.append(r)
                print(one_line(r), flush=True)
                if r.get("log_tail"):
                    print(f"    last lines of {r['log']}:\n" + "\n".join(
                        "      " + line for line in r["log_tail"].splitlines()), flush=True)

    med = summarise(results, args.faults)
    print_table(med)
    if OUTSIDE_KILL in med:
        print_outside(med)
    checks = verdicts(results, med)
    print()
    for v in checks:
        print(f"target {v['target']}: {'MET' if v['met'] else 'NOT MET'} "
              f"(value {common.fmt(v['value'], '.2f')}; {v['detail']})")
    health_s = (ray._raylet.Config.health_check_period_ms()
                * ray._raylet.Config.health_check_failure_threshold() / 1000)
    notes = [
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
        "node per worker) with Ray's default node health checks (health_check_period_ms="
        f"{ray._raylet.Config.health_check_period_ms()}, failure_threshold="
        f"{ray._raylet.Config.health_check_failure_threshold()}); the stalwart cluster also "
        "sets worker_niceness=0. A replacement 1-CPU node is added as soon as the GCS reports "
        "the lost node dead, on both sides.",
        f"{OUTSIDE_KILL}: the harness SIGKILLs rank 1's process by its PID once step "
        f"{FAULT_STEP} is in the system's own step log (read every 50 ms), so the kill lands "
        "a step or two later on every side; the kill time is read just before the signal. "
        "torchrun: its elastic agent's defaults (--monitor-interval 0.1) with --max-restarts 3.",
        "stalwart's fault time is the controller's acknowledgement of the fault (the worker "
        "carries it out right after); Ray Train's is written by the worker just before it.",
        "freeze: stalwart only, on the node-loss cluster. A frozen raylet still accepts "
        f"connections and Ray's node health check gives up on it after about {health_s:g} s; "
        "stalwart's rule is its node agent, failure.node_silent_timeout_s late while the other "
        "nodes' agents answer.",
    ]
    for r in results:
        if (r["runner"] == "stalwart-elastic" and r["fault"] == "node" and r.get("completed")
                and not any(e["reason"] == "grow" for e in r.get("resized", []))):
            if r.get("replacement_added_s") is None:
                why = ("before the GCS reported the lost node dead (Ray's default node health "
                       "checks), so no replacement node was added")
            else:
                why = (f"though a replacement node was added {r['replacement_added_s']:.1f} s "
                       "after the fault")
            notes.append(
                f"round {r['round'] + 1}, node: stalwart detected the loss by probing the "
                f"raylet, shrank to 1 worker and finished the run "
                f"{common.fmt(r.get('finished_s'), '.1f')} s after the fault on the surviving "
                f"worker, {why}: it did not grow back (the grow path is what "
                "tests/ray/test_cli_node_loss.py covers, on a longer run).")
    end_revision = git_revision()
    if end_revision != revision:  # someone committed or edited files while it ran
        changed = sorted(set(revision["modified"]) ^ set(end_revision["modified"]))
        notes.append(
            "the checkout changed during the benchmark: " + "; ".join(filter(None, [
                f"commit {revision['commit']} -> {end_revision['commit']}"
                if revision["commit"] != end_revision["commit"] else "",
                f"files modified or reverted: {', '.join(changed)}" if changed else ""]))
            + " (runs after the change may have used different code)")
    print("\nnotes:\n" + "\n".join(f"- {n}" for n in notes))

    png = plot(args.png, med)
    if png:
        print(f"wrote {png}")
    # Runs that went wrong (Ray Train not noticing the hang is the measurement, not a failure).
    failed = [r for r in results if r.get("error") or r.get("missing_events") or (
        not r.get("completed") and not (r["system"] == "ray-train" and r["fault"] == "hang"
                                        and not r.get("detected")))]
    wall = time.time() - t_start
    import importlib.metadata

    import matplotlib
    import torch

    report = {
        "bench": "recovery",
        "time": t_start,
        "wall_s": wall,
        "targets": checks,
        "all_targets_met": all(v["met"] for v in checks),
        "medians": med,
        "notes": notes,
        "settings": {
            "rounds": args.rounds, "faults": args.faults, "steps": STEPS,
            "fault_step": FAULT_STEP, "persist_every": PERSIST_EVERY, "workers": WORKERS,
            "tokens_per_step": tps, "config": args.config,
            "stalwart_overrides": STALWART_OVERRIDES, "stalwart_spare": SPARE,
            "stalwart_elastic": ELASTIC, "inject": INJECT, "hang_wait_s": HANG_WAIT_S,
            OUTSIDE_KILL: {"kill_after_step_logged": FAULT_STEP, "poll_s": KILL_POLL_S,
                           "stalwart_overrides": OUTSIDE_STALWART,
                           "model_overrides": OUTSIDE_MODEL,
                           "torchrun": {"max_restarts": MAX_RESTARTS,
                                        "checkpoint_every": PERSIST_EVERY},
                           "targets": {"next_step_slack_s": TARGET_NEXT_STEP_SLACK_S,
                                       "ratios": TARGET_OUTSIDE_RATIOS}},
            "raytrain": {"commit_checkpoints": True, "hang_wait_s": HANG_WAIT_S,
                         "replace_node_after": "dead", "overrides": TINY,
                         "checkpoint_every": PERSIST_EVERY},
            "ray_node_health_checks": {
                "health_check_period_ms": ray._raylet.Config.health_check_period_ms(),
                "health_check_failure_threshold":
                    ray._raylet.Config.health_check_failure_threshold(),
                "health_check_initial_delay_ms":
                    ray._raylet.Config.health_check_initial_delay_ms(),
                "health_check_timeout_ms": ray._raylet.Config.health_check_timeout_ms()},
        },
        "git": {"at_start": revision, "at_end": end_revision},
        "versions": {"stalwart": importlib.metadata.version("stalwart"),
                     "torch": torch.__version__, "ray": ray.__version__,
                     "matplotlib": matplotlib.__version__},
        "png": png,
    }
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
