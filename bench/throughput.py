"""Throughput: the reference task on 2 workers through stalwart against plain torchrun DDP.

Each round runs, one after the other on the same machine (the order flips every round so
that a drift in machine load does not favour one side):

  stalwart-ddp    `stalwart run examples/gpt/config.toml --set parallel.dp_replicate=2
                  --set parallel.dp_shard=1 ...`, exactly as a user types it (own embedded Ray)
  torchrun-ddp    `python -m torch.distributed.run --standalone --nproc_per_node 2
                  -m bench.peers.torchrun_ddp ...`: the same model, data, batch, optimizer by hand
  stalwart-fsdp   stalwart with FSDP2 over both workers (parallel.dp_shard=-1);
                  informational, not part of the target

All three use the same overrides: train.steps, run.log_every, validation off and no storage
checkpoint before the last step (which is written after the last metrics row, so outside
the window). The rate is steady-state tokens/s: tokens of steps exclude+1..steps divided by
the wall time from the end of step `exclude` to the end of the last step (stalwart: from
metrics.jsonl rows; torchrun: the same clock in the script). Process and Ray start-up are
outside the window on both sides.

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

DEFAULT_OUT = common.ROOT / "bench" / "results" / "throughput.json"
TARGET = 0.98
WORKERS = 2
RUNNERS = ("stalwart-ddp", "torchrun-ddp", "stalwart-fsdp")
DDP_LAYOUT = ["parallel.dp_replicate=2", "parallel.dp_shard=1"]
FSDP_LAYOUT = ["parallel.dp_replicate=1", "parallel.dp_shard=-1"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_window_args(p, rounds=3, rounds_of="runners", steps=60)
    p.add_argument("--config", default=str(common.DEFAULT_CONFIG), help="stalwart TOML config")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON result file")
    p.add_argument("--no-fsdp", action="store_true", help="skip the informational FSDP2 runs")
    return common.parse_bench_args(p)


def common_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"scaling.num_workers={WORKERS}",
        f"train.steps={args.steps}",
        f"run.log_every={args.log_every}",
        "data.val_every=0",                               # no validation pass in the window
        f"checkpoint.persist_every={args.steps + 1}",     # only the final, after the last row
    ]


def torchrun_command(args: argparse.Namespace, out: Path) -> list[str]:
    sets = [x for o in common_overrides(args) for x in ("--set", o)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(WORKERS), "-m", "bench.peers.torchrun_ddp", "--config", args.config,
            *sets, "--steps", str(args.steps), "--exclude", str(args.exclude), "--out", str(out)]


def one_run(runner: str, args: argparse.Namespace, work: Path, rnd: int,
            tps: int) -> dict[str, Any]:
    tag = f"r{rnd}-{runner}"
    log = work / f"{tag}.log"
    load = os.getloadavg()[0]
    if runner == "torchrun-ddp":
        out = work / f"{tag}.json"
        code, wall = common.run_logged(torchrun_command(args, out), log, args.timeout)
        result: dict[str, Any] = {"runner": runner, "round": rnd, "exit_code": code,
                                  "wall_s": wall, "load_before": load, "log": str(log)}
        if code == 0 and out.exists():
            row = json.loads(out.read_text().splitlines()[-1])
            result.update({k: row[k] for k in ("tokens_per_s", "window_s", "loss_by_step",
                                               "tokens_per_step")})
            result["measured_steps"] = row["steps"] - row["excluded_steps"]
            if row["tokens_per_step"] != tps:
                result["warning"] = f"tokens/step {row['tokens_per_step']} != {tps}"
    else:
        run_dir = work / tag
        layout = DDP_LAYOUT if runner == "stalwart-ddp" else FSDP_LAYOUT
        cmd = common.stalwart_command(args.config, common_overrides(args) + layout, run_dir)
        code, wall = common.run_logged(cmd, log, args.timeout)
        result = {"runner": runner, "round": rnd, "exit_code": code, "wall_s": wall,
                  "load_before": load, "log": str(log), "run_dir": str(run_dir)}
        if code == 0:
            try:
                result.update(common.stalwart_rate(run_dir, args.exclude, tps, cross_check=True))
            except (OSError, ValueError, KeyError, IndexError) as exc:
                result["error"] = f"{type(exc).__name__}: {exc}"
    if "tokens_per_s" not in result:
        result.setdefault("error", f"exit code {code}")
        print(f"  {tag}: FAILED ({result['error']}); last lines of {log}:\n"
              f"{common.tail(log, indent='    ')}", flush=True)
    else:
        print(f"  {tag}: {result['tokens_per_s']:9,.0f} tokens/s  (window "
              f"{result['window_s']:.1f}s, whole run {wall:.1f}s, load {load:.2f})", flush=True)
    return result


# A missing value prints 9 wide in every column of the table.
fmt = partial(common.fmt, missing="-".rjust(9))


def main() -> int:
    args = parse_args()
    runners = [r for r in RUNNERS if not (args.no_fsdp and r == "stalwart-fsdp")]
    tps, config = common.tokens_per_step(args.config, common_overrides(args))
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-"))
    print(f"throughput: {args.rounds} round(s) x {runners}, {args.steps} steps each "
          f"(first {args.exclude} excluded), {tps} tokens/step, {WORKERS} workers, "
          f"{os.cpu_count()} CPUs; logs in {work}", flush=True)

    results = common.run_rounds(runners, args.rounds,
                         lambda runner, rnd: one_run(runner, args, work, rnd, tps),
                         work=work, keep=args.keep, prune_measured=False)

    def rate(runner: str, rnd: int) -> float | None:
        for r in results:
            if r["runner"] == runner and r["round"] == rnd:
                return r.get("tokens_per_s")
        return None

    medians: dict[str, float | None] = {}
    for runner in runners:
        vals = [r["tokens_per_s"] for r in results if r["runner"] == runner
                and "tokens_per_s" in r]
        medians[runner] = statistics.median(vals) if vals else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    # Table.
    head = f"{'round':>6} | {'stalwart DDP':>12} | {'torchrun DDP':>12} | {'ratio':>6}"
    if "stalwart-fsdp" in runners:
        head += f" | {'stalwart FSDP2':>14} | {'ratio':>6}"
    print("\ntokens/s (steady state)\n" + head + "\n" + "-" * len(head))
    for rnd in range(args.rounds):
        s, t = rate("stalwart-ddp", rnd), rate("torchrun-ddp", rnd)
        line = f"{rnd + 1:>6} | {fmt(s, '12,.0f')} | {fmt(t, '12,.0f')} | {fmt(ratio(s, t), '6.3f')}"
        if "stalwart-fsdp" in runners:
            f = rate("stalwart-fsdp", rnd)
            line += f" | {fmt(f, '14,.0f')} | {fmt(ratio(f, t), '6.3f')}"
        print(line)
    s, t = medians["stalwart-ddp"], medians["torchrun-ddp"]
    ratio_ddp = ratio(s, t)
    line = f"{'median':>6} | {fmt(s, '12,.0f')} | {fmt(t, '12,.0f')} | {fmt(ratio_ddp, '6.3f')}"
    ratio_fsdp = None
    if "stalwart-fsdp" in runners:
        ratio_fsdp = ratio(medians["stalwart-fsdp"], t)
        line += f" | {fmt(medians['stalwart-fsdp'], '14,.0f')} | {fmt(ratio_fsdp, '6.3f')}"
    print("-" * len(head) + "\n" + line)

    # Same model, same data: the loss curves of stalwart DDP and torchrun DDP should agree.
    loss_check: dict[str, float | None] = {}
    for runner in ("stalwart-ddp", "stalwart-fsdp"):
        diffs = [common.max_loss_diff(a["loss_by_step"], b["loss_by_step"])
                 for a in results for b in results
                 if a["runner"] == runner and b["runner"] == "torchrun-ddp"
                 and a["round"] == b["round"] and "loss_by_step" in a and "loss_by_step" in b]
        diffs = [d for d in diffs if d is not None]
        loss_check[runner] = max(diffs) if diffs else None
    print("\nloss vs torchrun at logged steps, max |diff|: " + ", ".join(
        f"{k} {fmt(v, '.2e')}" for k, v in loss_check.items() if k in runners))

    # Side-by-side pairs cancel the machine's slow drifts (shared hosts); their spread shows
    # how far one round can be trusted.
    paired = [ratio(rate("stalwart-ddp", rnd), rate("torchrun-ddp", rnd))
              for rnd in range(args.rounds)]
    paired = [p for p in paired if p is not None]
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

    report = {
        "bench": "throughput",
        "time": time.time(),
        "target": TARGET,
        "target_met": met,
        "ratio_stalwart_ddp_over_torchrun": ratio_ddp,
        "ratio_stalwart_fsdp_over_torchrun": ratio_fsdp,
        "paired_ratios_stalwart_ddp_over_torchrun": paired,
        "median_tokens_per_s": medians,
        "loss_max_abs_diff_vs_torchrun": loss_check,
        "settings": {
            **common.window_settings(args, WORKERS, tps, common_overrides(args)),
            "ddp_layout": DDP_LAYOUT, "global_batch_size": config.train.global_batch_size,
            "micro_batch_size": config.train.micro_batch_size,
            "grad_accum": config.grad_accum_steps,
        },
    }
    common.write_report(args.out, report, results)
    return 0 if ratio_ddp is not None else 1


if __name__ == "__main__":
    sys.exit(main())
