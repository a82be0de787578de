"""GPU check: stalwart on one CUDA device, in one command. It measures the engine's tokens/s and
MFU against plain PyTorch, what snapshots and the numerical checks cost, FSDP2 offload, compile and activation
checkpointing, the memory estimate, and the recovery of a SIGKILLed worker.

Each check is a function that returns its rows (figures, goal, met); one that fails is recorded
with its error and the others go on. The checks that need no Ray run in this process on a
one-rank world (NCCL on a GPU, gloo with --cpu); the Ray ones run `stalwart run`. With --cpu the
same checks run on CPU (CI keeps the script working); --small makes every model tiny.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

try:
    from bench import common
except ModuleNotFoundError as exc:  # run as a file: bench/ is on the path, the root is not
    if exc.name != "bench":
        raise
    sys.exit("run it from the repository root as: python -m bench.gpu_check [flags]")
from bench import gpu_checks_features as features
from bench import gpu_checks_numerics
from bench import gpu_checks_ray as ray_checks
from bench import gpu_checks_train as train
from bench.gpu_checks_base import GPU, SMALL, Ctx, free_memory, peak_tflops, skipped


@dataclasses.dataclass(frozen=True)
class Check:
    name: str
    rows: tuple[str, ...]
    """The names of the rows it returns (one, or more for a check that reports several)."""
    run: Callable[[Ctx], dict[str, Any] | list[dict[str, Any]]]
    in_world: bool
    """Runs in this process on the one-rank world (else it starts `stalwart run`)."""


CHECKS = (
    Check("throughput", ("throughput",), train.throughput, True),
    Check("snapshot", ("snapshot_overhead", "snapshot_staging"), train.snapshots, True),
    Check("numerics", ("numerics",), gpu_checks_numerics.numerics, True),
    Check("offload", ("offload",), features.offload, True),
    Check("compile", ("compile",), features.compiled, True),
    Check("float8", ("float8",), features.float8, True),
    Check("activation_checkpointing", ("activation_checkpointing",),
          features.activation_checkpointing, True),
    Check("memory", ("memory",), features.memory, True),
    Check("recovery", ("recovery",), ray_checks.recovery, False),
    Check("multi_gpu", ("multi_gpu",), ray_checks.multi_gpu, False),
)
NAMES = [c.name for c in CHECKS]


def parse_args() -> argparse.Namespace:
    p = common.parser(__doc__, __spec__)
    p.add_argument("--json", "--out", dest="json", default=str(common.RESULTS / "gpu_check.json"),
                   help="JSON result file (default bench/results/gpu_check.json)")
    p.add_argument("--cpu", action="store_true", help="run on CPU with gloo (no GPU needed)")
    p.add_argument("--small", action="store_true",
                   help="tiny models and few steps everywhere (seconds on CPU)")
    p.add_argument("--skip", nargs="+", default=[], choices=NAMES, metavar="NAME",
                   help=f"checks to leave out: {', '.join(NAMES)}")
    p.add_argument("--rounds", type=common.positive(), default=2,
                   help="alternating rounds of the timed comparisons; medians (default 2)")
    p.add_argument("--steps", type=common.positive(), help="timed steps per run (default: "
                   f"{GPU.steps}, {SMALL.steps} with --small)")
    p.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                   help="parallel.mixed_precision of the engine, autocast of the plain loops")
    p.add_argument("--peak-tflops", type=common.positive(float),
                   help="the device's peak TFLOP/s for MFU (default: a table of GPUs)")
    p.add_argument("--cache-dir", default="~/.cache/stalwart",
                   help="data.cache_dir: where the tokenized data is kept")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds per `stalwart run`")
    p.add_argument("--budget", type=float, default=450.0,
                   help="seconds for all checks; the checks not started by then are skipped")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    return p.parse_args()


def device_facts(device: torch.device) -> dict[str, Any]:
    if device.type != "cuda":
        return {"type": "cpu"}
    props = torch.cuda.get_device_properties(device)
    nccl = torch.cuda.nccl.version()
    return {"type": "cuda", "name": props.name, "count": torch.cuda.device_count(),
            "memory_bytes": props.total_memory, "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)}


@contextlib.contextmanager
def one_rank_world(ctx: Ctx) -> Iterator[None]:
    """A world of this process alone, as a worker of a one-rank run joins it."""
    import torch.distributed as dist

    from stalwart.parallel.distributed import backend_for, destroy_process_group

    # device_id: NCCL's communicator is made now (a world that cannot form fails here).
    dist.init_process_group(backend_for(ctx.device), init_method=f"file://{ctx.work}/store",
                            rank=0, world_size=1,
                            device_id=ctx.device if ctx.cuda else None)
    try:
        yield
    finally:
        destroy_process_group()


def run_check(check: Check, ctx: Ctx, skip: list[str]) -> list[dict[str, Any]]:
    """The check's rows; skipped ones, or one row per name with the error, otherwise."""
    if check.name in skip:
        return [skipped(name, "--skip") for name in check.rows]
    if time.monotonic() > ctx.deadline:
        return [skipped(name, "the time budget (--budget) was spent") for name in check.rows]
    print(f"[{check.name}] running", flush=True)
    t0 = time.monotonic()
    try:
        out = check.run(ctx)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        rows = [{"name": name, "error": error, "traceback": traceback.format_exc()}
                for name in check.rows]
        print(traceback.format_exc(), flush=True)
    else:
        rows = out if isinstance(out, list) else [out]
    finally:
        free_memory(ctx.device)
    for r in rows:
        r["seconds"] = round(time.monotonic() - t0, 1)
        print(f"[{check.name}] {r['name']}: {status(r)} ({r['seconds']} s): {said(r)}",
              flush=True)
    return rows


