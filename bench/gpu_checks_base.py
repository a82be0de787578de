"""What the checks of bench/gpu_check.py share: the model sizes, the context a check is given,
its result row, a one-rank TrainEngine built as a worker builds it, timed steps, and the FLOPs
behind MFU."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.common import DEFAULT_CONFIG

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig
    from stalwart.workers.engine import TrainEngine

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by a part of the CUDA device name.
# First match wins, so a more specific name comes before a shorter one it contains.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0),
    ("A100", 312.0), ("L40S", 362.0), ("L4", 121.0))
FLOPS_FORMULA = "6 N + 12 L d T (N parameters, L layers, d d_model, T seq_len)"


@dataclass(frozen=True, kw_only=True)
class Model:
    """A shape of the reference GPT (examples/gpt), as its task.args."""

    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int

    def overrides(self) -> list[str]:
        return [f"task.args.{k}={v}" for k, v in vars(self).items()]

    def describe(self) -> str:
        return (f"d_model {self.d_model}, {self.n_layers} layers, {self.n_heads} heads, "
                f"seq_len {self.seq_len}")


@dataclass(frozen=True, kw_only=True)
class Sizes:
    """How big every check's model and batch is, and how many steps it times."""

    model: Model
    """The model of the throughput, snapshot and feature checks."""
    micro_batch: int
    accum: int
    """Micro-batches per optimizer step (global batch = micro_batch x accum on one rank)."""
    warmup: int
    steps: int
    """Steps timed after the warm-up."""
    memory_models: tuple[Model, ...]
    memory_micro_batch: int
    ray_overrides: tuple[str, ...]
    """The model of the `stalwart run` checks, on top of the reference config."""

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accum


# About 125M parameters: the byte vocabulary (256) leaves GPT-2 small's 12 layers at 85M.
GPU = Sizes(model=Model(d_model=768, n_layers=18, n_heads=12, seq_len=1024),
            micro_batch=16, accum=2, warmup=3, steps=20,
            memory_models=(Model(d_model=512, n_layers=8, n_heads=8, seq_len=1024),
                           Model(d_model=768, n_layers=12, n_heads=12, seq_len=1024),
                           Model(d_model=1024, n_layers=16, n_heads=16, seq_len=1024)),
            memory_micro_batch=8, ray_overrides=())
SMALL = Sizes(model=Model(d_model=64, n_layers=2, n_heads=2, seq_len=64),
              micro_batch=2, accum=2, warmup=3, steps=4,
              memory_models=(Model(d_model=64, n_layers=2, n_heads=2, seq_len=64),
                             Model(d_model=128, n_layers=2, n_heads=4, seq_len=64),
                             Model(d_model=128, n_layers=4, n_heads=4, seq_len=128)),
              memory_micro_batch=2,
              ray_overrides=("task.args.seq_len=64", "task.args.d_model=64",
                             "task.args.n_layers=2", "task.args.n_heads=2",
                             "train.global_batch_size=8", "train.micro_batch_size=2"))


@dataclass(kw_only=True)
class Ctx:
    """What every check is given."""

    device: torch.device
    sizes: Sizes
    precision: str
    """bf16 or fp32: parallel.mixed_precision of every engine, autocast of the plain loops."""
    peak_tflops: float | None
    peak_source: str
    cache_dir: str
    work: Path
    """A scratch folder for run directories and the one-rank world's file store."""
    rounds: int
    timeout_s: float
    """The most a `stalwart run` may take."""
    deadline: float
    """time.monotonic() when the checks' time budget is spent."""
    keep: bool
    shared: dict[str, Any] = field(default_factory=dict)
    """Figures one check leaves for a later one (the engine's plain step time)."""

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def run_timeout(self) -> float:
        """A run's timeout, cut to the budget left (at least a minute): the whole command
        must end within the time it was given."""
        return min(self.timeout_s, max(60.0, self.deadline - time.monotonic()))


