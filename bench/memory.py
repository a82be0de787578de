"""Memory: measured per-rank bytes of model state under FSDP2 ZeRO-3 against the ZeRO formula."""

from __future__ import annotations

import sys
from typing import Any

from bench import common

TARGET = 0.10
MODEL = {"vocab_size": 256, "seq_len": 128, "d_model": 256, "n_layers": 8, "n_heads": 4}
MICRO_BATCH = 2


def _nbytes(t: Any) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor's shard on this rank
    return local.numel() * local.element_size()


def measure_rank(rank: int, world: int) -> dict[str, int]:
    """One training step on this rank, then the bytes of what it keeps, by kind."""
    import torch
    import torch.nn.functional as F

    from stalwart.core.config import ParallelConfig
    from stalwart.examples.gpt.model import GPT, GPTConfig
    from stalwart.parallel.data_parallel import apply_data_parallel
    from stalwart.parallel.dims import ParallelDims

    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    # ZeRO-3 over every rank: the mesh and wrapping a stalwart worker builds for this config.
    parallel = ParallelConfig(dp_replicate=1, dp_shard=-1, reshard_after_forward=True)
    mesh = ParallelDims.from_config(parallel, world).build_mesh("cpu")
    model = apply_data_parallel(GPT(cfg), mesh, parallel)
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


def measure(worlds: list[int], shape: Any) -> list[dict[str, Any]]:
    """Per world size: every rank's counts, the busiest, the formula and the estimate."""
    from stalwart.plan.estimate import PlanLayout, estimate

    rows = []
    for world in worlds:
        per_rank = common.gloo_world(measure_rank, world)
        busiest = max(per_rank, key=lambda c: c["total"])
        formula = 16 * shape.n_params / world
        est = estimate(shape, PlanLayout(dp_shard=world, zero3=True)).state
        rows.append({
            "world": world, "per_rank": per_rank, "max_rank": busiest,
            # every shard counted once: the shards must add up to the whole model
            "params_all_ranks": sum(c["params"] for c in per_rank),
            "formula_bytes": formula, "ratio": busiest["total"] / formula,
            "estimate_bytes": est, "estimate_ratio": busiest["total"] / est,
            "within_target": abs(busiest["total"] / formula - 1) <= TARGET})
    return rows


def print_table(rows: list[dict[str, Any]], n_params: int) -> None:
    mib = 2**20
    head = ["N", "params MiB", "grads MiB", "optim MiB", "total MiB", "16P/N MiB",
            "ratio", "estimate MiB", "vs estimate", "within 10%"]
    table = [head] + [[
        str(r["world"]), *(f"{r['max_rank'][k] / mib:.3f}" for k in ("params", "grads",
                                                                      "optimizer", "total")),
        f"{r['formula_bytes'] / mib:.3f}", f"{r['ratio']:.5f}", f"{r['estimate_bytes'] / mib:.3f}",
        f"{r['estimate_ratio']:.5f}", "yes" if r["within_target"] else "NO"] for r in rows]
    print(f"GPT {MODEL}: {n_params:,} parameters; FSDP2 ZeRO-3, fp32, AdamW; bytes of "
          f"the busiest rank after one step")
    common.print_columns(table)
    for r in rows:
        if r["params_all_ranks"] != 4 * n_params:
            print(f"warning: N={r['world']}: parameter shards add up to "
                  f"{r['params_all_ranks']:,} bytes, not 4 x {n_params:,}")


def main() -> int:
    p = common.parser(__doc__, __spec__, "memory.json")
    p.add_argument("--worlds", type=common.positive(), nargs="+", default=[1, 2, 4],
                   help="world sizes to measure (default 1 2 4)")
    args = p.parse_args()
    from stalwart.examples.gpt.task import GPTTask
    from stalwart.plan.estimate import ModelShape

    shape = ModelShape.from_task(GPTTask(**MODEL), None)
    rows = measure(args.worlds, shape)
    print_table(rows, shape.n_params)
    met = all(r["within_target"] for r in rows)
    print(f"target: within {TARGET:.0%} of 16 x params / N: {'met' if met else 'NOT met'}")
    common.write_json(args.out, {
        "model": {**MODEL, "n_params": shape.n_params}, "micro_batch": MICRO_BATCH,
        "layout": "FSDP2 ZeRO-3 (dp_shard = N), fp32, AdamW foreach=False",
        "target": TARGET, "target_met": met, "results": rows,
        "machine": common.machine(with_ray=False)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
