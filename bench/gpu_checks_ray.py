"""The checks of bench/gpu_check.py that need Ray: `stalwart run` as a user types it, with a
worker SIGKILLed by `--inject kill`, on one GPU (one rank and a warm spare sharing it) and on
two or more (NCCL, two ranks), and an FSDP2 x TP layout on two or more GPUs. Ray is imported
here only, inside the checks: the other checks run without it."""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any

import torch

from bench import common, harness
from bench.gpu_checks_base import Ctx, row, skipped

STEPS, KILL_STEP, PERSIST_EVERY = 30, 20, 10
TP_STEPS, TP_EXCLUDE = 20, 5
RUN = [f"train.steps={STEPS}", f"checkpoint.persist_every={PERSIST_EVERY}", "run.log_every=1",
       "data.val_every=0", "run.progress=false", "failure.max_failures=3"]
# One rank has no peer to hold its snapshot: a kill restores the last storage checkpoint, and
# the steps since it are trained again.
LOST_BOUND_ONE_RANK = (KILL_STEP - 1) % PERSIST_EVERY


def ray_missing() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError as exc:
        return f"Ray not installed ({exc})"
    return None


def recovery(ctx: Ctx) -> dict[str, Any]:
    if why := ray_missing():
        return skipped("recovery", why)
    # NCCL takes one rank per GPU in a communicator, so no second rank on this GPU: one rank,
    # and a warm spare that shares its GPU (half a GPU each) to replace it.
    gpus = ["scaling.gpus_per_worker=0.5"] if ctx.cuda else []
    out = _kill_run(ctx, "recovery-1rank", [
        "scaling.num_workers=1", "scaling.spare_workers=1", *gpus], rank=0)
    met = out["finished"] and out["lost_steps"] is not None \
        and out["lost_steps"] <= LOST_BOUND_ONE_RANK
    return row("recovery", figures=out, met=met,
               goal=f"finishes; lost steps <= {LOST_BOUND_ONE_RANK} (one rank: since the last "
                    f"storage checkpoint)", summary=_kill_summary(out))


def multi_gpu(ctx: Ctx) -> dict[str, Any]:
    gpus = torch.cuda.device_count() if ctx.cuda else 0
    if ctx.cuda and gpus < 2:
        return skipped("multi_gpu", f"needs 2 or more GPUs (NCCL: one rank per GPU); this "
                                    f"machine has {gpus}")
    if why := ray_missing():
        return skipped("multi_gpu", why)
    # On --cpu the same runs on 2 gloo workers: the check's own code stays exercised.
    per_gpu = ["scaling.gpus_per_worker=1"] if ctx.cuda else []
    spare = 1 if gpus >= 3 or not ctx.cuda else 0
    kill = _kill_run(ctx, "recovery-2ranks", [
        "scaling.num_workers=2", f"scaling.spare_workers={spare}", *per_gpu], rank=1)
    world = 4 if gpus >= 4 else 2
    layout = _tp_run(ctx, world, per_gpu)
    kill_ok = kill["finished"] and kill["lost_steps"] == 0
    backend = "NCCL" if ctx.cuda else "gloo"
    return row("multi_gpu", figures={"backend": backend, "gpus": gpus, "kill_2_ranks": kill,
                                     "fsdp2_x_tp": layout},
               goal="2 ranks: a kill loses 0 steps; FSDP2 x TP trains, loss finite",
               met=kill_ok and layout["ran"] == "yes",
               summary=f"{backend} kill: {_kill_summary(kill)}; {layout['layout']}: "
                       + (f"{layout['tokens_per_s']:,.0f} tok/s" if layout["ran"] == "yes"
                          else f"did not run ({layout.get('failure', '')[:60]})"))


def _overrides(ctx: Ctx, extra: list[str]) -> list[str]:
    return [*ctx.sizes.ray_overrides, *RUN, f"data.cache_dir={ctx.cache_dir}", *extra]


