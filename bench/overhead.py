"""Overhead: what the in-memory checkpoint tier costs the reference task's tokens/s.

Each round runs, one after the other on the same machine (the order flips every round so
that a drift in machine load does not favour one side), `stalwart run
examples/gpt/config.toml --set ...` exactly as a user types it (own embedded Ray), with:

  no-snapshots            checkpoint.snapshot_every=0: the memory tier off
  snapshots               checkpoint.snapshot_every=1 checkpoint.replicas=0: every step each
                          rank stages its shard into CPU buffers, no peer copies; informational
  snapshots+replication   checkpoint.snapshot_every=1 checkpoint.replicas=1 (the default):
                          staged, then sent to a peer holder by a background thread

in the reference config's DDP layout (parallel.dp_replicate=2 parallel.dp_shard=1), where the
two ranks are data-parallel twins: each already holds the other's snapshot, so nothing is
sent and replication costs nothing; and, to measure the copy itself, the same pair
`fsdp no-snapshots` / `fsdp snapshots+replication` with FSDP2 over both workers
(parallel.dp_replicate=1 parallel.dp_shard=-1), where every shard is distinct and is sent to
the other rank every step.

All use the same overrides: 2 workers, scaling.spare_workers=0 (no idle spare on the same CPUs), train.steps,
run.log_every, validation off and no storage checkpoint before the last step (which is written
after the last metrics row, so outside the window). The rate is steady-state tokens/s: tokens
of steps exclude+1..steps over the wall time between those metrics.jsonl rows. The size of the
tier comes from each snapshot run's `memory_tier` event in events.jsonl. Snapshots must not
change training: the losses of every run must agree exactly at every logged step.

    python -m bench.overhead [--rounds 3] [--steps 60] [--out bench/results/overhead.json]

Target: median(snapshots+replication) >= 0.95 x median(no-snapshots), in each layout. The exit code is 0
whether or not the target is met (this is a measurement); it is 1 only if a runner produced
no measurement.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import common

if TYPE_CHECKING:
    from stalwart.core.events import MemoryTier

DEFAULT_OUT = common.ROOT / "bench" / "results" / "overhead.json"
TARGET = 0.95
WORKERS = 2
DDP_LAYOUT = ["parallel.dp_replicate=2", "parallel.dp_shard=1"]
FSDP_LAYOUT = ["parallel.dp_replicate=1", "parallel.dp_shard=-1"]
OFF = ["checkpoint.snapshot_every=0"]
STAGE_ONLY = ["checkpoint.snapshot_every=1", "checkpoint.replicas=0"]
REPLICATED = ["checkpoint.snapshot_every=1", "checkpoint.replicas=1"]
BASELINE = "no-snapshots"
TARGET_RUNNER = "snapshots+replication"
# name -> its --set overrides (on top of common_overrides).
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


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_window_args(p, rounds=3, rounds_of="runners", steps=60)
    p.add_argument("--config", default=str(common.DEFAULT_CONFIG), help="stalwart TOML config")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON result file")
    return common.parse_bench_args(p)


def common_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"scaling.num_workers={WORKERS}",
        "scaling.spare_workers=0",                        # both workers' CPUs, nothing idle
        f"train.steps={args.steps}",
        f"run.log_every={args.log_every}",
        "data.val_every=0",                               # no validation pass in the window
        f"checkpoint.persist_every={args.steps + 1}",     # only the final, after the last row
    ]


def memory_tier(run_dir: Path) -> MemoryTier | None:
    """The run's first `memory_tier` event (None if the tier is off or never reported)."""
    from stalwart.core.events import MemoryTier, read_events

    events = [e for e in read_events(run_dir / "events.jsonl") if isinstance(e, MemoryTier)]
    return events[0] if events else None


