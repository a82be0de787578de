"""Two checks of bench/gpu_check.py on one rank, in this process: stalwart's TrainEngine against
plain PyTorch loops on the same model, batch and precision (tokens/s, MFU), and what a snapshot
every step costs (step time; staging bytes per second against a plain copy)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from bench.common import ratio
from bench.gpu_checks_base import (
    FLOPS_FORMULA,
    Ctx,
    build_engine,
    build_task,
    engine_step,
    flops_per_token,
    free_memory,
    job_config,
    mfu,
    row,
    sync,
    timed,
)
from stalwart.plan.search import format_bytes
from stalwart.report.summary import median

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig

TARGET_RATIO = 0.97
TARGET_SNAPSHOT_OVERHEAD = 0.02
TARGET_STAGING_RATIO = 0.9
GB = 1e9
# The engine, then what it is measured against. "plain" is what a user writes for one device:
# autocast (bf16), the task's model, loss, optimizer and schedule, clipping, loss.item() each
# step. The other two say where a gap comes from: FSDP2's mixed precision, as the engine
# applies it to bf16 on one rank, without the engine; and a fused AdamW instead of the
# task's per-tensor loop.
VARIANTS = ("stalwart", "plain", "plain-fsdp2", "plain-fused")
DESCRIBE = {
    "stalwart": "stalwart TrainEngine (one rank; FSDP2 mixed precision under bf16)",
    "plain": "plain loop: autocast, the task's AdamW (foreach=False), clip_grad_norm_",
    "plain-fsdp2": "plain loop over fully_shard with MixedPrecisionPolicy (no engine)",
    "plain-fused": "plain loop, autocast, AdamW(fused=True)",
}


# ---------------------------------------------------------------- throughput and MFU

def throughput(ctx: Ctx) -> dict[str, Any]:
    config = job_config(ctx, ctx.sizes.model)
    tokens = config.train.global_batch_size * ctx.sizes.model.seq_len
    params = _param_count(config)
    flops = flops_per_token(params, ctx.sizes.model)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
    for rnd in range(ctx.rounds):
        for variant in VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]:
            step = engine_step(build_engine(ctx, config)) if variant == "stalwart" \
                else plain_step(ctx, config, variant)
            runs[variant].append(timed(step, ctx.device, warmup=ctx.sizes.warmup,
                                       steps=ctx.sizes.steps))
            del step
            free_memory(ctx.device)
    per = {v: _variant_figures(rs, tokens, flops, ctx) for v, rs in runs.items()}
    ctx.shared["engine_step_s"] = per["stalwart"]["step_s"]
    got = ratio(per["stalwart"]["tokens_per_s"], per["plain"]["tokens_per_s"])
    paired = [tokens / a["step_s"] / (tokens / b["step_s"])
              for a, b in zip(runs["stalwart"], runs["plain"], strict=True)]
    mfu_s = per["stalwart"]["mfu"]
    figures = {
        "model": ctx.sizes.model.describe(), "params": params, "precision": ctx.precision,
        "micro_batch": ctx.sizes.micro_batch, "accum": ctx.sizes.accum,
        "tokens_per_step": tokens, "rounds": ctx.rounds, "timed_steps": ctx.sizes.steps,
        "flops_per_token": flops, "flops_formula": FLOPS_FORMULA,
        "peak_tflops": ctx.peak_tflops, "peak_source": ctx.peak_source,
        "variants": DESCRIBE, "by_variant": per, "stalwart_over_plain": got,
        "paired_stalwart_over_plain": paired,
        "stalwart_over_plain_fsdp2": ratio(per["stalwart"]["tokens_per_s"],
                                           per["plain-fsdp2"]["tokens_per_s"]),
        "plain_fused_over_plain": ratio(per["plain-fused"]["tokens_per_s"],
                                        per["plain"]["tokens_per_s"])}
    return row("throughput", figures=figures, goal=f"stalwart >= {TARGET_RATIO} x plain",
               met=got is not None and got >= TARGET_RATIO,
               summary=f"{per['stalwart']['tokens_per_s']:,.0f} tok/s, MFU "
                       f"{'n/a' if mfu_s is None else f'{mfu_s:.1%}'}; plain "
                       f"{per['plain']['tokens_per_s']:,.0f}: {got:.3f}x")


def _param_count(config: JobConfig) -> int:
    """The model's parameters, counted on the meta device (a tied weight once)."""
    task = build_task(config)
    with torch.device("meta"):
        model = task.build_model(config)
    return sum(p.numel() for p in model.parameters())


