"""Overhead: what the in-memory checkpoint tier costs the reference task's tokens/s."""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import DDP_LAYOUT, FSDP_LAYOUT, fmt, ratio
from stalwart.core.events import MemoryTier, read_events
from stalwart.report.summary import median

TARGET = 0.95
WORKERS = 2
OFF = ["checkpoint.snapshot_every=0"]
STAGE_ONLY = ["checkpoint.snapshot_every=1", "checkpoint.replicas=0"]
REPLICATED = ["checkpoint.snapshot_every=1", "checkpoint.replicas=1"]
BASELINE = "no-snapshots"
TARGET_RUNNER = "snapshots+replication"
# name -> its --set overrides (on top of the common ones).
RUNNERS: dict[str, list[str]] = {
    BASELINE: [*DDP_LAYOUT, *OFF],
    "snapshots": [*DDP_LAYOUT, *STAGE_ONLY],
    TARGET_RUNNER: [*DDP_LAYOUT, *REPLICATED],
    f"fsdp {BASELINE}": [*FSDP_LAYOUT, *OFF],
    f"fsdp {TARGET_RUNNER}": [*FSDP_LAYOUT, *REPLICATED],
}
# (runner, its baseline): the ratios reported; the targets are the replicated runners.
COMPARED = [("snapshots", BASELINE), (TARGET_RUNNER, BASELINE),
            (f"fsdp {TARGET_RUNNER}", f"fsdp {BASELINE}")]
TARGETS = [TARGET_RUNNER, f"fsdp {TARGET_RUNNER}"]


def one_run(runner: str, rnd: int, *, args: argparse.Namespace, work: Path, tps: int,
            overrides: list[str]) -> dict[str, Any]:
    run_dir = work / f"r{rnd}-{runner}"
    cmd = common.stalwart_command(args.config, overrides + RUNNERS[runner], run_dir)

    def measure() -> dict[str, Any]:
        out = common.stalwart_rate(run_dir, args.exclude, tps, final=True)
        # Read now: a measured run's folder goes when all is done.
        tier = next((e for e in read_events(run_dir / "events.jsonl")
                     if isinstance(e, MemoryTier)), None)
        if tier is not None:
            out["memory_tier"] = {k: getattr(tier, k) for k in (
                "bytes_per_worker", "bytes_total", "snapshot_every", "replicas")}
        elif OFF[0] not in RUNNERS[runner]:
            out["warning"] = "no memory_tier event in events.jsonl"
        return out

    def note(r: dict[str, Any]) -> str:
        mib = r.get("memory_tier", {}).get("bytes_per_worker")
        return f", tier {mib / 2**20:.2f} MiB/worker" if mib else ""

    return common.rate_run(run_dir.name, cmd, args, work, {
        "runner": runner, "round": rnd, "run_dir": str(run_dir)}, measure, note)


def print_rates(rates: dict[tuple[str, int], float], medians: dict[str, float | None],
                ratios: dict[str, float | None], paired: dict[str, list[float]],
                args: argparse.Namespace) -> None:
    """Tokens/s per runner and round, then each comparison's ratio."""
    width = max(len(n) for n in RUNNERS)
    print(f"\ntokens/s (steady state, steps {args.exclude + 1}..{args.steps})")
    head = f"{'runner':<{width}} | " + " | ".join(f"{'round ' + str(r + 1):>8}"
                                                 for r in range(args.rounds)) + " |   median"
    print(head + "\n" + "-" * len(head))
    for n in RUNNERS:
        print(f"{n:<{width}} | " + " | ".join(fmt(rates.get((n, r)), '8,.0f')
                                             for r in range(args.rounds))
              + f" | {fmt(medians[n], '8,.0f')}")
    print("-" * len(head))
    for n, b in COMPARED:
        if paired[n]:
            print(f"{n} / {b}: median ratio {fmt(ratios[n], '.3f')}; paired (same round) "
                  f"{common.spread(paired[n])}")


