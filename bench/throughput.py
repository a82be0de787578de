"""Throughput: the reference task on 2 workers through stalwart against plain torchrun DDP.

Each round runs, the order flipping every round: `stalwart run examples/gpt/config.toml` in
the DDP layout as a user types it (stalwart-ddp); bench/peers/torchrun_ddp.py under torchrun,
the same model, data, batch and optimizer by hand (torchrun-ddp); stalwart with FSDP2
(stalwart-fsdp, informational). The rate is steady-state tokens/s: steps exclude+1..steps over
the time from the end of step `exclude` to the end of the last, so start-up is left out.

    python -m bench.throughput [--rounds 3] [--steps 60] [--out bench/results/throughput.json]

Target: median(stalwart-ddp) >= 0.98 x median(torchrun-ddp). The exit code is 0 whether or
not the target is met (this is a measurement); it is 1 only if no comparison could be made.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench import common
from bench.common import ratio
from bench.peers import torchrun

TARGET = 0.98
WORKERS = 2
RUNNERS = ("stalwart-ddp", "torchrun-ddp", "stalwart-fsdp")
DDP_LAYOUT = ["parallel.dp_replicate=2", "parallel.dp_shard=1"]
FSDP_LAYOUT = ["parallel.dp_replicate=1", "parallel.dp_shard=-1"]
# A missing value prints 9 wide in every column of the table.
fmt = partial(common.fmt, missing="-".rjust(9))


def parse_args() -> argparse.Namespace:
    p = common.parser(__doc__, __spec__)
    common.add_window_args(p, rounds=3, rounds_of="runners", steps=60)
    p.add_argument("--no-fsdp", action="store_true", help="skip the informational FSDP2 runs")
    return common.parse_bench_args(p, "throughput.json")


def one_run(runner: str, args: argparse.Namespace, work: Path, rnd: int,
            tps: int) -> dict[str, Any]:
    tag = f"r{rnd}-{runner}"
    overrides = common.window_overrides(args, WORKERS)
    result: dict[str, Any] = {"runner": runner, "round": rnd}
    if runner != "torchrun-ddp":
        run_dir = work / tag
        result["run_dir"] = str(run_dir)
        cmd = common.stalwart_command(args.config, overrides + (
            DDP_LAYOUT if runner == "stalwart-ddp" else FSDP_LAYOUT), run_dir)
        return common.rate_run(tag, cmd, args, work, result, lambda: common.stalwart_rate(
            run_dir, args.exclude, tps, cross_check=True))
    out = work / f"{tag}.json"

    def measure() -> dict[str, Any]:
        row = json.loads(out.read_text().splitlines()[-1])
        got = {k: row[k] for k in ("tokens_per_s", "window_s", "loss_by_step", "tokens_per_step")}
        got["measured_steps"] = row["steps"] - row["excluded_steps"]
        if row["tokens_per_step"] != tps:
            got["warning"] = f"tokens/step {row['tokens_per_step']} != {tps}"
        return got

    cmd = torchrun("bench.peers.torchrun_ddp", WORKERS, [
        "--config", args.config, *common.set_args(overrides), "--steps", str(args.steps),
        "--exclude", str(args.exclude), "--out", str(out)])
    return common.rate_run(tag, cmd, args, work, result, measure)


def rate(results: list[dict[str, Any]], runner: str, rnd: int) -> float | None:
    return next((r.get("tokens_per_s") for r in results
                 if r["runner"] == runner and r["round"] == rnd), None)


def print_table(results: list[dict[str, Any]], medians: dict[str, float | None],
                runners: list[str], rounds: int) -> tuple[float | None, float | None]:
    """Tokens/s per round and the medians; (stalwart DDP / torchrun, FSDP2 / torchrun)."""
    fsdp = "stalwart-fsdp" in runners
    head = f"{'round':>6} | {'stalwart DDP':>12} | {'torchrun DDP':>12} | {'ratio':>6}"
    head += f" | {'stalwart FSDP2':>14} | {'ratio':>6}" if fsdp else ""
    print("\ntokens/s (steady state)\n" + head + "\n" + "-" * len(head))

    def line(label: str, s: float | None, t: float | None, f: float | None) -> str:
        out = f"{label:>6} | {fmt(s, '12,.0f')} | {fmt(t, '12,.0f')} | {fmt(ratio(s, t), '6.3f')}"
        return out + (f" | {fmt(f, '14,.0f')} | {fmt(ratio(f, t), '6.3f')}" if fsdp else "")

    for rnd in range(rounds):
        print(line(str(rnd + 1), rate(results, "stalwart-ddp", rnd),
                   rate(results, "torchrun-ddp", rnd), rate(results, "stalwart-fsdp", rnd)))
    t = medians["torchrun-ddp"]
    print("-" * len(head) + "\n" + line("median", medians["stalwart-ddp"], t,
                                          medians.get("stalwart-fsdp")))
    return ratio(medians["stalwart-ddp"], t), (ratio(medians["stalwart-fsdp"], t) if fsdp
                                                 else None)


def loss_check(results: list[dict[str, Any]], runners: list[str]) -> dict[str, float | None]:
    """Same model, same data: the loss curves of stalwart and torchrun DDP should agree."""
    out: dict[str, float | None] = {}
    for runner in ("stalwart-ddp", "stalwart-fsdp"):
        diffs = [common.max_loss_diff(a["loss_by_step"], b["loss_by_step"])
                 for a in results for b in results
                 if a["runner"] == runner and b["runner"] == "torchrun-ddp"
                 and a["round"] == b["round"] and "loss_by_step" in a and "loss_by_step" in b]
        diffs = [d for d in diffs if d is not None]
        out[runner] = max(diffs) if diffs else None
    print("\nloss vs torchrun at logged steps, max |diff|: " + ", ".join(
        f"{k} {fmt(v, '.2e')}" for k, v in out.items() if k in runners))
    return out


def main() -> int:
    args = parse_args()
    runners = [r for r in RUNNERS if not (args.no_fsdp and r == "stalwart-fsdp")]
    overrides = common.window_overrides(args, WORKERS)
    tps, config = common.tokens_per_step(args.config, overrides)
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-"))
    print(f"throughput: {args.rounds} round(s) x {runners}, {args.steps} steps each "
          f"(first {args.exclude} excluded), {tps} tokens/step, {WORKERS} workers, "
          f"{os.cpu_count()} CPUs; logs in {work}", flush=True)
    results = common.run_rounds(runners, args.rounds,
                                lambda runner, rnd: one_run(runner, args, work, rnd, tps),
                                work=work, keep=args.keep, prune_measured=False)
    medians = common.medians(results, "runner", runners)
    ratio_ddp, ratio_fsdp = print_table(results, medians, runners, args.rounds)
    losses = loss_check(results, runners)
    # Side-by-side pairs cancel the machine's slow drifts (shared hosts); their spread shows
    # how far one round can be trusted.
    paired = [p for rnd in range(args.rounds) if (p := ratio(
        rate(results, "stalwart-ddp", rnd), rate(results, "torchrun-ddp", rnd))) is not None]
    if paired:
        print(f"paired ratios (stalwart DDP / torchrun DDP, same round): median "
              f"{statistics.median(paired):.3f}, min {min(paired):.3f}, max {max(paired):.3f}")
    met = ratio_ddp is not None and ratio_ddp >= TARGET
    if ratio_ddp is None:
        print("\nno comparison: a runner produced no measurement (see the logs above)")
    else:
        print(f"\nstalwart DDP / torchrun DDP = {ratio_ddp:.3f} (median of {args.rounds}); "
              f"target >= {TARGET}: {'MET' if met else 'NOT MET'}")
    if ratio_fsdp is not None:
        print(f"stalwart FSDP2 / torchrun DDP = {ratio_fsdp:.3f} (informational)")
    common.write_report(args.out, {
        "bench": "throughput", "time": time.time(), "target": TARGET, "target_met": met,
        "ratio_stalwart_ddp_over_torchrun": ratio_ddp,
        "ratio_stalwart_fsdp_over_torchrun": ratio_fsdp,
        "paired_ratios_stalwart_ddp_over_torchrun": paired, "median_tokens_per_s": medians,
        "loss_max_abs_diff_vs_torchrun": losses,
        "settings": {**common.window_settings(args, WORKERS, tps, overrides),
                     "ddp_layout": DDP_LAYOUT,
                     "global_batch_size": config.train.global_batch_size,
                     "micro_batch_size": config.train.micro_batch_size,
                     "grad_accum": config.grad_accum_steps}}, results)
    return 0 if ratio_ddp is not None else 1


if __name__ == "__main__":
    sys.exit(main())
