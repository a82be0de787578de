"""Steps lost when the driver is SIGKILLed on a cluster, over several kills of one run."""

from __future__ import annotations

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
from bench.harness import Launch, last_logged
from stalwart.checkpointing.storage.catalog import list_step_dirs
from stalwart.core.events import read_jsonl
from stalwart.parallel.distributed import free_port

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
    return max((s for s, ok in list_step_dirs(str(run_dir / "checkpoints")) if ok), default=0)


def resumed_events(run_dir: Path) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run_dir / "events.jsonl") if e["kind"] == "resumed"]


def kill_and_resume(drive: Any, run: Path, launch: Launch, k: int,
                    target: int) -> tuple[Launch, dict[str, Any]]:
    """SIGKILL the driver once `target` is logged, wait for the commit, resume."""
    while (last_logged(run / "metrics.jsonl") or 0) < target:
        if not launch.running():
            raise SystemExit(f"the driver ended before step {target}: see {run.parent}")
        time.sleep(0.02)
    before = newest_commit(run)
    launch.proc.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    launch.proc.wait()
    logged = chaos_checks.last_logged_step(run)
    while newest_commit(run) <= before and time.monotonic() - killed_at < 300:
        time.sleep(0.05)
    commit_s = time.monotonic() - killed_at
    launch = drive(run, "--auto-resume")
    while len(resumed_events(run)) <= k:
        if not launch.running():
            raise SystemExit(f"the resumed driver ended early: see {run.parent}")
        time.sleep(0.1)
    resumed = resumed_events(run)[k]["from_step"]
    row = {"kill": k + 1, "last_logged": logged,
           "committed": newest_commit(run) if newest_commit(run) > before else None,
           "resumed": resumed, "lost": max(0, logged - resumed),
           "kept_unlogged": max(0, resumed - logged), "commit_s": round(commit_s, 2)}
    print(f"kill {k + 1}: last logged {logged}, resumed from {resumed}, lost {row['lost']}, "
          f"commit {commit_s:.2f}s after the kill", flush=True)
    return launch, row


def soak(args: Any, scratch: Path, address: str, env: dict[str, str]
         ) -> tuple[list[dict[str, Any]], bool, str]:
    """The failure-free run, then the killed one; (kills, bit-identical, what differs)."""
    rng = random.Random(args.seed)
    sets = [*common.TINY, "run.log_every=1", f"train.steps={args.steps}",
            f"checkpoint.persist_every={args.persist_every}"]
    kills: list[dict[str, Any]] = []

    def drive(run_dir: Path, *extra: str) -> Launch:
        cmd = [*common.stalwart_command(str(common.DEFAULT_CONFIG), sets, run_dir),
               "--address", address, *extra]
        return Launch(cmd, scratch / f"{run_dir.name}-{len(kills)}.log", env=env)

    straight, run = scratch / "straight", scratch / "killed"
    if drive(straight).proc.wait(timeout=1800) != 0:
        raise SystemExit(f"the failure-free run failed: see {scratch}")
    span = (args.steps - 100) // args.kills
    launch = drive(run)
    for k in range(args.kills):
        launch, row = kill_and_resume(drive, run, launch, k,
                                      30 + k * span + rng.randrange(span // 2))
        kills.append(row)
    if (code := launch.proc.wait(timeout=1800)) != 0:
        return kills, False, f"the last driver exited {code}"
    a, b = scratch / "straight.pt", scratch / "killed.pt"
    if problem := chaos_checks.export(straight, a) or chaos_checks.export(run, b):
        return kills, False, problem
    return (kills, *chaos_checks.weights_equal(a, b))


def main() -> None:
    p = common.parser(__doc__, __spec__, "driver_loss.json")
    p.add_argument("--kills", type=int, default=5, help="driver SIGKILLs (default 5)")
    p.add_argument("--steps", type=int, default=600, help="train.steps (default 600)")
    p.add_argument("--persist-every", type=int, default=50,
                   help="checkpoint.persist_every (default 50)")
    p.add_argument("--cpus", type=int, default=3, help="the cluster's CPUs (default 3)")
    p.add_argument("--seed", type=int, default=0, help="picks the kill steps (default 0)")
    args = p.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="stalwart-driver-loss-"))
    ray_proc, address, env = start_cluster(scratch, args.cpus)
    try:
        kills, same, detail = soak(args, scratch, address, env)
    finally:
        ray_proc.send_signal(signal.SIGTERM)  # `ray start --block` stops its daemons
        ray_proc.wait(timeout=120)
    lost = [k["lost"] for k in kills]
    print(f"\n{'kill':>4} {'logged':>7} {'resumed':>8} {'lost':>5} {'commit_s':>9}")
    for k in kills:
        print(f"{k['kill']:>4} {k['last_logged']:>7} {k['resumed']:>8} {k['lost']:>5} "
              f"{k['commit_s']:>9.2f}")
    print(f"steps lost over {len(kills)} kills: {sum(lost)} (max {max(lost, default=0)}); "
          f"final weights bit-identical to a failure-free run: {same} ({detail})")
    common.write_json(args.out, {
        "kills": kills, "lost_total": sum(lost), "lost_max": max(lost, default=0),
        "commit_s_median": sorted(k["commit_s"] for k in kills)[len(kills) // 2],
        "bit_identical": same, "weights": detail, "steps": args.steps,
        "persist_every": args.persist_every, "host": os.uname().nodename,
        "scratch": str(scratch)})


if __name__ == "__main__":
    main()