def one_run(runner: str, rnd: int, *, args: argparse.Namespace, work: Path,
            tps: int) -> dict[str, Any]:
    tag = f"r{rnd}-{runner}"
    log, run_dir = work / f"{tag}.log", work / tag
    load = os.getloadavg()[0]
    cmd = common.stalwart_command(args.config, common_overrides(args) + RUNNERS[runner],
                                  run_dir)
    code, wall = common.run_logged(cmd, log, args.timeout)
    result: dict[str, Any] = {"runner": runner, "round": rnd, "exit_code": code,
                              "wall_s": wall, "load_before": load, "log": str(log),
                              "run_dir": str(run_dir)}
    try:
        if code != 0:
            raise RuntimeError(f"exit code {code}")
        result.update(common.stalwart_rate(run_dir, args.exclude, tps, final=True))
        tier = memory_tier(run_dir)  # read now: a measured run's folder goes when all is done
        if tier is not None:
            result["memory_tier"] = {k: getattr(tier, k) for k in (
                "bytes_per_worker", "bytes_total", "snapshot_every", "replicas")}
        elif "checkpoint.snapshot_every=0" not in RUNNERS[runner]:
            result["warning"] = "no memory_tier event in events.jsonl"
    except (RuntimeError, OSError, ValueError, KeyError, IndexError) as exc:
        result.pop("tokens_per_s", None)
        result["error"] = str(exc) if isinstance(exc, RuntimeError) else \
            f"{type(exc).__name__}: {exc}"
        print(f"  {tag}: FAILED ({result['error']}); last lines of {log}:\n"
              f"{common.tail(log, indent='    ')}", flush=True)
        return result
    mib = result.get("memory_tier", {}).get("bytes_per_worker")
    print(f"  {tag}: {result['tokens_per_s']:9,.0f} tokens/s  (window "
          f"{result['window_s']:.1f}s, whole run {wall:.1f}s, load {load:.2f}"
          + (f", tier {mib / 2**20:.2f} MiB/worker" if mib else "") + ")"
          + (f"  WARNING: {result['warning']}" if "warning" in result else ""), flush=True)
    return result


