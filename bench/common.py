"""What the benchmarks share: paths, the tiny model, `stalwart run` as typed, a run's steady rate,
rounds in alternating order, gloo worlds, the machine measured on and the JSON written."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

from stalwart.core.events import read_metrics
from stalwart.report.summary import median

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "examples" / "gpt" / "config.toml"
RESULTS = ROOT / "bench" / "results"
STALWART = Path(sys.executable).with_name("stalwart")  # the CLI, in this venv
# The two-worker layouts of the throughput and overhead benches.
DDP_LAYOUT = ["parallel.dp_replicate=2", "parallel.dp_shard=1"]
FSDP_LAYOUT = ["parallel.dp_replicate=1", "parallel.dp_shard=-1"]
# The tiny GPT of tests/cli_helpers.py: a run takes seconds on 2 CPU cores.
TINY = ["task.args.seq_len=64", "task.args.d_model=64", "task.args.n_layers=2",
        "task.args.n_heads=2", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.warmup_steps=5", "data.val_batches=1"]


def parser(doc: str, spec: Any, out: str | None = None) -> argparse.ArgumentParser:
    """A script's parser, described by its docstring's first paragraph; with `out`, --out."""
    p = argparse.ArgumentParser(prog=f"python -m {spec.name}" if spec else None,
                                description=doc.split("\n\n")[0])
    if out:
        p.add_argument("--out", default=str(RESULTS / out), help=f"JSON result file ({out})")
    return p


def positive(kind: type = int) -> Callable[[str], Any]:
    """An argparse type: a number of `kind` above 0."""
    def parse(text: str) -> Any:
        if (value := kind(text)) <= 0:
            raise argparse.ArgumentTypeError(f"{text} is not above 0")
        return value
    return parse


def add_config_args(p: argparse.ArgumentParser, *, sets: bool = True) -> None:
    """--config and --set: the job, as `stalwart run` takes it."""
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="stalwart TOML config")
    if sets:
        p.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="config override (repeatable)")


def add_run_args(p: argparse.ArgumentParser, timeout: float, rounds: int | None = None) -> None:
    """--timeout and --keep, and --rounds if given its default."""
    if rounds is not None:
        p.add_argument("--rounds", type=positive(), default=rounds,
                       help=f"rounds; medians are reported (default {rounds})")
    p.add_argument("--timeout", type=float, default=timeout, help="seconds allowed per run")
    p.add_argument("--keep", action="store_true", help="keep the temporary run directories")


def window_parser(doc: str, spec: Any, out: str, *, rounds: int, steps: int,
                  exclude: int = 10) -> argparse.ArgumentParser:
    """A rate bench's parser: the runs, which of their steps count, --out, --timeout, --keep."""
    p = parser(doc, spec, out)
    add_config_args(p, sets=False)
    add_run_args(p, 1800.0, rounds)
    p.add_argument("--steps", type=int, default=steps,
                   help=f"optimizer steps per run (default {steps})")
    p.add_argument("--exclude", type=int, default=exclude,
                   help=f"warm-up steps left out of the rate (default {exclude}; a multiple of "
                        f"--log-every)")
    p.add_argument("--log-every", type=int, default=5, help="stalwart run.log_every (default 5)")
    return p


def parse_window(p: argparse.ArgumentParser) -> argparse.Namespace:
    """Parses a window_parser's arguments and checks the window."""
    args = p.parse_args()
    if args.log_every < 1 or args.exclude < 1 or args.exclude % args.log_every:
        p.error("--exclude must be a positive multiple of --log-every (a metrics row must "
                "mark the start of the window)")
    if args.steps <= args.exclude:
        p.error("--steps must be larger than --exclude")
    return args


def window_overrides(args: argparse.Namespace, workers: int) -> list[str]:
    """A rate bench's workers, steps and metrics rows; no validation, only the final checkpoint."""
    return [f"scaling.num_workers={workers}", f"train.steps={args.steps}",
            f"run.log_every={args.log_every}", "data.val_every=0",
            f"checkpoint.persist_every={args.steps + 1}"]


def rate_run(tag: str, cmd: list[str], args: argparse.Namespace, work: Path,
             result: dict[str, Any], measure: Callable[[], dict[str, Any]],
             note: Callable[[dict[str, Any]], str] = lambda r: "") -> dict[str, Any]:
    """Run cmd, logging in work, then `measure()` its rate into result (or its error)."""
    from bench.harness import run_watched

    log, load = work / f"{tag}.log", os.getloadavg()[0]
    code, wall = run_watched(cmd, log, args.timeout)
    result.update(exit_code=code, wall_s=wall, load_before=load, log=str(log))
    try:
        if code != 0:
            raise RuntimeError(f"exit code {code}")
        result.update(measure())
    except (RuntimeError, OSError, ValueError, KeyError, IndexError) as exc:
        result["error"] = (str(exc) if isinstance(exc, RuntimeError)
                           else f"{type(exc).__name__}: {exc}")
        print(f"  {tag}: FAILED ({result['error']}, {wall:.1f}s); last lines of {log}:\n"
              f"{tail(log, indent='    ')}", flush=True)
        return result
    print(f"  {tag}: {result['tokens_per_s']:9,.0f} tokens/s  (window {result['window_s']:.1f}s"
          f", whole run {wall:.1f}s, load {load:.2f}{note(result)})"
          + (f"  WARNING: {result['warning']}" if "warning" in result else ""), flush=True)
    return result


