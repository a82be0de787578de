"""Throughput: the reference task on 2 workers through stalwart against plain torchrun DDP."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import DDP_LAYOUT, FSDP_LAYOUT, fmt, ratio, torchrun

TARGET = 0.98
WORKERS = 2
RUNNERS = ("stalwart-ddp", "torchrun-ddp", "stalwart-fsdp")


def one_run(runner: str, rnd: int, *, args: Any, work: Path, tps: int,
            overrides: list[str]) -> dict[str, Any]:
    tag = f"r{rnd}-{runner}"
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


def print_table(rates: dict[tuple[str, int], float], medians: dict[str, float | None],
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
        print(line(str(rnd + 1), *(rates.get((r, rnd)) for r in RUNNERS)))
    t = medians["torchrun-ddp"]
    print("-" * len(head) + "\n" + line("median", medians["stalwart-ddp"], t,
                                          medians.get("stalwart-fsdp")))
    return ratio(medians["stalwart-ddp"], t), (ratio(medians["stalwart-fsdp"], t) if fsdp else None)


def loss_check(results: list[dict[str, Any]], runners: list[str]) -> dict[str, float | None]:
    """Same model, same data: the loss curves of stalwart and torchrun DDP should agree."""
    out = {runner: common.worst_loss_diff(
        (a, b) for a in results for b in results
        if a["runner"] == runner and b["runner"] == "torchrun-ddp" and a["round"] == b["round"]
        and "loss_by_step" in a and "loss_by_step" in b)
        for runner in ("stalwart-ddp", "stalwart-fsdp")}
    print("\nloss vs torchrun at logged steps, max |diff|: " + ", ".join(
        f"{k} {fmt(v, '.2e')}" for k, v in out.items() if k in runners))
    return out


def main() -> int:
    # The first 40 steps are left out: the reference config's warm spare is asked for once
    # the world has trained a step, and its start (about 3 CPU seconds on a node the ranks
    # share) is start-up, not the steady state (bench.cold_start and bench.goodput count it).
    p = common.window_parser(__doc__, __spec__, "throughput.json", rounds=3, steps=100,
                             exclude=40)
    p.add_argument("--no-fsdp", action="store_true", help="skip the informational FSDP2 runs")
    args = common.parse_window(p)
    runners = [r for r in RUNNERS if not (args.no_fsdp and r == "stalwart-fsdp")]
    results, settings = common.window_rounds("throughput", args, runners, WORKERS,
                                             common.window_overrides(args, WORKERS), one_run,
                                             prune_measured=False)
    medians = common.medians(results, "runner", runners)
    rates = common.by_round(results, "runner")
    ratio_ddp, ratio_fsdp = print_table(rates, medians, runners, args.rounds)
    losses = loss_check(results, runners)
    if paired := common.paired(rates, "stalwart-ddp", "torchrun-ddp", args.rounds):
        print(f"paired ratios (stalwart DDP / torchrun DDP, same round): {common.spread(paired)}")
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
        "settings": {**settings, "ddp_layout": DDP_LAYOUT}}, results)
    return 0 if ratio_ddp is not None else 1


if __name__ == "__main__":
    sys.exit(main())
