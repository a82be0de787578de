"""Which layouts can train a model on N devices of a given memory, and which one to use.

A layout is dp_replicate x dp_shard x cp x tp x pp = devices (TorchTitan's ParallelDims).
`valid_layouts` enumerates every factorization the model can be split by,
`plan` estimates each one's per-rank memory (stalwart/plan/estimate.py), and `recommend` picks one
by a fixed rule, documented on `preference`. Pure arithmetic: runs on the driver, or on a
laptop planning for a cluster it is not on. With a config, `runnable_check` leaves out every
layout a run of it would refuse before start, so the plan never lists one that cannot train.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from stalwart.core.errors import ConfigError, TaskError
from stalwart.plan.estimate import MemoryEstimate, ModelShape, PlanError, PlanLayout, estimate

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig

# The share of a device the estimate leaves out (CUDA context, fragmentation, workspaces):
# a layout chosen for speed over memory must leave it free.
HEADROOM = 0.10

LayoutCheck = Callable[[PlanLayout], "str | None"]
"""Why a layout cannot run (one line), or None when it can."""


class NoLayoutFits(PlanError):
    """Every layout's estimate exceeds the device memory; names the smallest estimate."""


class Candidate(NamedTuple):
    layout: PlanLayout
    estimate: MemoryEstimate
    fits: bool
    """The estimate's device bytes are at most the device memory (a lower bound check when
    the estimate is not complete)."""
    roomy: bool = False
    """Unsharded, and fits with HEADROOM to spare: the fastest data-parallel layout (see
    `preference`)."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def valid_layouts(devices: int, shape: ModelShape, options: PlanLayout | None = None, *,
                  max_tp: int | None = None) -> list[PlanLayout]:
    """Every (dp_replicate, dp_shard, cp, tp, pp) with product `devices` that `shape` allows.

    tp must divide the attention heads (when known) and stay <= max_tp (the devices of one
    node: tensor parallelism needs the fastest links); pp must be <= the blocks (when known;
    uneven stages are allowed); cp > 1 needs a known sequence length that 2 x cp divides
    (it only splits activations, which are unknown without it), and no pipeline. `options`
    supplies everything but the five degrees.
    """
    if devices < 1:
        raise PlanError(f"devices must be >= 1, got {devices}")
    options = options or PlanLayout()
    layouts = []
    for tp in divisors(devices):
        if shape.n_heads is not None and shape.n_heads % tp:
            continue
        if max_tp is not None and tp > max_tp:
            continue
        for pp in divisors(devices // tp):
            if shape.n_layers is not None and pp > shape.n_layers:
                continue
            for cp in divisors(devices // (tp * pp)):
                if cp > 1 and (pp > 1 or shape.seq_len is None or shape.seq_len % (2 * cp)):
                    continue
                dp = devices // (tp * pp * cp)
                for shard in divisors(dp):
                    for ep in _expert_degrees(shape, shard, tp * cp * pp):
                        layouts.append(dataclasses.replace(
                            options, dp_replicate=dp // shard, dp_shard=shard, cp=cp, tp=tp,
                            pp=pp, ep=ep))
    return layouts


def _expert_degrees(shape: ModelShape, shard: int, model_parallel: int) -> list[int]:
    """The ep an MoE model can take over `shard` ranks: those dividing both the shard ranks
    and the experts, without other model parallelism; 1 for a dense model."""
    if shape.n_experts is None or model_parallel > 1:
        return [1]
    return [ep for ep in divisors(shard) if shape.n_experts % ep == 0]


def runnable_check(config: JobConfig) -> LayoutCheck:
    """The checks a run of `config` makes before start, for any layout and world: the
    [parallel] and batch rules of the config and the task's `check_layout`."""
    from stalwart.core.task import build_task
    from stalwart.parallel.dims import ParallelDims

    task = build_task(config.task.path, config.task.args)

    def check(layout: PlanLayout) -> str | None:
        try:
            parallel = dataclasses.replace(config.parallel, **layout.degrees())
            # The layout's own world, fixed (no shrinking or growing) and without faults
            # (their ranks belong to the config's world).
            scaling = dataclasses.replace(config.scaling, num_workers=layout.devices,
                                          min_workers=0, max_workers=0)
            dataclasses.replace(config, parallel=parallel, scaling=scaling, faults=())
            task.check_layout(ParallelDims.from_config(parallel, layout.devices))
        except (ConfigError, TaskError) as exc:
            return str(exc)
        return None

    return check


