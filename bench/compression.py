"""Gradient compression: bytes each rank reduces per step, tokens/s and the loss after N steps,
with each `parallel.grad_compression` against none, on the reference run (2 workers, DDP)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import fmt
from stalwart.core.events import read_jsonl

WORKERS = 2
BASELINE = "none"
# The goal: the loss after the run within 1% of the uncompressed run's. One step's loss is
# one batch's (it moves by several percent from step to step): the loss after the run is the
# mean over its last LOSS_TAIL steps' logged rows, the same batches in every run.
TARGET_LOSS_REL = 0.01
LOSS_TAIL = 40
KINDS: dict[str, list[str]] = {
    "none": [],
    "bf16": ["parallel.grad_compression=bf16"],
    "fp16": ["parallel.grad_compression=fp16"],
    "powersgd": ["parallel.grad_compression=powersgd"],
}
DDP = ["parallel.dp_replicate=-1", "parallel.dp_shard=1"]


def parse_args() -> Any:
    p = common.window_parser(__doc__, __spec__, "compression.json", rounds=1, steps=200,
                             exclude=20)
    p.add_argument("--kinds", nargs="+", choices=list(KINDS), default=list(KINDS),
                   metavar="NAME", help=f"compressions to run (default all: {' '.join(KINDS)})")
    p.add_argument("--powersgd-ranks", nargs="+", type=common.positive(), default=[],
                   metavar="R", help="also run PowerSGD at each of these ranks (powersgd runs "
                                     "at parallel.powersgd_rank's default)")
    args = common.parse_window(p)
    for rank in args.powersgd_ranks:
        KINDS[f"powersgd-r{rank}"] = [*KINDS["powersgd"], f"parallel.powersgd_rank={rank}"]
    extra = [f"powersgd-r{rank}" for rank in args.powersgd_ranks]
    args.kinds = list(dict.fromkeys([BASELINE, *args.kinds, *extra]))  # the baseline runs
    return args


def one_run(kind: str, rnd: int, *, args: Any, work: Path, tps: int,
            overrides: list[str]) -> dict[str, Any]:
    tag, run_dir = f"r{rnd}-{kind}", work / f"r{rnd}-{kind}"

    def measure() -> dict[str, Any]:
        out = common.stalwart_rate(run_dir, args.exclude, tps, final=True)
        rows = read_jsonl(run_dir / "metrics.jsonl")
        tail = [r["loss"] for r in rows if r["step"] > args.steps - LOSS_TAIL]
        out["tail_loss"] = statistics.mean(tail)
        out["grad_bytes"] = rows[-1].get("grad_bytes")
        out["grad_bytes_first"] = rows[0].get("grad_bytes")
        return out

    return common.rate_run(
        tag, common.stalwart_command(args.config, overrides + KINDS[kind], run_dir), args, work,
        {"kind": kind, "round": rnd, "run_dir": str(run_dir)}, measure,
        lambda r: f", loss {r['tail_loss']:.4f}, {fmt(r['grad_bytes'], ',.0f')} B/step")


def summarise(results: list[dict[str, Any]], kinds: list[str]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        ok = [r for r in results if r["kind"] == kind and "tokens_per_s" in r]
        summary[kind] = {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in ok) if ok else None,
            "grad_bytes": ok[0]["grad_bytes"] if ok else None,
            "final_loss": statistics.median(r["tail_loss"] for r in ok) if ok else None,
            "measured_rounds": len(ok)}
    base = summary[BASELINE]
    for s in summary.values():
        s["tokens_vs_none"] = common.ratio(s["tokens_per_s"], base["tokens_per_s"])
        s["bytes_vs_none"] = common.ratio(s["grad_bytes"], base["grad_bytes"])
        s["loss_rel_diff"] = (abs(s["final_loss"] - base["final_loss"]) / base["final_loss"]
                              if s["final_loss"] and base["final_loss"] else None)
        s["loss_within_goal"] = (s["loss_rel_diff"] <= TARGET_LOSS_REL
                                 if s["loss_rel_diff"] is not None else None)
    return summary


def print_table(summary: dict[str, dict[str, Any]], args: Any) -> None:
    head = (f"{'compression':<14} | {'bytes/step':>10} | {'vs none':>7} | {'tokens/s':>9} | "
            f"{'vs none':>7} | {'loss':>9} | {'rel diff':>8} | goal")
    print(f"\nper rank per step, steps {args.exclude + 1}..{args.steps} for tokens/s\n" + head
          + "\n" + "-" * len(head))
    for kind, s in summary.items():
        goal = {True: "met", False: "NOT MET", None: "-"}[s["loss_within_goal"]]
        print(f"{kind:<14} | {fmt(s['grad_bytes'], '10,.0f')} | {fmt(s['bytes_vs_none'], '7.3f')}"
              f" | {fmt(s['tokens_per_s'], '9,.0f')} | {fmt(s['tokens_vs_none'], '7.3f')} | "
              f"{fmt(s['final_loss'], '9.4f')} | {fmt(s['loss_rel_diff'], '8.2%')} | {goal}")
    print(f"(bytes/step: the gradient a rank hands its all-reduce once compression runs; a ring "
          f"all-reduce puts about twice that on the wire. loss: the mean over steps "
          f"{args.steps - LOSS_TAIL + 1}..{args.steps}; goal: within {TARGET_LOSS_REL:.0%} of "
          f"none's)")


def main() -> int:
    args = parse_args()
    every_run = [*common.window_overrides(args, WORKERS), *DDP]
    results, settings = common.window_rounds("compression", args, args.kinds, WORKERS,
                                             every_run, one_run)
    summary = summarise(results, args.kinds)
    print_table(summary, args)
    common.write_report(args.out, {"bench": "compression", "time": time.time(),
                                   "baseline": BASELINE, "target_loss_rel": TARGET_LOSS_REL,
                                   "summary": summary, "settings": settings}, results)
    return 0 if all(s["measured_rounds"] for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