def medians(results: list[dict[str, Any]], key: str, names: list[str]) -> dict[str, float | None]:
    """The median tokens/s of each runner over its measured rounds (None if none was)."""
    return {n: median(r.get("tokens_per_s") for r in results if r[key] == n) for n in names}


def by_round(results: list[dict[str, Any]], key: str) -> dict[tuple[str, int], float]:
    """Each measured run's tokens/s by (its runner's name under `key`, round)."""
    return {(r[key], r["round"]): r["tokens_per_s"] for r in results if "tokens_per_s" in r}


def paired(rates: dict[tuple[str, int], float], a: str, b: str, rounds: int) -> list[float]:
    """a / b in each round that measured both: pairs cancel a shared host's slow drifts."""
    return [p for rnd in range(rounds)
            if (p := ratio(rates.get((a, rnd)), rates.get((b, rnd)))) is not None]


def spread(xs: list[float]) -> str:
    return f"median {median(xs):.3f}, min {min(xs):.3f}, max {max(xs):.3f}"


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # every stalwart run starts its own embedded Ray
    env["PYTHONUNBUFFERED"] = "1"
    return env


def set_args(overrides: list[str]) -> list[str]:
    """One --set per config override, as `stalwart run` and the peers take them."""
    return [x for o in overrides for x in ("--set", o)]


def stalwart_command(config: str, overrides: list[str], run_dir: Path) -> list[str]:
    """`stalwart run config --set o ... --run-dir run_dir`, as a user types it."""
    cli = [str(STALWART)] if STALWART.exists() else [sys.executable, "-m", "stalwart.cli.main"]
    return [*cli, "run", str(config), *set_args(overrides), "--run-dir", str(run_dir)]


def torchrun(module: str, nproc: int, args: list[str], *, max_restarts: int = 0) -> list[str]:
    """`torchrun --standalone` over `python -m module args`, run from the repository root."""
    restarts = ["--max-restarts", str(max_restarts)] if max_restarts else []
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            str(nproc), *restarts, "-m", module, *args]


def tail(path: Path, n: int = 15, indent: str = "") -> str:
    """The last n lines of a log, each prefixed with indent."""
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(indent + line for line in lines[-n:])


def stalwart_rate(run_dir: Path, exclude: int, tokens_per_step: int, *,
                  cross_check: bool = False, final: bool = False) -> dict[str, Any]:
    """Tokens/s of steps exclude+1..; cross_check: the tokens stalwart counted; final: last loss."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    by_step = {r.step: r for r in rows}
    if exclude not in by_step:
        raise ValueError(f"no metrics row at step {exclude} in {run_dir / 'metrics.jsonl'}")
    last, first = rows[-1], by_step[exclude]
    window, steps = last.time - first.time, last.step - first.step
    if steps < 1 or window <= 0:
        raise ValueError(f"empty window: steps {first.step}..{last.step}")
    rate: dict[str, Any] = {"tokens_per_s": steps * tokens_per_step / window,
                            "window_s": window, "measured_steps": steps}
    if cross_check:
        # tokens_per_s is rounded to 0.1, so this agrees to a fraction of a token per second.
        counted, prev = 0.0, first
        for r in rows:
            if r.step > exclude:
                counted += r.tokens_per_s * (r.time - prev.time)
                prev = r
        rate["tokens_counted_by_stalwart"] = round(counted)
    if final:
        rate.update(last_step=last.step, final_loss=last.loss)
    rate["world_sizes"] = sorted({r.world_size for r in rows})
    rate["loss_by_step"] = {str(r.step): r.loss for r in rows}
    return rate


def tokens_per_step(config_path: str, overrides: list[str]) -> tuple[int, Any]:
    """(tokens per step, the config); tokenizes the data first, so no timed run pays for it."""
    from stalwart.core.config import load_config
    from stalwart.core.task import build_task

    config = load_config(config_path, overrides)
    task = build_task(config.task.path, config.task.args)
    task.prepare_data(config)
    return config.train.global_batch_size * task.model_config.seq_len, config


def window_rounds(bench: str, args: argparse.Namespace, names: list[str], workers: int,
                  overrides: list[str], run: Callable[..., dict[str, Any]], *,
                  notes: Iterable[str] = (),
                  prune_measured: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A rate bench's runs: prints what runs (and each of `notes`), then run_rounds of
    run(name, round, args=, work=, tps=, overrides=). (results, the report's settings)."""
    tps, config = tokens_per_step(args.config, overrides)
    work = Path(tempfile.mkdtemp(prefix=f"stalwart-bench-{bench}-"))
    settings = {"rounds": args.rounds, "steps": args.steps, "excluded_steps": args.exclude,
                "log_every": args.log_every, "workers": workers, "tokens_per_step": tps,
                "config": args.config, "overrides": overrides,
                "global_batch_size": config.train.global_batch_size,
                "micro_batch_size": config.train.micro_batch_size,
                "grad_accum": config.grad_accum_steps}
    print(f"{bench}: {args.rounds} round(s) x {names}, {args.steps} steps each (first "
          f"{args.exclude} excluded), {tps} tokens/step (global batch "
          f"{config.train.global_batch_size}, micro-batch {config.train.micro_batch_size}), "
          f"{workers} workers, {os.cpu_count()} CPUs; logs in {work}",
          f"  every run: {' '.join(overrides)}", *notes, sep="\n", flush=True)
    results = run_rounds(names, args.rounds, partial(run, args=args, work=work, tps=tps,
                                                     overrides=overrides),
                         work=work, keep=args.keep, prune_measured=prune_measured)
    return results, settings