def _variant_figures(runs: list[dict[str, Any]], tokens: int, flops: int,
                     ctx: Ctx) -> dict[str, Any]:
    step_s = median([r["step_s"] for r in runs])
    tps = tokens / step_s
    return {"step_s": step_s, "step_s_by_round": [r["step_s"] for r in runs],
            "tokens_per_s": tps, "mfu": mfu(tps, flops, ctx),
            "first_loss": runs[0]["losses"][0], "last_loss": runs[0]["losses"][-1],
            "loss_finite": all(r["loss_finite"] for r in runs)}


def plain_step(ctx: Ctx, config: JobConfig, variant: str) -> Callable[[], float]:
    """One optimizer step of a hand-written loop on the engine's samples; returns its loss."""
    from stalwart.workers.sampler import GlobalSampler

    device, cfg = ctx.device, config.train
    task = build_task(config)
    torch.manual_seed(cfg.seed)
    model = task.build_model(config).to(device)
    task.init_weights(model)
    bf16 = ctx.precision == "bf16"
    fsdp = variant == "plain-fsdp2"
    if fsdp:
        _fully_shard(model, device, bf16)
    optimizer = _fused_adamw(model, config) if variant == "plain-fused" \
        else task.build_optimizer(model, config)
    scheduler = task.build_lr_scheduler(optimizer, config)
    data = task.train_dataset(config)
    sampler = GlobalSampler(len(data), seed=cfg.seed)
    mb, accum = cfg.micro_batch_size, cfg.global_batch_size // cfg.micro_batch_size
    autocast = bf16 and not fsdp  # FSDP2's policy casts the parameters itself
    seen = 0

    def step() -> float:
        nonlocal seen
        items = sampler.items(seen, cfg.global_batch_size)
        total = torch.zeros((), device=device)
        for i in range(accum):
            x, y = data.get_batch(items[i * mb:(i + 1) * mb])
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            if fsdp:
                model.set_requires_gradient_sync(i == accum - 1)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = task.loss(model, x, y) / accum
            loss.backward()
            total += loss.detach()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        seen += cfg.global_batch_size
        return total.item()
    return step


def _fully_shard(model: torch.nn.Module, device: torch.device, bf16: bool) -> None:
    """FSDP2 over the one-rank world: a unit per block, then the root, kept for backward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (1,))
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else MixedPrecisionPolicy())
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def _fused_adamw(model: torch.nn.Module, config: JobConfig) -> torch.optim.Optimizer:
    """The task's AdamW (same groups and hyperparameters), fused into a few kernels."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": config.train.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=config.train.lr, betas=(0.9, 0.95), fused=True)


# ---------------------------------------------------------------- snapshots

def snapshots(ctx: Ctx) -> list[dict[str, Any]]:
    """Steps with a snapshot after each (as the worker takes them) against none, alternately;
    then staging alone against a plain copy of as many bytes."""
    config = job_config(ctx, ctx.sizes.model)
    off: list[float] = []
    on: list[float] = []
    staging: dict[str, Any] = {}
    losses_finite = True
    for rnd in range(ctx.rounds):
        for tiered in (False, True) if rnd % 2 == 0 else (True, False):
            out = _snapshot_run(ctx, config, tiered, measure_staging=not staging)
            (on if tiered else off).append(out["step_s"])
            staging = staging or out.get("staging", {})
            losses_finite &= out["loss_finite"]
            free_memory(ctx.device)
    overhead = median(on) / median(off) - 1
    paired = [a / b - 1 for a, b in zip(on, off, strict=True)]
    return [
        row("snapshot_overhead", figures={
            "step_s_off": off, "step_s_every_step": on, "overhead": overhead,
            "paired_overhead": paired, "snapshot_bytes": staging.get("bytes"),
            "loss_finite": losses_finite, "model": ctx.sizes.model.describe()},
            goal=f"step time +{TARGET_SNAPSHOT_OVERHEAD:.0%} at most",
            met=overhead <= TARGET_SNAPSHOT_OVERHEAD,
            summary=f"{median(off) * 1e3:.1f} -> {median(on) * 1e3:.1f} ms/step: "
                    f"{overhead:+.1%}"),
        _staging_row(ctx, staging)]


