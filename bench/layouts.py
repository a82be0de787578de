"""Layouts: tokens/s of each parallel layout of the reference task on 4 CPU workers.

Every layout is one `stalwart run examples/gpt/config.toml --set ...`, exactly as a user
types it (own embedded Ray), with the same overrides:

  scaling.num_workers=4 scaling.cpus_per_worker=0.5   4 workers share the machine's cores
  task.args.n_layers=8 task.args.tie_embeddings=false one model for every row: pp4 interleaved
                                                      needs 8 blocks (2 stages per rank) and
                                                      pipeline layouts need untied embeddings
  train.steps, train.warmup_steps=2, run.log_every, data.val_every=0 (no validation in the
  window), checkpoint.persist_every=steps+1 (only the final checkpoint, after the last row)

and the reference batch (global 32, micro 8), which every layout splits: with d data-parallel
ranks a step has 32 / (8 d) accumulation micro-batches, which is also the pipeline's count
(ddp4, fsdp4, hsdp2x2: d 4, 1; tp2 x fsdp2 and pp2 x fsdp2: d 2, 2 >= pp 2; tp2 x pp2 and
pp4: d 1, 4 >= pp). Every layout trains the same model on the same samples, so the final
losses agree up to the rounding of differently ordered reductions.

The rate is steady-state tokens/s: tokens of steps exclude+1..steps over the wall time
between those metrics.jsonl rows; Ray and worker start-up are outside the window.

    python -m bench.layouts [--rounds 1] [--steps 30] [--layouts ddp4 fsdp4 ...]
                            [--out bench/results/layouts.json]

A run that fails is recorded (exit code, the tail of its log) and the others go on. The exit
code is 0 if at least one layout was measured, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common

DEFAULT_OUT = common.ROOT / "bench" / "results" / "layouts.json"
WORKERS = 4
BASELINE = "ddp4"

# name -> the layout's --set overrides (on top of common_overrides).
LAYOUTS: dict[str, list[str]] = {
    "ddp4": ["parallel.dp_replicate=4", "parallel.dp_shard=1"],
    "fsdp4": ["parallel.dp_replicate=1", "parallel.dp_shard=4"],
    "fsdp4-zero2": ["parallel.dp_replicate=1", "parallel.dp_shard=4",
                    "parallel.reshard_after_forward=false"],
    "hsdp2x2": ["parallel.dp_replicate=2", "parallel.dp_shard=2"],
    "tp2-fsdp2": ["parallel.dp_replicate=1", "parallel.dp_shard=2", "parallel.tp=2"],
    "pp2-fsdp2": ["parallel.dp_replicate=1", "parallel.dp_shard=2", "parallel.pp=2"],
    "tp2-pp2": ["parallel.dp_replicate=1", "parallel.dp_shard=1", "parallel.tp=2",
                "parallel.pp=2"],
    "pp4-interleaved": ["parallel.dp_replicate=1", "parallel.dp_shard=1", "parallel.pp=4",
                        "parallel.pp_schedule=interleaved_1f1b"],
}
DESCRIPTIONS = {
    "ddp4": "DDP",
    "fsdp4": "FSDP2 ZeRO-3",
    "fsdp4-zero2": "FSDP2 ZeRO-2",
    "hsdp2x2": "HSDP",
    "tp2-fsdp2": "TP x FSDP2",
    "pp2-fsdp2": "PP 1f1b x FSDP2",
    "tp2-pp2": "TP x PP 1f1b",
    "pp4-interleaved": "PP interleaved 1f1b",
}
MODEL = ["task.args.n_layers=8", "task.args.tie_embeddings=false"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_window_args(p, rounds=1, rounds_of="layouts", steps=30)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS),
                   metavar="NAME", help=f"layouts to run (default all: {' '.join(LAYOUTS)})")
    p.add_argument("--config", default=str(common.DEFAULT_CONFIG), help="stalwart TOML config")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON result file")
    args = common.parse_bench_args(p)
    args.layouts = list(dict.fromkeys(args.layouts))  # drop repeats, keep the order given
    return args


def common_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"scaling.num_workers={WORKERS}",
        "scaling.cpus_per_worker=0.5",
        *MODEL,
        f"train.steps={args.steps}",
        "train.warmup_steps=2",
        f"run.log_every={args.log_every}",
        "data.val_every=0",                               # no validation pass in the window
        f"checkpoint.persist_every={args.steps + 1}",     # only the final, after the last row
    ]


def dims(layout: list[str]) -> str:
    """dp_replicate x dp_shard x tp x pp of a layout's overrides."""
    d = {"dp_replicate": "1", "dp_shard": "1", "tp": "1", "pp": "1"}
    for o in layout:
        key, _, value = o.partition("=")
        if key.startswith("parallel.") and key[len("parallel."):] in d:
            d[key[len("parallel."):]] = value
    return "x".join(d.values())


