"""Memory: measured per-rank bytes of model state under FSDP2 ZeRO-3 against the ZeRO formula.

For each world size N (default 1, 2, 4) it spawns N gloo processes on this machine, builds the
example GPT (d_model 256, 8 blocks, seq_len 128: big enough that FSDP2's per-tensor rounding of
shards is small), shards it with stalwart's own data-parallel recipe (dp_shard = N,
reshard_after_forward = True, fp32) and runs one real training step with AdamW (foreach=False).
Then each rank counts the bytes of the LOCAL shards it holds: every parameter
(`DTensor.to_local()`), every gradient, and every optimizer state tensor (exp_avg, exp_avg_sq,
step). N = 1 is stalwart's single-rank layout, the model unwrapped.

    python -m bench.memory [--worlds 1 2 4] [--out bench/results/memory.json]

Target: the busiest rank's parameters + gradients + optimizer state are within 10% of the
ZeRO formula for fp32 AdamW, 16 x params / N (4 params + 4 grads + 8 for m and v). The table
also shows stalwart.plan.estimate.estimate for the same layout. Exit code 0 whether or not
the target is met (a measurement); 1 only if a rank failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

from bench.common import machine

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "bench" / "results" / "memory.json"
TARGET = 0.10
MODEL = {"vocab_size": 256, "seq_len": 128, "d_model": 256, "n_layers": 8, "n_heads": 4}
MICRO_BATCH = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4],
                   help="world sizes to measure (default 1 2 4)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON result file")
    args = p.parse_args()
    if any(n < 1 for n in args.worlds):
        p.error("--worlds must all be >= 1")
    return args


def _nbytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank
    return local.numel() * local.element_size()


def measure_rank(rank: int, world: int) -> dict[str, int]:
    """One training step on this rank, then the bytes of what it keeps, by kind."""
    import torch.nn.functional as F

    from stalwart.core.config import ParallelConfig
    from stalwart.examples.gpt.model import GPT, GPTConfig
    from stalwart.parallel.data_parallel import apply_data_parallel
    from stalwart.parallel.dims import ParallelDims

    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    model = GPT(cfg)
    # ZeRO-3 over every rank: the mesh and wrapping a stalwart worker builds for this config.
    parallel = ParallelConfig(dp_replicate=1, dp_shard=-1, reshard_after_forward=True)
    mesh = ParallelDims.from_config(parallel, world).build_mesh("cpu")
    model = apply_data_parallel(model, mesh, parallel)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    gen = torch.Generator().manual_seed(rank)  # each rank its own micro-batch, as in training
    tokens = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len + 1), generator=gen)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()  # creates the optimizer state; grads are kept (no zero_grad) to count

    params = list(model.parameters())
    counts = {"params": sum(_nbytes(p) for p in params),
              "grads": sum(_nbytes(p.grad) for p in params if p.grad is not None),
              "exp_avg": 0, "exp_avg_sq": 0, "step": 0}
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                counts[key] = counts.get(key, 0) + _nbytes(value)
    counts["optimizer"] = counts["exp_avg"] + counts["exp_avg_sq"] + counts["step"]
    counts["total"] = counts["params"] + counts["grads"] + counts["optimizer"]
    return counts


def _entry(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # N processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        result: Any = {"ok": measure_rank(rank, world)}
    except BaseException:
        result = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(result))


def run_world(world: int) -> list[dict[str, int]]:
    import torch.multiprocessing as mp

    from stalwart.parallel.distributed import free_port

    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(world, free_port(), out_dir), nprocs=world,
                           join=True, start_method="spawn")
        results = [json.loads(Path(out_dir, f"{r}.json").read_text()) for r in range(world)]
    for rank, result in enumerate(results):
        if "error" in result:
            raise RuntimeError(f"world {world}, rank {rank} failed:\n{result['error']}")
    return [r["ok"] for r in results]


def main() -> int:
    args = parse_args()
    from stalwart.examples.gpt.task import GPTTask
    from stalwart.plan.estimate import ModelShape, PlanLayout, estimate

    shape = ModelShape.from_task(GPTTask(**MODEL), None)
    rows = []
    for world in args.worlds:
        try:
            per_rank = run_world(world)
        except RuntimeError as exc:
            print(exc, file=sys.stderr)
            return 1
        busiest = max(per_rank, key=lambda c: c["total"])
        formula = 16 * shape.n_params / world
        est = estimate(shape, PlanLayout(dp_shard=world, zero3=True)).state
        rows.append({
            "world": world, "per_rank": per_rank, "max_rank": busiest,
            # every shard counted once: the shards must add up to the whole model
            "params_all_ranks": sum(c["params"] for c in per_rank),
            "formula_bytes": formula, "ratio": busiest["total"] / formula,
            "estimate_bytes": est, "estimate_ratio": busiest["total"] / est,
            "within_target": abs(busiest["total"] / formula - 1) <= TARGET,
        })

    mib = 2**20
    head = ["N", "params MiB", "grads MiB", "optim MiB", "total MiB", "16P/N MiB",
            "ratio", "estimate MiB", "vs estimate", "within 10%"]
    table = [head] + [[
        str(r["world"]), *(f"{r['max_rank'][k] / mib:.3f}" for k in ("params", "grads",
                                                                      "optimizer", "total")),
        f"{r['formula_bytes'] / mib:.3f}", f"{r['ratio']:.5f}", f"{r['estimate_bytes'] / mib:.3f}",
        f"{r['estimate_ratio']:.5f}", "yes" if r["within_target"] else "NO"] for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    print(f"GPT {MODEL}: {shape.n_params:,} parameters; FSDP2 ZeRO-3, fp32, AdamW; bytes of "
          f"the busiest rank after one step")
    for row in table:
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
    for r in rows:
        if r["params_all_ranks"] != 4 * shape.n_params:
            print(f"warning: N={r['world']}: parameter shards add up to "
                  f"{r['params_all_ranks']:,} bytes, not 4 x {shape.n_params:,}")
    met = all(r["within_target"] for r in rows)
    print(f"target: within {TARGET:.0%} of 16 x params / N: {'met' if met else 'NOT met'}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "model": {**MODEL, "n_params": shape.n_params}, "micro_batch": MICRO_BATCH,
        "layout": "FSDP2 ZeRO-3 (dp_shard = N), fp32, AdamW foreach=False",
        "target": TARGET, "target_met": met, "results": rows,
        "machine": machine(with_ray=False),
    }, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