def preference(candidate: Candidate) -> tuple[int, ...]:
    """Sort key of the recommendation rule, best first: speed among the layouts that fit.

    1. a layout that fits;
    2. the least model parallelism (tp x cp x pp): it adds communication inside every layer
       or a pipeline bubble, while data parallelism only adds a gradient reduction per step,
       so the most data parallel layout usually has the best throughput;
    3. at the same degree, tensor before context before pipeline parallelism (lower pp,
       then lower cp): tp stays inside a node on fast links and splits the parameters too,
       cp splits only the activations, pp pays a bubble of (pp - 1) / microbatches; then
       the least expert parallelism (two all-to-alls per MoE layer);
    4. unsharded (dp_shard = 1: DDP, whole replicas) when it leaves HEADROOM of the device
       free by a complete estimate: sharding gathers every block's parameters in forward
       and again in backward, on top of the gradient reduction DDP makes too, so a model
       whose replicas fit trains faster unsharded. Sharding is for memory, not speed;
    5. otherwise the lowest device memory: headroom for a larger micro-batch and for
       fragmentation (among data-parallel splits this picks the widest sharding);
    6. the layout itself, so that the order is total and the same on every run.
    """
    layout = candidate.layout
    return (not candidate.fits, layout.tp * layout.cp * layout.pp, layout.pp, layout.cp,
            layout.ep, not candidate.roomy, candidate.estimate.device, layout.dp_replicate,
            layout.dp_shard, layout.tp, layout.pp)


def roomy(layout: PlanLayout, est: MemoryEstimate, memory_bytes: int) -> bool:
    """An unsharded layout whose complete estimate leaves HEADROOM of the device free."""
    return (layout.fsdp_degree == 1 and est.complete
            and est.device <= (1 - HEADROOM) * memory_bytes)


def plan(shape: ModelShape, devices: int, memory_bytes: int, options: PlanLayout | None = None, *,
         max_tp: int | None = None, check: LayoutCheck | None = None) -> list[Candidate]:
    """Every valid layout with its estimate and whether it fits, best first (`preference`);
    the layouts `check` refuses are left out (see `refused`)."""
    if memory_bytes <= 0:
        raise PlanError(f"device memory must be > 0 bytes, got {memory_bytes}")
    candidates = []
    layouts = valid_layouts(devices, shape, options, max_tp=max_tp)
    left_out = refused(layouts, check)
    if layouts and len(left_out) == len(layouts):
        layout, why = left_out[0]
        raise PlanError(f"no layout of {devices} device{'s' if devices != 1 else ''} can run "
                        f"this config; {layout.describe()}: {why}")
    skip = {layout for layout, _ in left_out}
    for layout in layouts:
        if layout in skip:
            continue
        est = estimate(shape, layout)
        candidates.append(Candidate(layout, est, est.device <= memory_bytes,
                                    roomy(layout, est, memory_bytes)))
    return sorted(candidates, key=preference)


def refused(layouts: list[PlanLayout], check: LayoutCheck | None
            ) -> list[tuple[PlanLayout, str]]:
    """The layouts `check` refuses, each with why."""
    out = []
    for layout in layouts if check is not None else []:
        why = check(layout)
        if why is not None:
            out.append((layout, why))
    return out


def recommend(candidates: list[Candidate], memory_bytes: int) -> Candidate:
    """The best candidate that fits; NoLayoutFits naming the smallest estimate otherwise."""
    if not candidates:
        raise PlanError("no layout to choose from")
    fitting = [c for c in candidates if c.fits]
    if fitting:
        return min(fitting, key=preference)
    smallest = min(candidates, key=lambda c: (c.estimate.device, preference(c)))
    layout, devices = smallest.layout, smallest.layout.devices
    # The model state of the whole layout: every shard once (replicas hold copies).
    state = smallest.estimate.state * (devices // layout.dp_replicate)
    need = math.ceil(state / memory_bytes)
    bound = "" if smallest.estimate.complete else " (a lower bound: parts are unknown)"
    raise NoLayoutFits(
        f"no layout of {devices} device{'s' if devices != 1 else ''} fits in "
        f"{format_bytes(memory_bytes)} per device: the smallest estimate is "
        f"{format_bytes(smallest.estimate.device)} per device{bound} with "
        f"{layout.describe()}; the parameters, gradients and optimizer state alone "
        f"take {format_bytes(state)}, at least {need} devices of this size")


def why_recommended(best: Candidate) -> str:
    """One line: why the rule of `preference` chose `best`."""
    layout = best.layout
    model = ("" if layout.tp * layout.cp * layout.pp == 1
             else "the least model parallelism that fits; ")
    free = f"{HEADROOM:.0%} of the device free"
    if best.roomy:
        return (f"{model}unsharded: it leaves {free}, and sharding would add a gather of "
                f"every block's parameters in forward and again in backward")
    if layout.dp_shard == 1:
        return f"{model}it fits, but leaves less than {free}: a tight fit"
    if not best.estimate.complete:
        return (f"{model}sharded, the least memory: the activations are unknown (give the "
                f"shape flags), so no unsharded layout is known to leave {free}")
    return f"{model}sharded, the least memory: no unsharded layout leaves {free}"


def format_bytes(n: float) -> str:
    """Binary units with three significant digits: 512 B, 12.4 MiB, 1.30 GiB, 104 GiB."""
    value, unit = float(n), "B"
    for next_unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024:
            break
        value, unit = value / 1024, next_unit
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.2f} {unit}" if value < 10 else (
        f"{value:.1f} {unit}" if value < 100 else f"{value:.0f} {unit}")