def main() -> int:
    args = parse_args()
    names = list(RUNNERS)
    overrides = common_overrides(args)
    tps, config = common.tokens_per_step(args.config, overrides)
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-overhead-"))
    print(f"overhead: {args.rounds} round(s) x {len(names)} runners on {os.cpu_count()} CPUs, "
          f"{args.steps} steps each (first {args.exclude} excluded), {tps} tokens/step; logs "
          f"in {work}\n  every run: {' '.join(overrides)}", flush=True)
    for name, sets in RUNNERS.items():
        print(f"  {name}: {' '.join(sets)}", flush=True)
    results = common.run_rounds(names, args.rounds,
                                partial(one_run, args=args, work=work, tps=tps),
                                work=work, keep=args.keep, prune_measured=True)
    measured = [r for r in results if "tokens_per_s" in r]
    rates = {(r["runner"], r["round"]): r["tokens_per_s"] for r in measured}

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    medians: dict[str, float | None] = {}
    for name in names:
        vals = [v for (n, _), v in rates.items() if n == name]
        medians[name] = statistics.median(vals) if vals else None
    others = [n for n, _ in COMPARED]
    base_of = dict(COMPARED)
    ratios = {n: ratio(medians[n], medians[b]) for n, b in COMPARED}
    # Side-by-side pairs cancel the machine's slow drifts (a shared host); their spread
    # shows how far one round can be trusted.
    paired = {n: [p for rnd in range(args.rounds)
                  if (p := ratio(rates.get((n, rnd)), rates.get((b, rnd)))) is not None]
              for n, b in COMPARED}
    paired_median = {n: statistics.median(v) if v else None for n, v in paired.items()}

    # Table: tokens/s per runner and round, then each comparison's ratio.
    width = max(len(n) for n in names)
    print(f"\ntokens/s (steady state, steps {args.exclude + 1}..{args.steps})")
    head = f"{'runner':<{width}} | " + " | ".join(f"{'round ' + str(r + 1):>8}"
                                                 for r in range(args.rounds)) + " |   median"
    print(head + "\n" + "-" * len(head))
    for n in names:
        print(f"{n:<{width}} | " + " | ".join(common.fmt(rates.get((n, r)), '8,.0f')
                                             for r in range(args.rounds))
              + f" | {common.fmt(medians[n], '8,.0f')}")
    print("-" * len(head))
    for n, b in COMPARED:
        if paired[n]:
            print(f"{n} / {b}: median ratio {common.fmt(ratios[n], '.3f')}; paired (same "
                  f"round) median {paired_median[n]:.3f}, min {min(paired[n]):.3f}, max "
                  f"{max(paired[n]):.3f}")

    # The size of the tier, per snapshot runner: the largest reported (it should not differ
    # between rounds: say so when it does).
    print()
    tier: dict[str, dict[str, Any] | None] = {}
    for n in others:
        sizes = [r["memory_tier"] for r in measured if r["runner"] == n and "memory_tier" in r]
        tier[n] = max(sizes, key=lambda t: t["bytes_per_worker"]) if sizes else None
        if len({t["bytes_per_worker"] for t in sizes}) > 1:
            print(f"note: {n}: bytes/worker differs between rounds ("
                  + " / ".join(f"{t['bytes_per_worker']:,}" for t in sizes)
                  + "); the largest is shown", flush=True)
    print("memory tier (memory_tier event): " + "; ".join(
        f"{n} {t['bytes_per_worker']:,} bytes/worker ({t['bytes_per_worker'] / 2**20:.2f} MiB), "
        f"{t['bytes_total']:,} bytes in all" if t else f"{n} -" for n, t in tier.items()))

    # Snapshots must not change training: every run's losses agree exactly, step by step.
    loss_diff: dict[str, float | None] = {}
    for n in others:
        diffs = [common.max_loss_diff(a["loss_by_step"], b["loss_by_step"])
                 for a in measured for b in measured
                 if a["runner"] == n and b["runner"] == base_of[n]]
        diffs = [d for d in diffs if d is not None]
        loss_diff[n] = max(diffs) if diffs else None
    # Within a layout (DDP and FSDP sum gradients in different orders).
    every = [d for a, b in itertools.combinations(measured, 2)
             if a["runner"].startswith("fsdp") == b["runner"].startswith("fsdp")
             and (d := common.max_loss_diff(a["loss_by_step"], b["loss_by_step"])) is not None]
    loss_diff_all = max(every) if every else None
    logged = len(measured[0]["loss_by_step"]) if measured else 0
    print(f"loss vs the baseline of its layout at the {logged} logged steps (every run, all "
          f"rounds), max |diff|: " + ", ".join(f"{n} {d}" for n, d in loss_diff.items())
          + f"; any two runs of a layout {loss_diff_all} -> "
          + ("identical" if loss_diff_all == 0.0 else
             "NOT IDENTICAL" if loss_diff_all is not None else "not compared"))

    verdicts = {}
    print()
    for n in TARGETS:
        r = ratios[n]
        verdicts[n] = r is not None and r >= TARGET
        if r is None:
            print(f"{n}: no comparison (a runner produced no measurement; see the logs above)")
            continue
        print(f"{n} / {base_of[n]} = {r:.3f} (median of {args.rounds}; paired median "
              f"{common.fmt(paired_median[n], '.3f')}); target >= {TARGET}: "
              f"{'MET' if verdicts[n] else 'NOT MET'}")
    print(f"snapshots / {BASELINE} = {common.fmt(ratios['snapshots'], '.3f')} (staging "
          f"only; informational)")

    report = {
        "bench": "overhead",
        "time": time.time(),
        "target": TARGET,
        "target_runners": TARGETS,
        "target_met": verdicts,
        "compared": COMPARED,
        "ratios": ratios,
        "paired_ratios": paired,
        "paired_ratio_medians": paired_median,
        "median_tokens_per_s": medians,
        "memory_tier": tier,
        "loss_max_abs_diff_vs_no_snapshots": loss_diff,
        "loss_max_abs_diff_any_two_runs": loss_diff_all,
        "settings": {
            **common.window_settings(args, WORKERS, tps, overrides),
            "runners": RUNNERS,
            "global_batch_size": config.train.global_batch_size,
            "micro_batch_size": config.train.micro_batch_size,
        },
    }
    common.write_report(args.out, report, results)
    return 0 if all(medians[n] is not None for n in names) else 1


if __name__ == "__main__":
    sys.exit(main())
