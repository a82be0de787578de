"""Steps lost when the driver is SIGKILLed on a cluster, over several kills of one run.

On a `ray start` cluster of this machine, one run is driven by `stalwart run --address`
as a user types it; its driver is SIGKILLed `--kills` times at random steps, each time
followed by `stalwart run ... --auto-resume`, and the last driver runs to the end. Its
workers (detached) must commit the step in flight when their driver dies. Per kill:

- last logged: the newest step in metrics.jsonl (run.log_every=1) or a commit event;
- resumed: the step the next driver resumed from (its `resumed` event);
- lost: steps logged before the kill that the next driver trains again (the issue's
  figure; 0 when the workers' commit is at or past the last logged step);
- commit_s: seconds from the kill to that commit on storage.

Then the final weights are compared bit for bit with a failure-free run on the same
cluster. Prints a table; writes bench/results/driver_loss.json.

    python -m bench.driver_loss [--kills 5] [--steps 600]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import chaos_checks, common
from stalwart.checkpointing.storage.catalog import list_step_dirs
from stalwart.core.events import read_jsonl
from stalwart.parallel.distributed import free_port

TINY = ["task.args.seq_len=64", "task.args.d_model=64", "task.args.n_layers=2",
        "task.args.n_heads=2", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.warmup_steps=5", "data.val_batches=1", "run.log_every=1"]
RAY = str(Path(sys.executable).with_name("ray"))


def start_cluster(scratch: Path, cpus: int) -> tuple[subprocess.Popen, str, dict[str, str]]:
    """`ray start --head --block` on a free port; stopped later through its own PID."""
    port = free_port()
    env = {**common.child_env(), "RAY_AUTH_MODE": "token"}
    log = scratch / "ray-start.log"
    proc = subprocess.Popen([RAY, "start", "--head", f"--port={port}", f"--num-cpus={cpus}",
                             "--include-dashboard=false", "--disable-usage-stats", "--block"],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 120
    while "block forever" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"ray start failed:\n{log.read_text()}")
        time.sleep(0.5)
    return proc, f"127.0.0.1:{port}", env


def newest_commit(run_dir: Path) -> int:
    done = [s for s, ok in list_step_dirs(str(run_dir / "checkpoints")) if ok]
    return max(done, default=0)


def last_step(run_dir: Path) -> int:
    metrics = run_dir / "metrics.jsonl"
    rows = read_jsonl(metrics) if metrics.exists() else []
    return rows[-1]["step"] if rows else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=5, help="driver SIGKILLs (default 5)")
    p.add_argument("--steps", type=int, default=600, help="train.steps (default 600)")
    p.add_argument("--persist-every", type=int, default=50,
                   help="checkpoint.persist_every (default 50)")
    p.add_argument("--cpus", type=int, default=3, help="the cluster's CPUs (default 3)")
    p.add_argument("--seed", type=int, default=0, help="picks the kill steps (default 0)")
    p.add_argument("--out", type=Path, default=common.ROOT / "bench" / "results" /
                   "driver_loss.json")
    args = p.parse_args()
    rng = random.Random(args.seed)
    sets = [*TINY, f"train.steps={args.steps}", f"checkpoint.persist_every={args.persist_every}"]
    config = str(common.DEFAULT_CONFIG)
    scratch = Path(tempfile.mkdtemp(prefix="stalwart-driver-loss-"))
    ray_proc, address, env = start_cluster(scratch, args.cpus)
    kills: list[dict[str, Any]] = []
    try:
        def driver(run_dir: Path, *extra: str) -> subprocess.Popen:
            cmd = [*common.stalwart_command(config, sets, run_dir), "--address", address, *extra]
            log = (scratch / f"{run_dir.name}-{len(kills)}.log").open("w")
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=common.ROOT)

        straight = scratch / "straight"
        if driver(straight).wait(timeout=1800) != 0:
            raise SystemExit(f"the failure-free run failed: see {scratch}")
        run = scratch / "killed"
        span = (args.steps - 100) // args.kills
        proc = driver(run)
        for k in range(args.kills):
            target = 30 + k * span + rng.randrange(span // 2)
            while last_step(run) < target:
                if proc.poll() is not None:
                    raise SystemExit(f"the driver ended before step {target}: see {scratch}")
                time.sleep(0.02)
            before = newest_commit(run)
            proc.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            proc.wait()
            logged = chaos_checks.last_logged_step(run)
            while newest_commit(run) <= before and time.monotonic() - killed_at < 300:
                time.sleep(0.05)
            commit_s = time.monotonic() - killed_at
            proc = driver(run, "--auto-resume")
            while not [e for e in read_jsonl(run / "events.jsonl")
                       if e["kind"] == "resumed"][k:]:
                if proc.poll() is not None:
                    raise SystemExit(f"the resumed driver ended early: see {scratch}")
                time.sleep(0.1)
            resumed = [e for e in read_jsonl(run / "events.jsonl") if e["kind"] == "resumed"][k]
            kills.append({"kill": k + 1, "last_logged": logged,
                          "committed": newest_commit(run) if newest_commit(run) > before
                          else None,
                          "resumed": resumed["from_step"],
                          "lost": max(0, logged - resumed["from_step"]),
                          "kept_unlogged": max(0, resumed["from_step"] - logged),
                          "commit_s": round(commit_s, 2)})
            print(f"kill {k + 1}: last logged {logged}, resumed from {resumed['from_step']}, "
                  f"lost {kills[-1]['lost']}, commit {commit_s:.2f}s after the kill",
                  flush=True)
        code = proc.wait(timeout=1800)
        same, detail = False, f"the last driver exited {code}"
        if code == 0:
            a, b = scratch / "straight.pt", scratch / "killed.pt"
            problem = chaos_checks.export(straight, a) or chaos_checks.export(run, b)
            same, detail = (False, problem) if problem else chaos_checks.weights_equal(a, b)
    finally:
        ray_proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its daemons
        ray_proc.wait(timeout=120)

    lost = [k["lost"] for k in kills]
    result = {"kills": kills, "lost_total": sum(lost), "lost_max": max(lost, default=0),
              "commit_s_median": sorted(k["commit_s"] for k in kills)[len(kills) // 2],
              "bit_identical": same, "weights": detail, "steps": args.steps,
              "persist_every": args.persist_every, "host": os.uname().nodename,
              "scratch": str(scratch)}
    print(f"\n{'kill':>4} {'logged':>7} {'resumed':>8} {'lost':>5} {'commit_s':>9}")
    for k in kills:
        print(f"{k['kill']:>4} {k['last_logged']:>7} {k['resumed']:>8} {k['lost']:>5} "
              f"{k['commit_s']:>9.2f}")
    print(f"steps lost over {len(kills)} kills: {sum(lost)} (max {max(lost, default=0)}); "
          f"final weights bit-identical to a failure-free run: {same} ({detail})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