def format_plan(candidates: list[Candidate], *, shape: ModelShape, source: str, devices: int,
                memory_bytes: int, options: PlanLayout,
                configured: dict[str, int] | None = None,
                left_out: list[tuple[PlanLayout, str]] = (),
                memory_source: str | None = None) -> str:
    """The plan as plain aligned text: a header, one row per layout (best first), notes,
    then the layouts left out because a run would refuse them."""
    o = options
    sizes = ", ".join(f"{name} {value:,}" for name, value in (
        ("blocks", shape.n_layers), ("block params", shape.block_params),
        ("d_model", shape.d_model), ("heads", shape.n_heads), ("seq_len", shape.seq_len),
        ("vocab", shape.vocab_size), ("experts", shape.n_experts)) if value is not None)
    lines = [
        f"model: {shape.n_params:,} parameters ({_count(shape.n_params)})"
        f"{'; ' + sizes if sizes else ''} [{source}]",
        f"devices: {devices} x {format_bytes(memory_bytes)}" + (
            "" if memory_source is None else f" ({memory_source}" + (
                ")" if memory_source == "--memory-gb"
                else "; --memory-gb G plans for other devices)")),
        f"options: micro-batch {o.micro_batch_size}, {o.mixed_precision}, "
        f"reshard_after_forward={o.zero3}, cpu_offload={o.cpu_offload}, "
        f"activation_checkpointing={o.activation_checkpointing}, pipeline {o.pp_schedule} "
        f"over {o.pp_microbatches or 'pp'} micro-batches",
        "",
    ]
    head = ["dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "ZeRO", "params", "grads", "optimizer",
            "buffers", "activations", "total"] + (["host"] if o.cpu_offload else []) + [
            "fits", ""]
    rows = []
    for i, (layout, est, fits, _) in enumerate(candidates):
        notes = (["recommended"] if i == 0 and fits else []) + (
            ["config"] if configured == layout.degrees() else [])
        unknown = "?"
        rows.append([str(layout.dp_replicate), str(layout.dp_shard), str(layout.cp),
                     str(layout.tp), str(layout.pp), str(layout.ep),
                     str(layout.zero_stage),
                     *(format_bytes(b) + (" (host)" if est.offloaded else "")
                       for b in (est.params, est.grads, est.optimizer)),
                     unknown if est.buffers is None else format_bytes(est.buffers),
                     unknown if est.activations is None else format_bytes(est.activations),
                     format_bytes(est.device) + ("" if est.complete else "+")]
                    + ([format_bytes(est.host)] if o.cpu_offload else [])
                    + ["yes" if fits else "no", "<- " + ", ".join(notes) if notes else ""])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for r in [head, *rows]:
        lines.append("  ".join(c.rjust(w) if i < len(head) - 2 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip())
    lines.append("")
    lines += ["total: bytes on the busiest rank (the first pipeline stage); fits: total <= "
              "device memory,", "  with no headroom for the CUDA context or fragmentation "
              "(keep ~10% free)"]
    if not all(c.estimate.complete for c in candidates):
        lines += ["?: unknown for this shape and left out of total (marked +: a lower bound); "
                  "activations", "  need --layers, --heads, --d-model and --seq-len; buffers "
                  "--layers or --d-model"]
    if left_out:
        lines += ["", "left out (a run of this config refuses them before start):"]
        lines += [f"  dp_replicate={lo.dp_replicate} x dp_shard={lo.dp_shard} x cp={lo.cp} x "
                  f"tp={lo.tp} x pp={lo.pp} x ep={lo.ep}: {why}" for lo, why in left_out]
    return "\n".join(lines)


def _count(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)