def one_run(name: str, args: argparse.Namespace, work: Path, rnd: int,
            tps: int) -> dict[str, Any]:
    tag = f"r{rnd}-{name}"
    log, run_dir = work / f"{tag}.log", work / tag
    load = os.getloadavg()[0]
    cmd = common.stalwart_command(args.config, common_overrides(args) + LAYOUTS[name], run_dir)
    code, wall = common.run_logged(cmd, log, args.timeout)
    result: dict[str, Any] = {"layout": name, "dims": dims(LAYOUTS[name]), "round": rnd,
                              "overrides": LAYOUTS[name], "exit_code": code, "wall_s": wall,
                              "load_before": load, "log": str(log), "run_dir": str(run_dir)}
    if code == 0:
        try:
            result.update(common.stalwart_rate(run_dir, args.exclude, tps, final=True))
            if result["last_step"] != args.steps:
                result["warning"] = f"last metrics row at step {result['last_step']}"
        except (OSError, ValueError, KeyError, IndexError) as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
    if "tokens_per_s" not in result:
        result.setdefault("error", f"exit code {code}")
        result["log_tail"] = common.tail(log)
        print(f"  {tag}: FAILED ({result['error']}, {wall:.1f}s); last lines of {log}:\n"
              + "\n".join("    " + line for line in result["log_tail"].splitlines()), flush=True)
    else:
        print(f"  {tag}: {result['tokens_per_s']:9,.0f} tokens/s  (window "
              f"{result['window_s']:.1f}s, whole run {wall:.1f}s, load {load:.2f}, "
              f"final loss {result['final_loss']:.4f})", flush=True)
    return result


def main() -> int:
    args = parse_args()
    tps, config = common.tokens_per_step(args.config, common_overrides(args))
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-layouts-"))
    print(f"layouts: {args.rounds} round(s) x {args.layouts}, {args.steps} steps each "
          f"(first {args.exclude} excluded), {tps} tokens/step, {WORKERS} workers x 0.5 CPU, "
          f"{os.cpu_count()} CPUs; logs in {work}", flush=True)
    print(f"one model for every layout: {' '.join(MODEL)} (global batch "
          f"{config.train.global_batch_size}, micro-batch {config.train.micro_batch_size})",
          flush=True)

    results = common.run_rounds(args.layouts, args.rounds,
                         lambda name, rnd: one_run(name, args, work, rnd, tps),
                         work=work, keep=args.keep, prune_measured=True)

    # Per layout: the median over rounds of the rate and the wall time; the losses of round 0
    # (every round trains the same model on the same samples).
    summary: dict[str, dict[str, Any]] = {}
    for name in args.layouts:
        runs = [r for r in results if r["layout"] == name]
        ok = [r for r in runs if "tokens_per_s" in r]
        summary[name] = {
            "dims": dims(LAYOUTS[name]),
            "description": DESCRIPTIONS[name],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok) if ok else None,
            "wall_s": statistics.median(r["wall_s"] for r in runs) if runs else None,
            "final_loss": ok[0]["final_loss"] if ok else None,
            "loss_by_step": ok[0]["loss_by_step"] if ok else None,
            "measured_rounds": len(ok),
            "failed_rounds": len(runs) - len(ok),
            "errors": [r["error"] for r in runs if "error" in r],
        }
    base = summary.get(BASELINE, {}).get("tokens_per_s")
    base_losses = summary.get(BASELINE, {}).get("loss_by_step")
    for s in summary.values():
        s["relative_to_ddp4"] = s["tokens_per_s"] / base if s["tokens_per_s"] and base else None
        s["loss_max_abs_diff_vs_ddp4"] = (
            common.max_loss_diff(s["loss_by_step"], base_losses)
            if s["loss_by_step"] and base_losses else None)

    # Table.
    agg = "median of rounds" if args.rounds > 1 else "one round"
    head = (f"{'layout':<16} | {'kind':<19} | {'dims r x s x tp x pp':>20} | {'tokens/s':>9} | "
            f"{'vs ddp4':>7} | {'final loss':>10} | {'max |dloss|':>11} | {'wall s':>6}")
    print(f"\ntokens/s (steady state, steps {args.exclude + 1}..{args.steps}, {agg}); model "
          f"{' '.join(MODEL)} for every row\n" + head + "\n" + "-" * len(head))
    for name, s in summary.items():
        print(f"{name:<16} | {s['description']:<19} | {s['dims']:>20} | "
              f"{common.fmt(s['tokens_per_s'], '9,.0f')} | "
              f"{common.fmt(s['relative_to_ddp4'], '7.3f')} | "
              f"{common.fmt(s['final_loss'], '10.4f')} | "
              f"{common.fmt(s['loss_max_abs_diff_vs_ddp4'], '11.2e')} | "
              f"{common.fmt(s['wall_s'], '6.1f')}" + ("  FAILED" if s["failed_rounds"] else ""))
    print("(max |dloss|: the largest loss difference to ddp4 over the logged steps; wall s: "
          "the whole `stalwart run`, Ray start-up and final checkpoint included)")
    failed = [r for r in results if "tokens_per_s" not in r]
    if failed:
        print("\nfailed runs:")
        for r in failed:
            print(f"  round {r['round'] + 1} {r['layout']}: {r['error']}"
                  + (f" (log {r['log']})" if "log" in r else ""))

    report = {
        "bench": "layouts",
        "time": time.time(),
        "baseline": BASELINE,
        "summary": {k: {kk: vv for kk, vv in v.items() if kk != "loss_by_step"}
                    for k, v in summary.items()},
        "loss_by_step": {k: v["loss_by_step"] for k, v in summary.items()},
        "settings": {
            **common.window_settings(args, WORKERS, tps, common_overrides(args)),
            "layouts": {k: LAYOUTS[k] for k in args.layouts},
            "global_batch_size": config.train.global_batch_size,
            "micro_batch_size": config.train.micro_batch_size,
        },
    }
    common.write_report(args.out, report, results)
    return 0 if any("tokens_per_s" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