def _kill_run(ctx: Ctx, tag: str, extra: list[str], *, rank: int) -> dict[str, Any]:
    """`stalwart run --inject kill:rank=R,step=20`: the figures of its recovery, from its run
    directory as bench/recovery.py reads them."""
    from bench.recovery_rows import analyse_stalwart

    run_dir, log = ctx.work / tag, ctx.work / f"{tag}.log"
    overrides = _overrides(ctx, extra)
    cmd = [*common.stalwart_command(str(common.DEFAULT_CONFIG), overrides, run_dir),
           "--inject", f"kill:rank={rank},step={KILL_STEP}"]
    code, wall = harness.run_watched(cmd, log, ctx.run_timeout())
    seen = analyse_stalwart(run_dir, "kill", memory_tier=True)
    steps = harness.measure_kill(harness.stalwart_steps(run_dir), seen["fault_time"])
    out = {"overrides": overrides, "inject": f"kill:rank={rank},step={KILL_STEP}",
           "exit_code": code, "wall_s": wall, "finished": code == 0 and seen["finished"],
           "kill_to_next_step_s": steps["recovery_s"], "normal_step_s": steps["normal_step_s"],
           **{k: seen[k] for k in ("detection_s", "restart_s", "recovery_s", "lost_steps",
                                   "source", "restored_from_step", "phases", "missing_events")}}
    if not out["finished"]:
        out["log_tail"] = common.tail(log, 25)
    _drop(ctx, run_dir, log)
    return out


def _tp_run(ctx: Ctx, world: int, per_gpu: list[str]) -> dict[str, Any]:
    """The reference run on `world` ranks as FSDP2 (dp_shard = world / 2) x TP 2, no fault."""
    sets = [f"scaling.num_workers={world}", "scaling.spare_workers=0", "parallel.tp=2",
            "parallel.dp_replicate=1", "parallel.dp_shard=-1", *per_gpu]
    overrides = [*_overrides(ctx, sets), f"train.steps={TP_STEPS}"]
    run_dir, log = ctx.work / "fsdp-tp", ctx.work / "fsdp-tp.log"
    name = f"dp_shard={world // 2} x tp=2"
    code, wall = harness.run_watched(
        common.stalwart_command(str(common.DEFAULT_CONFIG), overrides, run_dir), log,
        ctx.run_timeout())
    out: dict[str, Any] = {"layout": name, "overrides": overrides, "exit_code": code,
                           "wall_s": wall, "ran": "no"}
    try:
        if code != 0:
            raise RuntimeError(f"exit code {code}")
        tokens, _ = common.tokens_per_step(str(common.DEFAULT_CONFIG), overrides)
        rate = common.stalwart_rate(run_dir, TP_EXCLUDE, tokens, final=True)
        loss = rate["final_loss"]
        out.update(ran="yes" if math.isfinite(loss) else "no",
                   tokens_per_s=rate["tokens_per_s"], final_loss=loss,
                   world_sizes=rate["world_sizes"])
    except (RuntimeError, OSError, ValueError, KeyError) as exc:
        out.update(failure=f"{type(exc).__name__}: {exc}", log_tail=common.tail(log, 25))
    _drop(ctx, run_dir, log)
    return out


def _kill_summary(out: dict[str, Any]) -> str:
    if not out["finished"]:
        return f"did not finish (exit {out['exit_code']}; missing {out['missing_events']})"
    nxt = out["kill_to_next_step_s"]
    return (f"kill -> next step {'-' if nxt is None else f'{nxt:.2f}'} s (a step "
            f"{common.fmt(out['normal_step_s'], '.3f')} s), {out['lost_steps']} steps lost, "
            f"restored from {out['source']}")


def _drop(ctx: Ctx, run_dir: Path, log: Path) -> None:
    if not ctx.keep:
        shutil.rmtree(run_dir, ignore_errors=True)
        log.unlink(missing_ok=True)
