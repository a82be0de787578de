"""Chaos soak: the reference task with random faults fired from outside, checked after each run."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import chaos_checks as checks
from bench import chaos_faults as cf
from bench import common
from bench.harness import run_watched
from stalwart.core import events as ev
from stalwart.core.events import read_events, read_metrics

SOAK = ["checkpoint.persist_every=10", "checkpoint.keep_last=3", "run.log_every=1",
        "data.val_every=0", "run.progress=false",
        # Recover from every fault of a run; notice a stopped process within seconds; and
        # give up on a world that never starts after a minute, not two.
        "failure.max_failures=100", "failure.hang_timeout_floor_s=4",
        "scaling.start_timeout_s=60"]
LAYOUTS = {
    "ddp2": ["scaling.num_workers=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"],
    "fsdp2": ["scaling.num_workers=2", "parallel.dp_replicate=1", "parallel.dp_shard=2"],
    "hsdp4": ["scaling.num_workers=4", "scaling.cpus_per_worker=0.5", "parallel.dp_replicate=2",
              "parallel.dp_shard=2"],
}


def reference(layout: str, steps: int, cache: Path, timeout: float) -> dict[str, Any]:
    """The layout's failure-free run (cached): its final weights, start-up and training s."""
    ov = [*common.TINY, f"train.steps={steps}", *SOAK, *LAYOUTS[layout]]
    where = cache / f"{layout}-{hashlib.sha256(json.dumps(ov).encode()).hexdigest()[:10]}"
    meta_file = where / "reference.json"
    if meta_file.exists():
        return json.loads(meta_file.read_text())
    where.mkdir(parents=True, exist_ok=True)
    run_dir = where / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    print(f"reference run of {layout} (failure-free, cached in {where})", flush=True)
    t_launch = time.time()
    code, wall = run_watched(common.stalwart_command(str(common.DEFAULT_CONFIG), ov, run_dir),
                             where / "run.log", timeout)
    if code != 0:
        raise SystemExit(f"the reference run of {layout} failed (exit {code}); see "
                         f"{where / 'run.log'}:\n{common.tail(where / 'run.log')}")
    rows = read_metrics(run_dir / "metrics.jsonl")
    first = rows[0].time - (rows[0].window_s or 0.0)
    weights = where / "final.pt"
    if err := checks.export(run_dir, weights):
        raise SystemExit(f"export of the reference run of {layout}: {err}")
    meta = {"layout": layout, "overrides": ov, "weights": str(weights),
            "first_step_s": round(first - t_launch, 2), "train_s": round(rows[-1].time - first, 2),
            "wall_s": round(wall, 1), "final_loss": rows[-1].loss}
    meta_file.write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def soak_run(plan: cf.RunPlan, ref: dict[str, Any], steps: int, work: Path,
             timeout: float) -> dict[str, Any]:
    run_dir, log = work / f"run{plan.index}", work / f"run{plan.index}.log"
    cmd = common.stalwart_command(str(common.DEFAULT_CONFIG), ref["overrides"], run_dir)
    moments = ", ".join(f"{f.kind}@{f.at * ref['train_s']:.1f}s" for f in plan.faults)
    print(f"run {plan.index}: {plan.layout}, faults {moments}", flush=True)
    out: dict[str, Any] = {"run": plan.index, "layout": plan.layout, "run_dir": str(run_dir),
                           "log": str(log)}
    out.update(cf.run_with_faults(plan, cmd, run_dir, log, train_s=ref["train_s"], timeout=timeout))
    out.update(checks.check_finished(run_dir, steps, out["exit_codes"]))
    out.update(checks.check_faults(run_dir, out["faults"]))
    out.update(checks.check_checkpoints(run_dir, work))
    out["bit_identical"], out["weights"] = False, "not exported"
    final = work / f"run{plan.index}.pt"
    if out["finished"] and (err := checks.export(run_dir, final)):
        out["weights"] = f"export failed: {err}"
    elif out["finished"]:
        out["bit_identical"], out["weights"] = checks.weights_equal(Path(ref["weights"]), final)
        final.unlink()
    out["ok"] = (out["finished"] and out["bit_identical"] and out["checkpoints_ok"]
                 and out["detected"] == out["fired"] and not out["timed_out"])
    out["events"] = [e.kind for e in read_events(run_dir / "events.jsonl")
                     if not isinstance(e, ev.CheckpointCommitted)]
    return out