def row(name: str, *, figures: dict[str, Any], goal: str | None = None,
        met: bool | None = None, summary: str = "") -> dict[str, Any]:
    """A check's result: its figures, its goal and whether they meet it (None: no goal)."""
    return {"name": name, "goal": goal, "met": met, "summary": summary, "figures": figures}


def skipped(name: str, why: str) -> dict[str, Any]:
    return {"name": name, "skipped": why}


def job_config(ctx: Ctx, model: Model, *extra: str, micro_batch: int | None = None,
               accum: int | None = None) -> JobConfig:
    """The reference config on one rank of this device, at `model`'s size."""
    from stalwart.core.config import load_config

    mb = micro_batch or ctx.sizes.micro_batch
    return load_config(DEFAULT_CONFIG, [
        *model.overrides(), f"train.micro_batch_size={mb}",
        f"train.global_batch_size={mb * (accum or ctx.sizes.accum)}", "train.steps=1000",
        "train.warmup_steps=10", "scaling.num_workers=1", "scaling.spare_workers=0",
        f"scaling.gpus_per_worker={1 if ctx.cuda else 0}", "parallel.dp_replicate=1",
        "parallel.dp_shard=-1", f"parallel.mixed_precision={ctx.precision}",
        f"data.cache_dir={ctx.cache_dir}", *extra])


def build_task(config: JobConfig) -> Any:
    from stalwart.core.task import build_task as build

    task = build(config.task.path, config.task.args)
    task.prepare_data(config)
    return task


def build_engine(ctx: Ctx, config: JobConfig) -> TrainEngine:
    """Rank 0 of the one-rank world, built as a worker builds its engine."""
    from stalwart.workers.engine import TrainEngine

    return TrainEngine(config, build_task(config), rank=0, world_size=1, device=ctx.device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    """Let what the last check built go (FSDP2 modules sit in reference cycles)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def timed(step: Callable[[], float], device: torch.device, *, warmup: int,
          steps: int) -> dict[str, Any]:
    """Run `step` (it returns the step's loss) warmup + steps times; time the last `steps`."""
    losses = [step() for _ in range(warmup)]
    sync(device)
    t0 = time.perf_counter()
    losses += [step() for _ in range(steps)]
    sync(device)
    elapsed = time.perf_counter() - t0
    return {"step_s": elapsed / steps, "losses": losses,
            "loss_finite": all(math.isfinite(x) for x in losses)}


def engine_step(engine: TrainEngine, **hooks: Any) -> Callable[[], float]:
    def step() -> float:
        report, _ = engine.train_step(**hooks)
        return report.loss
    return step


def n_params(model: torch.nn.Module) -> int:
    """Unique parameters; a tied embedding and output head count once, as in their matmul."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def flops_per_token(params: int, model: Model) -> int:
    """Training FLOPs per token (PaLM, appendix B): 6 N for the matmuls of forward and
    backward, and 12 L d T for attention's scores and weighted sum over the full T x T."""
    return 6 * params + 12 * model.n_layers * model.d_model * model.seq_len


def peak_tflops(device: torch.device, precision: str,
                given: float | None) -> tuple[float | None, str]:
    """The device's peak TFLOP/s for MFU and where it came from (None: not known)."""
    if given is not None:
        return given, "--peak-tflops"
    if device.type != "cuda":
        return None, "not known on CPU (give --peak-tflops)"
    name = torch.cuda.get_device_name(device)
    if precision != "bf16":
        return None, f"the table holds bf16 peaks only; {precision} needs --peak-tflops"
    for part, tflops in PEAK_BF16_TFLOPS:
        if part in name:
            return tflops, f"dense bf16 peak of {part} (table in bench/gpu_checks_base.py)"
    return None, f"{name!r} is not in the table of peaks (give --peak-tflops)"


def mfu(tokens_per_s: float, flops: int, ctx: Ctx) -> float | None:
    return tokens_per_s * flops / (ctx.peak_tflops * 1e12) if ctx.peak_tflops else None