def tier_sizes(measured: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """The tier's size per snapshot runner: the largest reported (noted when rounds differ)."""
    print()
    tier: dict[str, dict[str, Any] | None] = {}
    for n, _ in COMPARED:
        sizes = [r["memory_tier"] for r in measured if r["runner"] == n and "memory_tier" in r]
        tier[n] = max(sizes, key=lambda t: t["bytes_per_worker"]) if sizes else None
        if len({t["bytes_per_worker"] for t in sizes}) > 1:
            print(f"note: {n}: bytes/worker differs between rounds ("
                  + " / ".join(f"{t['bytes_per_worker']:,}" for t in sizes)
                  + "); the largest is shown", flush=True)
    print("memory tier (memory_tier event): " + "; ".join(
        f"{n} {t['bytes_per_worker']:,} bytes/worker ({t['bytes_per_worker'] / 2**20:.2f} MiB), "
        f"{t['bytes_total']:,} bytes in all" if t else f"{n} -" for n, t in tier.items()))
    return tier


def loss_diffs(measured: list[dict[str, Any]]) -> tuple[dict[str, float | None], float | None]:
    """Snapshots must not change training: losses agree exactly with the baseline's and between
    any two runs of a layout (DDP and FSDP sum gradients in different orders)."""
    loss_diff = {n: common.worst_loss_diff((a, c) for a in measured for c in measured
                                          if a["runner"] == n and c["runner"] == base)
                 for n, base in COMPARED}
    any_two = common.worst_loss_diff(
        (a, b) for a, b in itertools.combinations(measured, 2)
        if a["runner"].startswith("fsdp") == b["runner"].startswith("fsdp"))
    logged = len(measured[0]["loss_by_step"]) if measured else 0
    print(f"loss vs the baseline of its layout at the {logged} logged steps (every run, all "
          f"rounds), max |diff|: " + ", ".join(f"{n} {d}" for n, d in loss_diff.items())
          + f"; any two runs of a layout {any_two} -> "
          + ("identical" if any_two == 0.0 else
             "NOT IDENTICAL" if any_two is not None else "not compared"))
    return loss_diff, any_two


def verdicts(ratios: dict[str, float | None], paired_median: dict[str, float | None],
             rounds: int) -> dict[str, bool]:
    out, base_of = {}, dict(COMPARED)
    print()
    for n in TARGETS:
        out[n] = (r := ratios[n]) is not None and r >= TARGET
        if r is None:
            print(f"{n}: no comparison (a runner produced no measurement; see the logs above)")
            continue
        print(f"{n} / {base_of[n]} = {r:.3f} (median of {rounds}; paired median "
              f"{fmt(paired_median[n], '.3f')}); target >= {TARGET}: "
              f"{'MET' if out[n] else 'NOT MET'}")
    print(f"snapshots / {BASELINE} = {fmt(ratios['snapshots'], '.3f')} (staging only; "
          "informational)")
    return out


def main() -> int:
    args = common.parse_window(common.window_parser(__doc__, __spec__, "overhead.json",
                                                    rounds=3, steps=60))
    # No idle spare: both workers' CPUs, nothing else.
    overrides = [*common.window_overrides(args, WORKERS), "scaling.spare_workers=0"]
    results, settings = common.window_rounds(
        "overhead", args, list(RUNNERS), WORKERS, overrides, one_run,
        notes=[f"  {name}: {' '.join(sets)}" for name, sets in RUNNERS.items()])
    measured = [r for r in results if "tokens_per_s" in r]
    rates = common.by_round(results, "runner")
    medians = common.medians(results, "runner", list(RUNNERS))
    ratios = {n: ratio(medians[n], medians[b]) for n, b in COMPARED}
    paired = {n: common.paired(rates, n, b, args.rounds) for n, b in COMPARED}
    paired_median = {n: median(v) for n, v in paired.items()}
    print_rates(rates, medians, ratios, paired, args)
    tier = tier_sizes(measured)
    loss_diff, loss_diff_all = loss_diffs(measured)
    common.write_report(args.out, {
        "bench": "overhead", "time": time.time(), "target": TARGET, "target_runners": TARGETS,
        "target_met": verdicts(ratios, paired_median, args.rounds), "compared": COMPARED,
        "ratios": ratios, "paired_ratios": paired, "paired_ratio_medians": paired_median,
        "median_tokens_per_s": medians, "memory_tier": tier,
        "loss_max_abs_diff_vs_no_snapshots": loss_diff,
        "loss_max_abs_diff_any_two_runs": loss_diff_all,
        "settings": {**settings, "runners": RUNNERS}}, results)
    return 0 if all(medians[n] is not None for n in RUNNERS) else 1


if __name__ == "__main__":
    sys.exit(main())
