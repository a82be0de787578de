"""What the benchmarks share: timing `stalwart run` (throughput.py, layouts.py), the machine
a report was measured on, and step logs that several processes append to.

throughput.py and layouts.py run `stalwart run CONFIG --set ...` as a user types it, one run
after another, and measure the steady-state rate from the run's metrics.jsonl: the same
command line, child environment, logging, rate window, options, checks and report layout.
Each script keeps only what is its own (its runners or layouts, its overrides, its table).

The scripts import it as `from bench import common`, run from the repository root as
`python -m bench.NAME`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "examples" / "gpt" / "config.toml"


def add_window_args(p: argparse.ArgumentParser, *, rounds: int, rounds_of: str,
                    steps: int) -> None:
    """--rounds, --steps, --exclude and --log-every: how many runs, and which steps count."""
    p.add_argument("--rounds", type=int, default=rounds,
                   help=f"rounds of all {rounds_of} (default {rounds})")
    p.add_argument("--steps", type=int, default=steps,
                   help=f"optimizer steps per run (default {steps})")
    p.add_argument("--exclude", type=int, default=10,
                   help="warm-up steps left out of the rate (default 10; a multiple of "
                        "--log-every)")
    p.add_argument("--log-every", type=int, default=5, help="stalwart run.log_every (default 5)")


def parse_bench_args(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Adds --timeout and --keep (every bench's last options), parses, checks the window."""
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


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # every stalwart run starts its own embedded Ray
    env["PYTHONUNBUFFERED"] = "1"
    return env


def stalwart_command(config: str, overrides: list[str], run_dir: Path) -> list[str]:
    """`stalwart run config --set o ... --run-dir run_dir`, one --set per override."""
    exe = Path(sys.executable).with_name("stalwart")
    cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "stalwart.cli.main"]
    sets = [x for o in overrides for x in ("--set", o)]
    return [*cli, "run", config, *sets, "--run-dir", str(run_dir)]


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


def tail(path: Path, n: int = 15, indent: str = "") -> str:
    """The last n lines of a log, each prefixed with indent."""
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(indent + line for line in lines[-n:])


def stalwart_rate(run_dir: Path, exclude: int, tokens_per_step: int, *,
                  cross_check: bool = False, final: bool = False) -> dict[str, Any]:
    """Steady-state tokens/s of a run: steps exclude+1.. over the time between those rows.

    cross_check adds tokens_counted_by_stalwart (the tokens stalwart itself counted over the
    window); final adds last_step and final_loss.
    """
    from stalwart.core.events import read_metrics

    rows = read_metrics(run_dir / "metrics.jsonl")
    by_step = {r.step: r for r in rows}
    if exclude not in by_step:
        raise ValueError(f"no metrics row at step {exclude} in {run_dir / 'metrics.jsonl'}")
    last, first = rows[-1], by_step[exclude]
    window = last.time - first.time
    steps = last.step - first.step
    if steps < 1 or window <= 0:
        raise ValueError(f"empty window: steps {first.step}..{last.step}")
    rate: dict[str, Any] = {
        "tokens_per_s": steps * tokens_per_step / window,
        "window_s": window,
        "measured_steps": steps,
    }
    if cross_check:
        # tokens_per_s is rounded to 0.1, so this agrees to a fraction of a token per second.
        counted, prev = 0.0, first
        for r in rows:
            if r.step > exclude:
                counted += r.tokens_per_s * (r.time - prev.time)
                prev = r
        rate["tokens_counted_by_stalwart"] = round(counted)
    if final:
        rate["last_step"] = last.step
        rate["final_loss"] = last.loss
    rate["world_sizes"] = sorted({r.world_size for r in rows})
    rate["loss_by_step"] = {str(r.step): r.loss for r in rows}
    return rate


def tokens_per_step(config_path: str, overrides: list[str]) -> tuple[int, Any]:
    """(tokens per optimizer step, the loaded config); tokenizes the data once up front."""
    from stalwart.core.config import load_config
    from stalwart.core.task import build_task

    config = load_config(config_path, overrides)
    task = build_task(config.task.path, config.task.args)
    seq_len = task.model_config.seq_len  # the reference task (GPTTask)
    # Tokenize once up front, so no run pays for it (it is outside the window anyway).
    task.prepare_data(config)
    return config.train.global_batch_size * seq_len, config


def run_rounds(names: list[str], rounds: int, run: Callable[[str, int], dict[str, Any]], *,
               work: Path, keep: bool, prune_measured: bool) -> list[dict[str, Any]]:
    """run(name, round) for every name, every round, the order flipping every round.

    Unless keep: the work folder goes if every run was measured, and the results no longer
    point into it; with prune_measured, the run folder and log of each measured run go even
    when another run failed (the failed ones' stay, for their logs).
    """
    results: list[dict[str, Any]] = []
    try:
        for rnd in range(rounds):
            # The order flips every round, so a drift in machine load favours no runner.
            order = names if rnd % 2 == 0 else names[::-1]
            print(f"round {rnd + 1}/{rounds}: {' -> '.join(order)}", flush=True)
            for name in order:
                results.append(run(name, rnd))
    finally:
        if not keep:
            # Keep the logs of failed runs, which the output points to; drop the rest.
            if prune_measured:
                for r in results:
                    if "tokens_per_s" in r:
                        shutil.rmtree(r.pop("run_dir"), ignore_errors=True)
                        Path(r.pop("log")).unlink(missing_ok=True)
            if all("tokens_per_s" in r for r in results):
                shutil.rmtree(work, ignore_errors=True)
                for r in results:  # the paths are gone: do not point the JSON at them
                    r.pop("log", None)
                    r.pop("run_dir", None)
    return results


def max_loss_diff(a: dict[str, float], b: dict[str, float]) -> float | None:
    common = sorted(set(a) & set(b), key=int)
    return max((abs(a[s] - b[s]) for s in common), default=None)


def fmt(x: float | None, spec: str = "9,.0f", missing: str | None = None) -> str:
    """x formatted by spec; None as missing (default: "-" right-aligned to spec's width)."""
    if x is not None:
        return format(x, spec)
    if missing is not None:
        return missing
    width = "".join(c for c in spec.split(",")[0].split(".")[0] if c.isdigit())
    return "-".rjust(int(width or 1))


def window_settings(args: argparse.Namespace, workers: int, tps: int,
                    overrides: list[str]) -> dict[str, Any]:
    """The settings every report starts with."""
    return {
        "rounds": args.rounds, "steps": args.steps, "excluded_steps": args.exclude,
        "log_every": args.log_every, "workers": workers, "tokens_per_step": tps,
        "config": args.config, "overrides": overrides,
    }


def machine(*, with_ray: bool = True) -> dict[str, Any]:
    """The machine and versions a report was measured with."""
    import torch

    out = {"cpus": os.cpu_count(), "platform": platform.platform(),
           "python": platform.python_version(), "torch": torch.__version__}
    if with_ray:
        import ray

        out["ray"] = ray.__version__
    return out


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """One JSON line, in one small O_APPEND write: lines that several processes append to the
    same file never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, (json.dumps(row) + "\n").encode())
    finally:
        os.close(fd)


def write_report(path: str, report: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """Adds the machine and the runs (without their loss curves) to report; writes it."""
    report["machine"] = machine()
    report["runs"] = [{k: v for k, v in r.items() if k != "loss_by_step"} for r in results]
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
