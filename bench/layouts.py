"""Layouts: tokens/s of each parallel layout of the reference task on 4 CPU workers (and of
the MoE example's, expert parallelism among them, against its own FSDP2 row)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import fmt

WORKERS = 4
BASELINE = "ddp4"
# name -> (what it is, dp_replicate x dp_shard x cp x tp x pp, further overrides).
DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
LAYOUTS: dict[str, tuple[str, str, list[str]]] = {
    "ddp4": ("DDP", "4x1x1x1x1", []),
    "fsdp4": ("FSDP2 ZeRO-3", "1x4x1x1x1", []),
    "fsdp4-zero2": ("FSDP2 ZeRO-2", "1x4x1x1x1", ["parallel.reshard_after_forward=false"]),
    "hsdp2x2": ("HSDP", "2x2x1x1x1", []),
    "tp2-fsdp2": ("TP x FSDP2", "1x2x1x2x1", []),
    "pp2-fsdp2": ("PP 1f1b x FSDP2", "1x2x1x1x2", []),
    "tp2-pp2": ("TP x PP 1f1b", "1x1x1x2x2", []),
    "pp4-interleaved": ("PP interleaved 1f1b", "1x1x1x1x4",
                        ["parallel.pp_schedule=interleaved_1f1b"]),
    "cp2-fsdp2": ("CP x FSDP2", "1x2x2x1x1", []),
    "cp4": ("CP", "1x1x4x1x1", []),
    "tp2-cp2": ("TP x CP", "1x1x2x2x1", []),
    "moe-fsdp4": ("MoE FSDP2", "1x4x1x1x1", []),
    "moe-ep2-fsdp4": ("MoE EP x FSDP2", "1x4x1x1x1", ["parallel.ep=2"]),
    "moe-ep4": ("MoE EP", "1x4x1x1x1", ["parallel.ep=4"]),
}
# The MoE rows train the MoE example (examples/moe/config.toml, the same shape overrides):
# they are compared with its FSDP2 row, the others with DDP on the reference GPT.
MOE_BASELINE = "moe-fsdp4"
MOE_CONFIG = str(Path(__file__).resolve().parents[1] / "examples" / "moe" / "config.toml")
MODEL = ["task.args.n_layers=8", "task.args.tie_embeddings=false"]


def parse_args() -> argparse.Namespace:
    p = common.window_parser(__doc__, __spec__, "layouts.json", rounds=1, steps=30)
    p.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS),
                   metavar="NAME", help=f"layouts to run (default all: {' '.join(LAYOUTS)})")
    args = common.parse_window(p)
    args.layouts = list(dict.fromkeys(args.layouts))  # drop repeats, keep the order given
    return args


def layout_overrides(name: str) -> list[str]:
    """A layout's --set overrides: both data-parallel degrees, cp, tp and pp when above 1."""
    _, dims, extra = LAYOUTS[name]
    degrees = zip(DEGREES, dims.split("x"), strict=True)
    return [f"parallel.{k}={v}" for k, v in degrees if k.startswith("dp") or v != "1"] + extra


def one_run(name: str, rnd: int, *, args: argparse.Namespace, work: Path, tps: int,
            overrides: list[str]) -> dict[str, Any]:
    tag, layout = f"r{rnd}-{name}", layout_overrides(name)
    run_dir = work / tag

    def measure() -> dict[str, Any]:
        out = common.stalwart_rate(run_dir, args.exclude, tps, final=True)
        if out["last_step"] != args.steps:
            out["warning"] = f"last metrics row at step {out['last_step']}"
        return out

    result = common.rate_run(
        tag, common.stalwart_command(MOE_CONFIG if name.startswith("moe-") else args.config,
                                     overrides + layout, run_dir),
        args, work, {"layout": name, "dims": LAYOUTS[name][1], "round": rnd,
                     "overrides": layout, "run_dir": str(run_dir)}, measure,
        lambda r: f", final loss {r['final_loss']:.4f}")
    if "error" in result:
        result["log_tail"] = common.tail(work / f"{tag}.log")
    return result


