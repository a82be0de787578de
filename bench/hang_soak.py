"""Hang detection's false positives: the reference run, no fault, for a long time."""

from __future__ import annotations

import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench import common
from bench.harness import Launch, local_cluster
from stalwart.core.events import read_jsonl


def soak(minutes: float, overrides: list[str], run_dir: Path, nodes: int) -> dict:
    """The run; with `nodes`, spread over a local cluster of 1-CPU nodes and a 0-CPU head."""
    sets = ["train.steps=1000000", "failure.max_failures=-1", "run.log_every=1",
            "failure.hang_timeout_floor_s=2", "failure.hang_factor=5", *overrides]
    if nodes:
        sets[:0] = [f"scaling.num_workers={nodes}", "scaling.spare_workers=0",
                    "scaling.placement_strategy=SPREAD"]
    cmd = common.stalwart_command(str(common.DEFAULT_CONFIG), sets, run_dir)
    log = run_dir.parent / "soak.log"
    cluster = local_cluster(nodes, num_cpus=0) if nodes else None
    try:
        run = Launch([*cmd, "--address", cluster.address] if cluster else cmd, log,
                     cwd=run_dir.parent)
        try:
            code = run.proc.wait(timeout=minutes * 60)
        except subprocess.TimeoutExpired:  # time is up: a stop, as a preemption notice asks
            code = run.stop(signal.SIGTERM, timeout=300)
    finally:
        if cluster:
            cluster.shutdown()
    events = read_jsonl(run_dir / "events.jsonl")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    times = [r["window_s"] / r["steps_in_window"] for r in rows if r.get("steps_in_window")]
    median = statistics.median(times) if times else None
    failures = [{k: e.get(k) for k in ("failure_kind", "ranks", "step", "message")}
                for e in events if e["kind"] == "failure"]
    return {"minutes": minutes, "exit_code": code, "steps": rows[-1]["step"] if rows else 0,
            "median_step_s": median, "max_step_s": max(times) if times else None,
            "limit_s": max(2.0, 5 * median) if median else None, "false_positives": len(failures),
            "failures": failures, "ended": events[-1]["kind"] if events else None, "log": str(log),
            **({"nodes": nodes} if nodes else {})}


def main() -> None:
    p = common.parser(__doc__, __spec__, "hang_soak.json")
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--nodes", type=int, default=0,
                   help="spread the run over a local cluster of this many 1-CPU nodes")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="stalwart-soak-")) / "soak"
    t0 = time.time()
    result = soak(args.minutes, args.overrides, run_dir, args.nodes)
    result["wall_s"] = round(time.time() - t0, 1)
    # Stopped before its first step: no step times.
    steps = ("no step timed" if result["median_step_s"] is None
             else f"median step {result['median_step_s']:.3f} s, slowest "
             f"{result['max_step_s']:.3f} s; hang limit {result['limit_s']:.2f} s")
    print(f"{result['steps']} steps in {result['wall_s']:.0f} s; {steps}; ended: "
          f"{result['ended']} (exit {result['exit_code']})")
    for f in result["failures"]:
        print(f"  false positive at step {f['step']}: {f['failure_kind']} {f['message']}")
    met = result["false_positives"] == 0 and result["ended"] == "stopped"
    print(f"false positives: {result['false_positives']}  target 0: {'MET' if met else 'NOT MET'}")
    common.write_json(args.out, result)


if __name__ == "__main__":
    main()