def _snapshot_run(ctx: Ctx, config: JobConfig, tiered: bool, *,
                  measure_staging: bool) -> dict[str, Any]:
    from stalwart.checkpointing.memory.tier import MemoryTier

    engine = build_engine(ctx, config)
    if not tiered:
        return timed(engine_step(engine), ctx.device, warmup=ctx.sizes.warmup,
                     steps=ctx.sizes.steps)
    tier = MemoryTier()
    # One rank, no peers (replicas 0): each snapshot is staged and sealed (its CRC32), as a
    # worker of a one-rank world does it.
    tier.join(engine.tier_view(), rank=0, generation=0, nodes=["local"], replicas=0,
              limit_gb=0.0)
    step = engine_step(engine, before_update=tier.wait_copy_done,
                       before_summary=tier.wait_replicated)

    def step_and_snapshot() -> float:
        loss = step()
        tier.snapshot(engine.step)
        return loss
    try:
        # Warm-up: the layout is built at the first snapshot, and again once AdamW's state
        # exists (after the first step).
        out = timed(step_and_snapshot, ctx.device, warmup=ctx.sizes.warmup,
                    steps=ctx.sizes.steps)
        tier.wait_replicated()
        if measure_staging:
            out["staging"] = _stage_alone(ctx, tier, engine.step)
    finally:
        tier.leave()
    return out


def _stage_alone(ctx: Ctx, tier: Any, step: int) -> dict[str, Any]:
    """Seconds to stage one snapshot with nothing else running (the copy done), and to seal
    it; each the median of 3."""
    stage_s, seal_s = [], []
    for _ in range(3):
        sync(ctx.device)
        t0 = time.perf_counter()
        shard = tier.snapshot(step)
        shard.ready()
        t1 = time.perf_counter()
        tier.wait_replicated()
        stage_s.append(t1 - t0)
        seal_s.append(time.perf_counter() - t1)
    nbytes = tier.stager.layout.nbytes
    return {"bytes": nbytes, "stage_s": median(stage_s), "seal_s": median(seal_s),
            "plain_copy_s": _plain_copy_s(ctx, nbytes)}


def _plain_copy_s(ctx: Ctx, nbytes: int) -> float:
    """A plain copy_ of nbytes from one device tensor into pinned host memory (CPU: into
    another host tensor); the median of 3 after one untimed."""
    src = torch.zeros(nbytes, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=ctx.cuda)
    times = []
    for _ in range(4):
        sync(ctx.device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=ctx.cuda)
        sync(ctx.device)
        times.append(time.perf_counter() - t0)
    return median(times[1:])


def _staging_row(ctx: Ctx, staging: dict[str, Any]) -> dict[str, Any]:
    nbytes = staging["bytes"]
    stage, plain = nbytes / staging["stage_s"] / GB, nbytes / staging["plain_copy_s"] / GB
    seal = nbytes / staging["seal_s"] / GB
    into = "pinned host memory" if ctx.cuda else "host memory"
    got = stage / plain
    return row("snapshot_staging", figures={
        **staging, "stage_gb_per_s": stage, "plain_copy_gb_per_s": plain,
        "seal_gb_per_s": seal, "stage_over_plain": got,
        "plain_copy": f"one copy_ of as many bytes into {into}"},
        goal=f"staging >= {TARGET_STAGING_RATIO} x a plain copy_", met=got >= TARGET_STAGING_RATIO,
        summary=f"{format_bytes(nbytes)}: stage {stage:.1f} GB/s, plain copy_ {plain:.1f} GB/s "
                f"({got:.2f}x); seal (CRC32) {seal:.1f} GB/s")
