"""Throughput: the reference task on 2 workers through stalwart against plain torchrun DDP.

Each round runs, one after the other on the same machine (the order flips every round so
that a drift in machine load does not favour one side):

  stalwart-ddp    `stalwart run examples/gpt/config.toml --set parallel.dp_replicate=2
                  --set parallel.dp_shard=1 ...`, exactly as a user types it (own embedded Ray)
  torchrun-ddp    `python -m torch.distributed.run --standalone --nproc_per_node 2
                  bench/torchrun_ddp.py ...`: the same model, data, batch, optimizer by hand
  stalwart-fsdp   stalwart with FSDP2 over both workers (parallel.dp_shard=-1);
                  informational, not part of the target

All three use the same overrides: train.steps, run.log_every, validation off and no storage
checkpoint before the last step (which is written after the last metrics row, so outside
the window). The rate is steady-state tokens/s: tokens of steps exclude+1..steps divided by
the wall time from the end of step `exclude` to the end of the last step (stalwart: from
metrics.jsonl rows; torchrun: the same clock in the script). Process and Ray start-up are
outside the window on both sides.

    python bench/throughput.py [--rounds 3] [--steps 60] [--out bench/results/throughput.json]

Target: median(stalwart-ddp) >= 0.98 x median(torchrun-ddp). The exit code is 0 whether or
not the target is met (this is a measurement); it is 1 only if no comparison could be made.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "examples" / "gpt" / "config.toml"
DEFAULT_OUT = ROOT / "bench" / "results" / "throughput.json"
TORCHRUN_SCRIPT = Path(__file__).resolve().parent / "torchrun_ddp.py"
TARGET = 0.98
WORKERS = 2
RUNNERS = ("stalwart-ddp", "torchrun-ddp", "stalwart-fsdp")
DDP_LAYOUT = ["parallel.dp_replicate=2", "parallel.dp_shard=1"]
FSDP_LAYOUT = ["parallel.dp_replicate=1", "parallel.dp_shard=-1"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of all runners (default 3)")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps per run (default 60)")
    p.add_argument("--exclude", type=int, default=10,
                   help="warm-up steps left out of the rate (default 10; a multiple of "
                        "--log-every)")
    p.add_argument("--log-every", type=int, default=5, help="stalwart run.log_every (default 5)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="stalwart TOML config")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON result file")
    p.add_argument("--no-fsdp", action="store_true", help="skip the informational FSDP2 runs")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per run")
    p.add_argument("--keep", action="store_true", help="keep the temporary run directories")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    if args.log_every < 1 or args.exclude < 1 or args.exclude % args.log_every:
        p.error("--exclude must be a positive multiple of --log-every (a metrics row must "
                "mark the start of the window)")
    if args.steps <= args.exclude:
        p.error("--steps must be larger than --exclude")
    return args


def common_overrides(args: argparse.Namespace) -> list[str]:
    return [
        f"scaling.num_workers={WORKERS}",
        f"train.steps={args.steps}",
        f"run.log_every={args.log_every}",
        "data.val_every=0",                               # no validation pass in the window
        f"checkpoint.persist_every={args.steps + 1}",     # only the final, after the last row
    ]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # every stalwart run starts its own embedded Ray
    env["PYTHONUNBUFFERED"] = "1"
    return env


def stalwart_command(args: argparse.Namespace, run_dir: Path, layout: list[str]) -> list[str]:
    exe = Path(sys.executable).with_name("stalwart")
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "stalwart.cli"]
    sets = [x for o in common_overrides(args) + layout for x in ("--set", o)]
    return [*cli, "run", args.config, *sets, "--run-dir", str(run_dir)]


def torchrun_command(args: argparse.Namespace, out: Path) -> list[str]:
    sets = [x for o in common_overrides(args) for x in ("--set", o)]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(WORKERS), str(TORCHRUN_SCRIPT), "--config", args.config,
            *sets, "--steps", str(args.steps), "--exclude", str(args.exclude), "--out", str(out)]


def run_logged(cmd: list[str], log: Path, timeout: float) -> tuple[int, float]:
    """Run cmd with output to log; returns (exit code, wall seconds)."""
    t0 = time.perf_counter()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env=child_env(), timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            code = -1
            f.write(f"\n[bench] timed out after {timeout:.0f}s\n")
    return code, time.perf_counter() - t0


def tail(path: Path, n: int = 15) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join("    " + line for line in lines[-n:])


def stalwart_rate(run_dir: Path, exclude: int, tokens_per_step: int) -> dict[str, Any]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    by_step = {r["step"]: r for r in rows}
    if exclude not in by_step:
        raise ValueError(f"no metrics row at step {exclude} in {run_dir / 'metrics.jsonl'}")
    last = rows[-1]
    first = by_step[exclude]
    window = last["time"] - first["time"]
    steps = last["step"] - first["step"]
    worlds = {r["world_size"] for r in rows}
    # Cross-check: the tokens stalwart itself counted over the same rows (tokens_per_s is
    # rounded to 0.1, so this agrees to a fraction of a token per second).
    counted, prev = 0.0, first
    for r in rows:
        if r["step"] > exclude:
            counted += r["tokens_per_s"] * (r["time"] - prev["time"])
            prev = r
    return {
        "tokens_per_s": steps * tokens_per_step / window,
        "window_s": window,
        "measured_steps": steps,
        "tokens_counted_by_stalwart": round(counted),
        "world_sizes": sorted(worlds),
        "loss_by_step": {str(r["step"]): r["loss"] for r in rows},
    }


def tokens_per_step(args: argparse.Namespace) -> tuple[int, Any]:
    from stalwart.config import load_config
    from stalwart.task import build_task

    config = load_config(args.config, common_overrides(args))
    task = build_task(config.task.path, config.task.args)
    seq_len = task.model_config.seq_len  # the reference task (GPTTask)
    # Tokenize once up front, so no run pays for it (it is outside the window anyway).
    task.prepare_data(config)
    return config.train.global_batch_size * seq_len, config


def one_run(runner: str, args: argparse.Namespace, work: Path, rnd: int,
            tps: int) -> dict[str, Any]:
    tag = f"r{rnd}-{runner}"
    log = work / f"{tag}.log"
    load = os.getloadavg()[0]
    if runner == "torchrun-ddp":
        out = work / f"{tag}.json"
        code, wall = run_logged(torchrun_command(args, out), log, args.timeout)
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
        code, wall = run_logged(stalwart_command(args, run_dir, layout), log, args.timeout)
        result = {"runner": runner, "round": rnd, "exit_code": code, "wall_s": wall,
                  "load_before": load, "log": str(log), "run_dir": str(run_dir)}
        if code == 0:
            try:
                result.update(stalwart_rate(run_dir, args.exclude, tps))
            except (OSError, ValueError, KeyError, IndexError) as exc:
                result["error"] = f"{type(exc).__name__}: {exc}"
    if "tokens_per_s" not in result:
        result.setdefault("error", f"exit code {code}")
        print(f"  {tag}: FAILED ({result['error']}); last lines of {log}:\n{tail(log)}",
              flush=True)
    else:
        print(f"  {tag}: {result['tokens_per_s']:9,.0f} tokens/s  (window "
              f"{result['window_s']:.1f}s, whole run {wall:.1f}s, load {load:.2f})", flush=True)
    return result


def max_loss_diff(a: dict[str, float], b: dict[str, float]) -> float | None:
    common = sorted(set(a) & set(b), key=int)
    return max((abs(a[s] - b[s]) for s in common), default=None)


def fmt(x: float | None, spec: str = "9,.0f") -> str:
    return format(x, spec) if x is not None else "        -"


def main() -> int:
    args = parse_args()
    runners = [r for r in RUNNERS if not (args.no_fsdp and r == "stalwart-fsdp")]
    tps, config = tokens_per_step(args)
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-"))
    print(f"throughput: {args.rounds} round(s) x {runners}, {args.steps} steps each "
          f"(first {args.exclude} excluded), {tps} tokens/step, {WORKERS} workers, "
          f"{os.cpu_count()} CPUs; logs in {work}", flush=True)

    results: list[dict[str, Any]] = []
    try:
        for rnd in range(args.rounds):
            order = runners if rnd % 2 == 0 else runners[::-1]
            print(f"round {rnd + 1}/{args.rounds}: {' -> '.join(order)}", flush=True)
            for runner in order:
                results.append(one_run(runner, args, work, rnd, tps))
    finally:
        if not args.keep:
            # Keep the logs of failed runs, which the output points to; drop the rest.
            if all("tokens_per_s" in r for r in results):
                shutil.rmtree(work, ignore_errors=True)
                for r in results:  # the paths are gone: do not point the JSON at them
                    r.pop("log", None)
                    r.pop("run_dir", None)

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
        diffs = [max_loss_diff(a["loss_by_step"], b["loss_by_step"])
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

    import ray
    import torch

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
            "rounds": args.rounds, "steps": args.steps, "excluded_steps": args.exclude,
            "log_every": args.log_every, "workers": WORKERS, "tokens_per_step": tps,
            "config": args.config, "overrides": common_overrides(args),
            "ddp_layout": DDP_LAYOUT, "global_batch_size": config.train.global_batch_size,
            "micro_batch_size": config.train.micro_batch_size,
            "grad_accum": config.grad_accum_steps,
        },
        "machine": {
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "ray": ray.__version__,
        },
        "runs": [{k: v for k, v in r.items() if k != "loss_by_step"} for r in results],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if ratio_ddp is not None else 1


if __name__ == "__main__":
    sys.exit(main())