def run_all(ctx: Ctx, skip: list[str]) -> Iterator[list[dict[str, Any]]]:
    """Each check's rows as it ends: first those in this process's world, then the others."""
    in_world = [c for c in CHECKS if c.in_world]
    done: set[str] = set()
    try:
        with one_rank_world(ctx):
            for check in in_world:
                yield run_check(check, ctx, skip)
                done.add(check.name)
    except Exception as exc:  # the world itself did not form (or not leave): say so per check
        yield [{"name": name, "error": f"the one-rank world failed: {type(exc).__name__}: "
                f"{exc}"} for c in in_world if c.name not in done for name in c.rows]
    for check in CHECKS:
        if not check.in_world:
            yield run_check(check, ctx, skip)


def status(r: dict[str, Any]) -> str:
    if "error" in r:
        return "ERROR"
    if "skipped" in r:
        return "skipped"
    return {True: "met", False: "NOT met", None: "ran"}[r["met"]]


def said(r: dict[str, Any]) -> str:
    """A row's figures in a line; why it was skipped; its error's first line."""
    if "error" in r:
        return r["error"].splitlines()[0]
    return r.get("skipped") or r["summary"]


def print_table(rows: list[dict[str, Any]]) -> None:
    table = [("check", "result", "figures", "goal")] + [
        (r["name"], status(r), said(r), r.get("goal") or "") for r in rows]
    widths = [max(len(t[i]) for t in table) for i in range(3)]
    print()
    for t in table:
        print("  ".join(c.ljust(w) for c, w in zip(t[:3], widths, strict=True)) + "  " + t[3])


def print_flops(rows: list[dict[str, Any]]) -> None:
    """MFU's arithmetic, with its numbers."""
    got = next((r for r in rows if r["name"] == "throughput" and "figures" in r), None)
    if got is None:
        return
    f = got["figures"]
    m = f["model"]
    print(f"\nMFU = tokens/s x FLOPs per token / peak. FLOPs per token = {f['flops_formula']} "
          f"= {f['flops_per_token']:,} for {f['params']:,} parameters ({m}); peak "
          + (f"{f['peak_tflops']:g} TFLOP/s ({f['peak_source']})" if f["peak_tflops"]
             else f"unknown: {f['peak_source']}"))


def main() -> int:
    args = parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}); nothing to check. "
              "--cpu runs the checks on CPU.")
        return 0
    from stalwart.parallel.distributed import pick_device

    device = pick_device(not args.cpu)
    sizes = SMALL if args.small else GPU
    if args.steps:
        sizes = dataclasses.replace(sizes, steps=args.steps)
    peak, source = peak_tflops(device, args.precision, args.peak_tflops)
    facts = device_facts(device)
    print(f"gpu_check on {facts.get('name', 'CPU')} (torch {torch.__version__}, "
          f"{args.precision}); model {sizes.model.describe()}, skipping {args.skip or 'none'}",
          flush=True)
    work = Path(tempfile.mkdtemp(prefix="stalwart-gpu-check-"))
    ctx = Ctx(device=device, sizes=sizes, precision=args.precision, peak_tflops=peak,
              peak_source=source, cache_dir=args.cache_dir, work=work, rounds=args.rounds,
              timeout_s=args.timeout, deadline=time.monotonic() + args.budget, keep=args.keep)
    report = {"bench": "gpu_check", "time": time.time(),
              "device": {**facts, "peak_tflops": peak, "peak_source": source},
              "settings": {"small": args.small, "precision": args.precision,
                           "rounds": args.rounds, "sizes": dataclasses.asdict(sizes),
                           "skip": args.skip, "budget_s": args.budget},
              "checks": [], "complete": False, "machine": common.machine(with_ray=False)}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    try:
        for rows in run_all(ctx, args.skip):
            report["checks"] += rows
            # Written after every check: a command cut short still leaves what it measured.
            common.write_atomic(Path(args.json), lambda f: json.dump(report, f, indent=1))
    finally:
        if args.keep:
            print(f"run directories kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    print_table(report["checks"])
    print_flops(report["checks"])
    report.update(complete=True, machine=common.machine(with_ray=ray_checks.ray_missing() is None))
    common.write_json(args.json, report)
    return 1 if any("error" in r for r in report["checks"]) else 0


if __name__ == "__main__":
    sys.exit(main())
