"""Checks of bench/gpu_check.py that build the engine with one option on (FSDP2 CPU offload,
torch.compile, activation checkpointing, float8 training) and check that a step runs, and the memory
check: `stalwart plan`'s estimate against the device's peak allocation."""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from bench.gpu_checks_base import (
    Ctx,
    build_engine,
    engine_step,
    free_memory,
    job_config,
    row,
    skipped,
    sync,
)

TARGET_MEMORY = 0.10
STEPS_RUNS = "one timed step after the warm-up runs, its loss finite"


def _one_step(ctx: Ctx, *extra: str, warmup: int) -> dict[str, Any]:
    """Build the engine with `extra` on, run `warmup` steps, then time one. A failure of the
    option is the figure (ran: no), not an error of the check."""
    t0 = time.perf_counter()
    try:
        engine = build_engine(ctx, job_config(ctx, ctx.sizes.model, *extra))
        step = engine_step(engine)
        losses = [step() for _ in range(warmup)]
        sync(ctx.device)
        warm = time.perf_counter()
        losses.append(step())
        sync(ctx.device)
        step_s = time.perf_counter() - warm
    except Exception as exc:  # the option failed: that is what this check reports
        return {"ran": "no", "failure": f"{type(exc).__name__}: {exc}",
                "seconds": time.perf_counter() - t0}
    finally:
        engine = step = None
        free_memory(ctx.device)
    out = {"ran": "yes", "step_s": step_s, "warmup_s": warm - t0, "losses": losses,
           "loss_finite": all(math.isfinite(x) for x in losses)}
    if base := ctx.shared.get("engine_step_s"):
        out["vs_engine_step"] = step_s / base  # the throughput check's engine, same batch
    return out


def _said(r: dict[str, Any]) -> str:
    if r["ran"] != "yes":
        return f"did not run ({r['failure'][:80]})"
    versus = f" ({r['vs_engine_step']:.2f}x the plain engine's)" if "vs_engine_step" in r else ""
    return (f"ran, {r['step_s'] * 1e3:.1f} ms/step{versus}, loss "
            f"{'finite' if r['loss_finite'] else 'NOT finite'}")


def _feature_row(name: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    ok = all(r["ran"] == "yes" and r["loss_finite"] for r in runs.values())
    if len(runs) == 1:
        figures, summary = next(iter(runs.values())), _said(next(iter(runs.values())))
    else:
        figures, summary = runs, "; ".join(f"{mode}: {_said(r)}" for mode, r in runs.items())
    return row(name, figures=figures, goal=STEPS_RUNS, met=ok, summary=summary)


def offload(ctx: Ctx) -> dict[str, Any]:
    if not ctx.cuda:
        return skipped("offload", "FSDP2 CPU offload needs a CUDA device (parallel.cpu_offload "
                                  "needs GPU workers)")
    return _feature_row("offload", {"cpu_offload": _one_step(
        ctx, "parallel.cpu_offload=true", warmup=1)})


def compiled(ctx: Ctx) -> dict[str, Any]:
    # Two warm-up steps: the first compiles, the second may recompile (the optimizer state
    # and the gradients now exist).
    return _feature_row("compile", {"compile": _one_step(ctx, "parallel.compile=true",
                                                         warmup=2)})


def float8(ctx: Ctx) -> dict[str, Any]:
    from stalwart.parallel.float8 import float8_unsupported

    why = float8_unsupported(ctx.device)
    if why is not None:
        return skipped("float8", f"train.precision = float8 cannot run here: {why}")
    return _feature_row("float8", {"float8": _one_step(ctx, "train.precision=float8",
                                                       warmup=1)})


def activation_checkpointing(ctx: Ctx) -> dict[str, Any]:
    return _feature_row("activation_checkpointing", {
        mode: _one_step(ctx, f"parallel.activation_checkpointing={mode}", warmup=1)
        for mode in ("selective", "full")})


# ---------------------------------------------------------------- memory estimate

def memory(ctx: Ctx) -> dict[str, Any]:
    if not ctx.cuda:
        return skipped("memory", "no CUDA memory statistics on CPU "
                                 "(torch.cuda.max_memory_allocated)")
    sizes = [_measure_memory(ctx, model) for model in ctx.sizes.memory_models]
    ok = all(s["within"] for s in sizes)
    return row("memory", figures={"sizes": sizes, "micro_batch": ctx.sizes.memory_micro_batch,
                                  "precision": ctx.precision,
                                  "measured": "torch.cuda.max_memory_allocated over 3 steps, "
                                              "less what was allocated before the engine"},
               goal=f"estimate within {TARGET_MEMORY:.0%} of the peak", met=ok,
               summary=", ".join(f"{s['params'] / 1e6:.0f}M {s['estimate_over_measured']:.2f}x"
                                 for s in sizes) + " (estimate / peak)")


def _measure_memory(ctx: Ctx, model: Any) -> dict[str, Any]:
    from stalwart.plan.estimate import ModelShape, estimate
    from stalwart.plan.preflight import run_layout

    free_memory(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    before = torch.cuda.memory_allocated(ctx.device)
    config = job_config(ctx, model, micro_batch=ctx.sizes.memory_micro_batch, accum=1)
    engine = build_engine(ctx, config)
    step = engine_step(engine)
    for _ in range(3):  # AdamW's state exists from the first step on
        step()
    sync(ctx.device)
    peak = torch.cuda.max_memory_allocated(ctx.device) - before
    shape = ModelShape.from_task(engine.task, config)
    layout = run_layout(config)
    engine = step = None
    free_memory(ctx.device)
    est = estimate(shape, layout)
    got = est.device / peak
    return {"model": model.describe(), "params": shape.n_params, "layout": layout.describe(),
            "measured_peak_bytes": peak, "estimate_bytes": est.device,
            "estimate_parts": {"params": est.params, "grads": est.grads,
                               "optimizer": est.optimizer, "buffers": est.buffers,
                               "activations": est.activations},
            "estimate_complete": est.complete, "estimate_over_measured": got,
            "within": abs(got - 1) <= TARGET_MEMORY}
