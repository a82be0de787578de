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
from bench import recovery_report as report
from bench import recovery_rows as rows
from bench.harness import OUTSIDE_KILL


def parse_args() -> argparse.Namespace:
    p = common.parser(__doc__, __spec__)
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every measurement this many times; medians are reported")
    p.add_argument("--faults", nargs="+", choices=rows.FAULTS, default=list(rows.FAULTS),
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
    args.faults = [f for f in rows.FAULTS if f in args.faults]
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
            runners = [r for r, _ in rows.RUNNERS[fault]]
            # The order flips every round, so a drift in machine load favours no side.
            order = runners if rnd % 2 == 0 else runners[::-1]
            print(f"round {rnd + 1}/{args.rounds}, {fault}: {' -> '.join(order)}", flush=True)
            for runner in order:
                r = rows.run_row(runner, fault, args, work, rnd)
                results.append(r)
                print(report.one_line(r), flush=True)
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


def changed_note(start: dict[str, Any], end: dict[str, Any]) -> str | None:
    """Someone committed or edited files while the benchmark ran."""
    if end == start:
        return None
    changed = sorted(set(start["modified"]) ^ set(end["modified"]))
    return ("the checkout changed during the benchmark: " + "; ".join(filter(None, [
        f"commit {start['commit']} -> {end['commit']}" if start["commit"] != end["commit"]
        else "", f"files modified or reverted: {', '.join(changed)}" if changed else ""]))
        + " (runs after the change may have used different code)")


def main() -> int:
    args = parse_args()
    t_start, revision = time.time(), git_revision()
    tps, _ = common.tokens_per_step(args.config, rows.stalwart_overrides("stalwart"))
    work = Path(tempfile.mkdtemp(prefix="stalwart-recovery-"))
    print(f"recovery: {args.rounds} round(s) x faults {args.faults}, {rows.STEPS} steps, fault "
          f"on rank 1 at step {rows.FAULT_STEP}, checkpoint every {rows.PERSIST_EVERY}, "
          f"{rows.WORKERS} workers, {os.cpu_count()} CPUs; runs in {work}", flush=True)
    results = run_all(args, work)
    med = report.summarise(results, args.faults)
    report.print_table(med)
    if OUTSIDE_KILL in med:
        report.print_outside(med)
    checks = report.verdicts(results, med)
    print()
    for v in checks:
        print(f"target {v['target']}: {'MET' if v['met'] else 'NOT MET'} "
              f"(value {common.fmt(v['value'], '.2f')}; {v['detail']})")
    health, end_revision = ray_health_checks(), git_revision()
    report_notes = report.notes(results, health)
    if note := changed_note(revision, end_revision):
        report_notes.append(note)
    print("\nnotes:\n" + "\n".join(f"- {n}" for n in report_notes))
    png = report.plot(args.png, med)
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
    out = {
        "bench": "recovery", "time": t_start, "wall_s": wall, "targets": checks,
        "all_targets_met": all(v["met"] for v in checks), "medians": med,
        "notes": report_notes, "settings": rows.settings(args, tps, health),
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
    common.write_report(args.out, out, results)
    print(f"whole benchmark: {wall / 60:.1f} min")
    return 1 if any(r.get("error") or r.get("fault_time") is None for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