def run_rounds(names: list[str], rounds: int, run: Callable[[str, int], dict[str, Any]], *,
               work: Path, keep: bool, prune_measured: bool) -> list[dict[str, Any]]:
    """run(name, round) for all, the order flipping every round so load drifts favour no one."""
    results: list[dict[str, Any]] = []
    try:
        for rnd in range(rounds):
            order = names if rnd % 2 == 0 else names[::-1]
            print(f"round {rnd + 1}/{rounds}: {' -> '.join(order)}", flush=True)
            results += [run(name, rnd) for name in order]
    finally:
        if not keep:
            for r in results:
                if prune_measured and "tokens_per_s" in r:
                    shutil.rmtree(r.pop("run_dir"), ignore_errors=True)
                    Path(r.pop("log")).unlink(missing_ok=True)
            if all("tokens_per_s" in r for r in results):
                drop_work(work, results)
    return results


def drop_work(work: Path, results: list[dict[str, Any]]) -> None:
    """The work folder goes, every run's folder and log with it."""
    shutil.rmtree(work, ignore_errors=True)
    for r in results:
        r.pop("log", None)
        r.pop("run_dir", None)


def max_loss_diff(a: dict[str, float], b: dict[str, float]) -> float | None:
    common = sorted(set(a) & set(b), key=int)
    return max((abs(a[s] - b[s]) for s in common), default=None)


def worst_loss_diff(pairs: Iterable[tuple[dict[str, Any], dict[str, Any]]]) -> float | None:
    """The largest loss difference at a step both logged, over pairs of runs (None: none)."""
    return max((d for a, b in pairs
                if (d := max_loss_diff(a["loss_by_step"], b["loss_by_step"])) is not None),
               default=None)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(x: float | None, spec: str = "9,.0f") -> str:
    """x formatted by spec; None as "-" right-aligned to spec's width."""
    width = int("".join(c for c in spec.split(",")[0].split(".")[0] if c.isdigit()) or 1)
    return "-".rjust(width) if x is None else format(x, spec)


def print_columns(table: list[list[str]]) -> None:
    """A table of strings, each column right-aligned to its widest cell."""
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))


def machine(*, with_ray: bool = True) -> dict[str, Any]:
    """The machine and versions a report was measured with."""
    import torch

    out = {"cpus": os.cpu_count(), "platform": platform.platform(),
           "python": platform.python_version(), "torch": torch.__version__}
    return out | ({"ray": importlib.import_module("ray").__version__} if with_ray else {})


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """One JSON line in one O_APPEND write: lines from several processes never interleave."""
    with open(path, "ab", buffering=0) as f:  # unbuffered: one write(2) of the whole line
        f.write((json.dumps(row) + "\n").encode())


def write_atomic(path: Path, write: Callable[[Any], None], mode: str = "w") -> None:
    """Written whole or not at all (temporary file, fsync, rename): no reader sees half of it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json(path: str | Path, data: dict[str, Any]) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")


def write_report(path: str, report: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """Adds the machine and the runs (without their loss curves) to report; writes it."""
    report["machine"] = machine()
    report["runs"] = [{k: v for k, v in r.items() if k != "loss_by_step"} for r in results]
    write_json(path, report)


def gloo_world(fn: Callable[..., Any], world: int, *args: Any) -> list[Any]:
    """fn(rank, world, *args) in `world` gloo processes: results by rank; a failed rank exits."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_gloo_rank, args=(world, out_dir, fn, args),
                           nprocs=world, join=True, start_method="spawn")
        results = [json.loads(Path(out_dir, f"{r}.json").read_text()) for r in range(world)]
    for rank, result in enumerate(results):
        if "error" in result:
            raise SystemExit(f"world {world}, rank {rank} failed:\n{result['error']}")
    return [r["ok"] for r in results]


def _gloo_rank(rank: int, world: int, out_dir: str, fn: Callable[..., Any],
               args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N processes share the machine's cores
    # A file store in the call's own folder: no port to pick, none to lose to another process.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                            world_size=world)
    try:
        result: Any = {"ok": fn(rank, world, *args)}
    except BaseException:
        result = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))