def summarise(results: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per layout: medians of rate and wall time; the first measured round's losses."""
    summary: dict[str, dict[str, Any]] = {}
    for name in names:
        runs = [r for r in results if r["layout"] == name]
        ok = [r for r in runs if "tokens_per_s" in r]
        summary[name] = {
            "dims": LAYOUTS[name][1], "description": LAYOUTS[name][0],
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok) if ok else None,
            "wall_s": statistics.median(r["wall_s"] for r in runs) if runs else None,
            "final_loss": ok[0]["final_loss"] if ok else None,
            "loss_by_step": ok[0]["loss_by_step"] if ok else None,
            "measured_rounds": len(ok), "failed_rounds": len(runs) - len(ok),
            "errors": [r["error"] for r in runs if "error" in r]}
    for name, s in summary.items():
        baseline = summary.get(MOE_BASELINE if name.startswith("moe-") else BASELINE, {})
        base, base_losses = baseline.get("tokens_per_s"), baseline.get("loss_by_step")
        s["relative_to_baseline"] = (s["tokens_per_s"] / base if s["tokens_per_s"] and base
                                     else None)
        s["loss_max_abs_diff_vs_baseline"] = (
            common.max_loss_diff(s["loss_by_step"], base_losses)
            if s["loss_by_step"] and base_losses else None)
    return summary


def print_table(summary: dict[str, dict[str, Any]], results: list[dict[str, Any]],
                args: argparse.Namespace) -> None:
    agg = "median of rounds" if args.rounds > 1 else "one round"
    head = (f"{'layout':<16} | {'kind':<19} | {'r x s x cp x tp x pp':>20} | {'tokens/s':>9} | "
            f"{'vs base':>7} | {'final loss':>10} | {'max |dloss|':>11} | {'wall s':>6}")
    print(f"\ntokens/s (steady state, steps {args.exclude + 1}..{args.steps}, {agg}); model "
          f"{' '.join(MODEL)} for every row\n" + head + "\n" + "-" * len(head))
    for name, s in summary.items():
        print(f"{name:<16} | {s['description']:<19} | {s['dims']:>20} | "
              f"{fmt(s['tokens_per_s'], '9,.0f')} | {fmt(s['relative_to_baseline'], '7.3f')} | "
              f"{fmt(s['final_loss'], '10.4f')} | "
              f"{fmt(s['loss_max_abs_diff_vs_baseline'], '11.2e')}"
              f" | {fmt(s['wall_s'], '6.1f')}" + ("  FAILED" if s["failed_rounds"] else ""))
    print(f"(base: {BASELINE}, and {MOE_BASELINE} for the MoE rows; max |dloss|: the largest "
          f"loss difference to the base over the logged steps; wall s: the whole `stalwart run`, "
          f"Ray start-up and final checkpoint included)")
    if failed := [r for r in results if "tokens_per_s" not in r]:
        print("\nfailed runs:")
        for r in failed:
            print(f"  round {r['round'] + 1} {r['layout']}: {r['error']}"
                  + (f" (log {r['log']})" if "log" in r else ""))


def main() -> int:
    args = parse_args()
    every_run = [*common.window_overrides(args, WORKERS), "scaling.cpus_per_worker=0.5", *MODEL,
                 "train.warmup_steps=2"]
    results, settings = common.window_rounds("layouts", args, args.layouts, WORKERS, every_run,
                                             one_run)
    summary = summarise(results, args.layouts)
    print_table(summary, results, args)
    common.write_report(args.out, {
        "bench": "layouts", "time": time.time(), "baseline": BASELINE,
        "summary": {k: {kk: vv for kk, vv in v.items() if kk != "loss_by_step"}
                    for k, v in summary.items()},
        "loss_by_step": {k: v["loss_by_step"] for k, v in summary.items()},
        "settings": {**settings, "layouts": {k: layout_overrides(k) for k in args.layouts}}},
        results)
    return 0 if any("tokens_per_s" in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