def summary(results: list[dict[str, Any]]) -> dict[str, int]:
    return {"runs": len(results), **{k: sum(r[f] for r in results) for k, f in (
        ("faults_fired", "fired"), ("not_fired", "not_fired"), ("recorded", "detected"),
        ("lost_steps", "lost_steps"))}, "runs_lost": sum(not r["ok"] for r in results)}


def table(results: list[dict[str, Any]]) -> None:
    print(f"\n{'run':>4} {'layout':7} {'faults fired':22} {'not':>4} {'det':>4} {'lost':>5} "
          f"{'recov s':>8} {'bit-identical':>13} {'ckpts ok':>9} {'finished':>9}")
    for r in results:
        kinds = " ".join(f["kind"] for f in r["faults"] if f.get("fired")) or "-"
        print(f"{r['run']:>4} {r['layout']:7} {kinds:22} {r['not_fired']:>4} "
              f"{r['detected']:>2}/{r['fired']:<1} {r['lost_steps']:>5} {r['recovery_s']:>8.1f} "
              f"{'yes' if r['bit_identical'] else 'NO':>13} "
              f"{len(r['checkpoints']) if r['checkpoints_ok'] else 'NO':>9} "
              f"{'yes' if r['finished'] else 'NO':>9}")
    t = summary(results)
    print(f"\n{t['runs']} runs, {t['faults_fired']} faults fired ({t['not_fired']} not fired: "
          f"the run was over), {t['recorded']} recorded, {t['lost_steps']} steps lost; "
          f"runs lost (any check failed): {t['runs_lost']}")
    for r in results:
        if not r["ok"]:
            print(f"  run {r['run']} FAILED: finished={r['finished']} weights={r['weights']} "
                  f"checkpoints={r['checkpoint_problems'] or r['checkpoints']} "
                  f"detected={r['detected']}/{r['fired']} log={r['log']}")


def parse_args() -> argparse.Namespace:
    p = common.parser(__doc__, __spec__)
    p.add_argument("--runs", type=common.positive(), default=10,
                   help="runs in this invocation (default 10)")
    p.add_argument("--seed", type=int, default=None, help="the soak's seed (default: random)")
    p.add_argument("--first-run", type=int, default=0,
                   help="index of the first run of the soak to run (to split it in chunks)")
    p.add_argument("--layouts", nargs="+", default=["ddp2", "fsdp2"], choices=sorted(LAYOUTS))
    p.add_argument("--steps", type=int, default=600, help="train.steps per run (default 600)")
    common.add_run_args(p, 900.0)
    p.add_argument("--cache", default=str(common.RESULTS / "chaos-refs"),
                   help="where the failure-free references are kept between invocations")
    p.add_argument("--out", default=None,
                   help="JSON out (default bench/results/chaos-seedS[-runK].json)")
    args = p.parse_args()
    if args.first_run < 0:
        p.error("--first-run must be >= 0")
    return args


def main() -> int:
    args = parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"chaos soak: seed {seed}, runs {args.first_run}..{args.first_run + args.runs - 1}, "
          f"layouts {' '.join(args.layouts)}, {args.steps} steps", flush=True)
    plans = cf.plan_soak(seed, args.first_run + args.runs, args.layouts)[args.first_run:]
    refs = {layout: reference(layout, args.steps, Path(args.cache), args.timeout)
            for layout in sorted({pl.layout for pl in plans})}
    work = Path(tempfile.mkdtemp(prefix="chaos-"))
    results = []
    try:
        for plan in plans:
            results.append(r := soak_run(plan, refs[plan.layout], args.steps, work, args.timeout))
            print(f"  -> {'ok' if r['ok'] else 'FAILED'}: fired {r['fired']}, recorded "
                  f"{r['detected']}, lost steps {r['lost_steps']}, {r['weights']}", flush=True)
            if r["ok"] and not args.keep:
                shutil.rmtree(r.pop("run_dir"), ignore_errors=True)
                Path(r.pop("log")).unlink(missing_ok=True)
    finally:
        table(results)
        suffix = f"-run{args.first_run}" if args.first_run else ""
        report = {"seed": seed, "first_run": args.first_run, "runs": args.runs,
                  "layouts": args.layouts, "steps": args.steps, "references": refs,
                  "summary": summary(results)}
        common.write_report(args.out or str(common.RESULTS / f"chaos-seed{seed}{suffix}.json"),
                            report, results)
        if all(r["ok"] for r in results) and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"run directories kept in {work}")
    return 0 if results and all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
