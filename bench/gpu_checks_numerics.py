"""A check of bench/gpu_check.py on one rank, in this process: what the numerical checks cost.

The engine's step time with [numerics] off, with the NaN check alone (the default), and with
the NaN check plus a fingerprint of the parameters and optimizer state every step, in
alternating rounds. No snapshots: their cost is the snapshot check's, so the ratio is the
checks' own. One rank has no replica to compare with, but its fingerprint costs the same.
"""

from __future__ import annotations

from typing import Any

from bench.gpu_checks_base import (
    Ctx,
    build_engine,
    engine_step,
    free_memory,
    job_config,
    row,
    timed,
)
from stalwart.report.summary import median

TARGET = 0.98
# Each variant's [numerics] overrides, the first the baseline.
VARIANTS = {
    "off": ["numerics.nan_check=false"],
    "nan": [],
    "nan+fingerprint": ["numerics.fingerprint_every=1"],
}


def numerics(ctx: Ctx) -> dict[str, Any]:
    runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
    finite = True
    for rnd in range(ctx.rounds):
        names = list(VARIANTS) if rnd % 2 == 0 else list(VARIANTS)[::-1]
        for name in names:
            # The engine alone takes no snapshot (its worker does): none is taken here.
            config = job_config(ctx, ctx.sizes.model, *VARIANTS[name])
            out = timed(engine_step(build_engine(ctx, config)), ctx.device,
                        warmup=ctx.sizes.warmup, steps=ctx.sizes.steps)
            runs[name].append(out["step_s"])
            finite &= out["loss_finite"]
            free_memory(ctx.device)
    step_s = {name: median(times) for name, times in runs.items()}
    speed = {name: step_s["off"] / s for name, s in step_s.items()}
    worst = min(speed["nan"], speed["nan+fingerprint"])
    return row("numerics", figures={
        "step_s": step_s, "step_s_by_round": runs, "tokens_per_s_over_off": speed,
        "loss_finite": finite, "model": ctx.sizes.model.describe(),
        "variants": {k: v or ["defaults"] for k, v in VARIANTS.items()}},
        goal=f"tokens/s with the checks >= {TARGET} x off", met=worst >= TARGET,
        summary=f"off {step_s['off'] * 1e3:.1f} ms/step; nan check "
                f"{speed['nan']:.3f}x, + fingerprint every step "
                f"{speed['nan+fingerprint']:.3f}x")
