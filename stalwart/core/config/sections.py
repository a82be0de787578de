"""The config's sections: one frozen dataclass per TOML table, and the [[faults]] tables.

Every section is a frozen, keyword-only dataclass whose fields carry their own docstrings
(docs/configuration.md is generated from them) and whose ``__post_init__`` rejects bad values
with a message that names the field, the value and what is allowed. Checks that span sections
live on JobConfig (job.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from stalwart.core.errors import ConfigError
from stalwart.core.metric_names import is_task_metric

AC_MODES = ("none", "selective", "full")
# checkpoint.snapshot_every's word for an interval the run chooses (checkpointing/snapshot_schedule.py).
SNAPSHOT_AUTO = "auto"
PRECISIONS = ("fp32", "bf16")
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
TRAIN_PRECISIONS = ("default", "float8")
# parallel.grad_compression's values; stalwart/parallel/grad_compression.py implements each.
GRAD_COMPRESSIONS = ("none", "bf16", "fp16", "powersgd")


def _require(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"{name} = {value!r} is invalid: {allowed}")


# The largest duration (a `_s` key): about 31 years. Timeouts end up as int64 nanoseconds
# (threading), milliseconds (Ray, process groups) or a timedelta, and overflow far above it.
MAX_DURATION_S = 1e9
# TOML integers are 64-bit: a larger one would make a config.toml other tools cannot read
# (and overflows torch.manual_seed, numpy and Ray on the workers).
INT_RANGE = (-(2**63), 2**63 - 1)
RAY_RESOURCE_UNIT = 0.0001
# The most CPUs or GPUs one worker may reserve. A worker is one process on one node (with
# int(cpus_per_worker) torch threads), and no node has more; a far larger value would pass
# every check until Ray, which keeps resources in fixed point (units of 0.0001 in an int64)
# and fails with a traceback on the overflow.
MAX_RESOURCE_PER_WORKER = 1024
# The most workers a count may name: far past the largest training runs (tens of thousands of
# GPUs). A count past it would only reach Ray, as the CPUs a local Ray starts with, and fail
# there with a traceback.
MAX_WORKERS = 65536
# The longest run.name, in UTF-8 bytes. The default run dir is `runs/<name>-YYYYmmdd-HHMMSS`:
# the name plus 16 bytes in one file name component, which holds 255 bytes (Linux, macOS).
# 200 leaves room for what tools append to a name (`.tar.gz`, a `-2`).
MAX_RUN_NAME_BYTES = 200
MAX_MEMORY_LIMIT_GB = 2**20  # 1 PiB: more than any worker's node holds


def _check_kinds(section: Any, prefix: str) -> None:
    """The rules every field of a kind follows, whatever its section; each __post_init__
    calls this first, so a new field is covered without a rule of its own.

    A float is finite: TOML's `inf` and `nan` are floats, and `inf` passes every `> 0` check
    (a timeout of inf turns hang detection off without a word). A duration (`_s`) is at most
    MAX_DURATION_S, an integer fits in 64 bits. A string holds no NUL: no path, name or URL
    can, and the OS raises a bare ValueError on one.
    """
    for f in dataclasses.fields(section):
        name, value = f"{prefix}.{f.name}", getattr(section, f.name)
        if f.type in ("float", float) and isinstance(value, int | float):
            _require(math.isfinite(value), name, value, "must be a finite number (not inf "
                                                        "or nan)")
            _require(not f.name.endswith("_s") or value <= MAX_DURATION_S, name, value,
                     f"a duration must be at most {MAX_DURATION_S:g} s")
        if f.type in ("int", int) and isinstance(value, int):
            _require(INT_RANGE[0] <= value <= INT_RANGE[1], name, value,
                     "must fit in 64 bits (TOML's integer range)")
        if isinstance(value, str):
            _require("\0" not in value, name, value, "must not contain a NUL character")


# task.check, from the most tried to nothing (stalwart/task_check.py).
TASK_CHECKS = ("auto", "full", "build", "off")


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    path: str = "stalwart.examples.gpt.task:GPTTask"
    """The TrainTask to run, as `module:attribute` (importable from the current directory or the environment)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments passed to the task's constructor (for GPTTask: any `GPTConfig` field, e.g. `d_model`, `n_layers`, `seq_len`, and `val_fraction`). On this machine's Ray, a model that does not fit the workers' memory by the estimate of `stalwart plan` is refused before start."""
    check: str = "auto"
    """How far the driver tries the task before Ray starts, so a bug in its code fails in seconds with its traceback (docs/tasks.md): `auto` builds the model and, when that is cheap (CPU workers, at most 20M parameters, no `tp`/`pp`, a model not built on the meta device, map-style data readable here), runs two samples forward and backward through the loss on the CPU; `full` runs them whatever the model's size or device; `build` only builds the model (on the meta device); `off` tries nothing. `stalwart submit` goes as far as `build`."""

    def __post_init__(self) -> None:
        _check_kinds(self, "task")
        mod, _, attr = self.path.partition(":")
        _require(bool(mod) and bool(attr), "task.path", self.path,
                 "expected 'module:attribute', e.g. 'stalwart.examples.gpt.task:GPTTask'")
        _require(self.check in TASK_CHECKS, "task.check", self.check,
                 f"allowed: {', '.join(TASK_CHECKS)}")


@dataclass(frozen=True, kw_only=True)
class ScalingConfig:
    num_workers: int = 2
    """Worker actors (= ranks = the world size) the run starts with and returns to after a failure."""
    min_workers: int = 0
    """Fewest workers to keep training on after losing some (the world shrinks to the largest valid size); 0 means `num_workers` (no shrinking)."""
    max_workers: int = 0
    """Most workers to grow to when the cluster has room; 0 means `num_workers` (no growing)."""
    spare_workers: int = 0
    """Warm spares: idle actors started ahead with the task imported and its data prepared; a lost worker is replaced by one in about a second instead of a cold start. Spares are asked for once a world has trained a step (the first world's too): their start does not slow the world's."""
    cpus_per_worker: float = 1.0
    """Ray CPUs reserved for each worker actor (also its torch thread count): from 0.0001 (Ray's smallest unit) to 1024."""
    gpus_per_worker: float = 0.0
    """Ray GPUs reserved for each worker; > 0 trains on CUDA with NCCL, 0 on CPU with gloo. 0, or from 0.0001 to 1024."""
    placement_strategy: str = "PACK"
    """`PACK` (Ray's default: fill nodes) or `SPREAD` (workers over as many nodes as Ray can place them on; a world takes its ranks from the nodes holding the fewest of it first, among the workers warm when it forms: with 2 nodes, 2 workers and a spare, the ranks land on different nodes when all three are warm, but a world formed while the other node's worker still warms up puts both on one). Workers are placed one actor at a time, so the gang strategies (`STRICT_*`) do not apply."""
    start_timeout_s: float = 120.0
    """How long to wait for the cluster to place and set up the workers before failing (and the hang limit before a world's first step)."""
    resize_check_s: float = 10.0
    """How often a run below `max_workers` (or `num_workers` after a shrink) checks for room to grow, and for nodes Ray is draining."""
    wait_for_workers_s: float = 300.0
    """How long a run below `min_workers` after a failure waits for workers to come back before it fails (its checkpoints intact)."""

    @property
    def floor(self) -> int:
        return self.min_workers or self.num_workers

    @property
    def ceiling(self) -> int:
        return self.max_workers or self.num_workers

    def __post_init__(self) -> None:
        _check_kinds(self, "scaling")
        _require(self.num_workers >= 1, "scaling.num_workers", self.num_workers, "must be >= 1")
        _require(0 <= self.min_workers <= self.num_workers, "scaling.min_workers",
                 self.min_workers, f"must be between 1 and scaling.num_workers = "
                                   f"{self.num_workers} (0: no shrinking)")
        _require(self.max_workers == 0 or self.max_workers >= self.num_workers,
                 "scaling.max_workers", self.max_workers,
                 f"must be >= scaling.num_workers = {self.num_workers} (0: no growing)")
        _require(self.spare_workers >= 0, "scaling.spare_workers", self.spare_workers,
                 "must be >= 0")
        for name in ("num_workers", "max_workers", "spare_workers"):
            _require(getattr(self, name) <= MAX_WORKERS, f"scaling.{name}", getattr(self, name),
                     f"must be at most {MAX_WORKERS}")
        # Ray counts resources in units of 0.0001 and refuses a smaller request only when
        # the actor is created, after the run has started.
        _require(self.cpus_per_worker >= RAY_RESOURCE_UNIT, "scaling.cpus_per_worker",
                 self.cpus_per_worker, f"must be >= {RAY_RESOURCE_UNIT} (Ray's smallest unit)")
        _require(self.gpus_per_worker == 0 or self.gpus_per_worker >= RAY_RESOURCE_UNIT,
                 "scaling.gpus_per_worker", self.gpus_per_worker,
                 f"must be 0 (CPU workers) or >= {RAY_RESOURCE_UNIT} (Ray's smallest unit)")
        for name in ("cpus_per_worker", "gpus_per_worker"):
            _require(getattr(self, name) <= MAX_RESOURCE_PER_WORKER, f"scaling.{name}",
                     getattr(self, name), f"must be at most {MAX_RESOURCE_PER_WORKER}: a "
                     f"worker is one process on one node, and no node has more")
        # Workers are placed one actor at a time (an elastic world must be able to lose or
        # gain one), so the gang strategies of a placement group do not apply.
        strategies = ("PACK", "SPREAD")
        _require(self.placement_strategy in strategies, "scaling.placement_strategy",
                 self.placement_strategy, f"one of {', '.join(strategies)}")
        for name in ("start_timeout_s", "resize_check_s", "wait_for_workers_s"):
            _require(getattr(self, name) > 0, f"scaling.{name}", getattr(self, name),
                     "must be > 0")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    dp_replicate: int = 1
    """Data-parallel replicas (DDP when `dp_shard` is 1 and `pp` is 1; the outer dimension of HSDP otherwise); -1 takes every rank `dp_shard` leaves."""
    dp_shard: int = -1
    """Data-parallel sharding degree with FSDP2; -1 takes every rank `dp_replicate` leaves."""
    reshard_after_forward: bool = True
    """FSDP2: free gathered parameters after forward (ZeRO-3) or keep them for backward (ZeRO-2)."""
    tp: int = 1
    """Tensor-parallel degree: each layer's matrices are split over this many ranks by the task's plan (`TrainTask.apply_tensor_parallel`). Must divide the attention heads."""
    cp: int = 1
    """Context-parallel degree: each sequence is split over this many ranks, two mirrored chunks each so that causal attention's work is even, by the task's hook (`TrainTask.apply_context_parallel`); attention all-gathers the keys and values. The sequence length must be a multiple of `2 x cp`. FSDP2 shards over `dp_shard x cp`."""
    ep: int = 1
    """Expert-parallel degree: each MoE layer's experts are split over this many data-parallel ranks by the task's hook (`TrainTask.apply_expert_parallel`), which send tokens to them and back all-to-all. Must divide `dp_shard` and the experts; needs `tp = cp = pp = 1`. Not a dimension of its own: it splits the data-parallel ranks' experts, not the world."""
    pp: int = 1
    """Pipeline-parallel degree: the blocks are cut into stages on this many ranks by the task's split (`TrainTask.split_pipeline`). `pp x dp_replicate x dp_shard x cp x tp = scaling.num_workers`; at least `pp` accumulation micro-batches per step."""
    pp_schedule: str = "1f1b"
    """`gpipe`, `1f1b`, `interleaved_1f1b` (2 stages per rank) or `zero_bubble` (interleaved, with backward split into input and weight gradients; without data parallelism only)."""
    sequence_parallel: bool = True
    """With `tp > 1`, also split the norms and the residual stream along the sequence (less activation memory, same communication volume)."""
    activation_checkpointing: str = "none"
    """Recompute activations in backward: `none`, `selective` (keep matmul and attention outputs, recompute the cheap ops) or `full` (keep only each block's input)."""
    compile: bool = False
    """`torch.compile` each transformer block (inductor; needs a C++ compiler on CPU)."""
    mixed_precision: str = "fp32"
    """`bf16`: FSDP2 computes in bfloat16 with fp32 master weights and fp32 gradient reduction."""
    cpu_offload: bool = False
    """FSDP2 keeps sharded parameters, gradients and optimizer state in host memory (ZeRO-Offload); needs GPU workers."""
    grad_compression: str = "none"
    """Compress the data-parallel gradient reduction: `bf16` or `fp16` (half the bytes: DDP's compression hooks, or FSDP2's reduce dtype), or `powersgd` (DDP's PowerSGD hook: low-rank factors with error feedback, its state checkpointed; replicated data parallelism only)."""
    powersgd_rank: int = 32
    """With `grad_compression = "powersgd"`: the rank of each gradient matrix's approximation (more: closer, more bytes). A matrix is sent whole unless its factors are at most half its size: at width 128, rank 32 leaves square matrices whole."""
    powersgd_start_step: int = 10
    """With `grad_compression = "powersgd"`: plain all-reduce for the steps before this one (PowerSGD's warm-up)."""
    invariant_reduction: bool = False
    """Sum gradients in one fixed order (a pairwise tree over the micro-batches) whatever the data-parallel degree, so a run that resizes ends bit-identical to one that never did. Replicated data parallelism only (`dp_shard = 1`, `tp = pp = 1`, fp32)."""

    def __post_init__(self) -> None:
        _check_kinds(self, "parallel")
        _require(self.dp_replicate == -1 or self.dp_replicate >= 1, "parallel.dp_replicate",
                 self.dp_replicate, "must be >= 1, or -1 for every rank that dp_shard leaves")
        _require(self.dp_shard == -1 or self.dp_shard >= 1, "parallel.dp_shard", self.dp_shard,
                 "must be >= 1, or -1 for every rank that dp_replicate leaves")
        _require(not (self.dp_replicate == -1 and self.dp_shard == -1), "parallel.dp_replicate",
                 self.dp_replicate, "at most one of dp_replicate and dp_shard may be -1")
        _require(self.tp >= 1, "parallel.tp", self.tp, "must be >= 1")
        _require(self.cp >= 1, "parallel.cp", self.cp, "must be >= 1")
        _require(self.ep >= 1, "parallel.ep", self.ep, "must be >= 1")
        _require(self.ep == 1 or (self.tp == 1 and self.cp == 1 and self.pp == 1),
                 "parallel.ep", self.ep, "expert parallelism composes with data parallelism "
                 "only: it needs tp = 1, cp = 1 and pp = 1")
        _require(self.pp >= 1, "parallel.pp", self.pp, "must be >= 1")
        _require(self.pp_schedule in PP_SCHEDULES, "parallel.pp_schedule", self.pp_schedule,
                 f"one of {', '.join(PP_SCHEDULES)}")
        _require(self.activation_checkpointing in AC_MODES, "parallel.activation_checkpointing",
                 self.activation_checkpointing, f"one of {', '.join(AC_MODES)}")
        _require(self.mixed_precision in PRECISIONS, "parallel.mixed_precision",
                 self.mixed_precision, f"one of {', '.join(PRECISIONS)}")
        _require(self.grad_compression in GRAD_COMPRESSIONS, "parallel.grad_compression",
                 self.grad_compression, f"one of {', '.join(GRAD_COMPRESSIONS)}")
        _require(self.grad_compression != "powersgd" or (
            self.dp_shard == 1 and self.tp == 1 and self.pp == 1 and self.cp == 1
            and self.mixed_precision == "fp32" and not self.cpu_offload),
            "parallel.grad_compression", self.grad_compression,
            "powersgd needs replicated data parallelism (DDP): dp_shard = 1, tp = 1, pp = 1, "
            "cp = 1, mixed_precision = fp32, no cpu_offload; bf16 and fp16 work with any layout")
        _require(self.powersgd_rank >= 1, "parallel.powersgd_rank", self.powersgd_rank,
                 "must be >= 1")
        _require(self.powersgd_start_step >= 0, "parallel.powersgd_start_step",
                 self.powersgd_start_step, "must be >= 0")
        _require(not self.invariant_reduction or self.grad_compression == "none",
                 "parallel.invariant_reduction", self.invariant_reduction,
                 f"sums exact gradients in one order; it cannot take parallel.grad_compression "
                 f"= {self.grad_compression}")
        _require(not self.invariant_reduction or (
            self.dp_shard == 1 and self.tp == 1 and self.pp == 1 and self.cp == 1
            and self.ep == 1 and self.mixed_precision == "fp32" and not self.cpu_offload),
            "parallel.invariant_reduction", self.invariant_reduction,
            "needs replicated data parallelism only: dp_shard = 1, tp = 1, pp = 1, cp = 1, ep = 1, "
            "mixed_precision = fp32, no cpu_offload")

    def layout(self, world_size: int) -> dict[str, int]:
        """Every degree of a world of `world_size` ranks, as `resized` events record them."""
        replicate, shard = self.degrees(world_size)
        return {"dp_replicate": replicate, "dp_shard": shard, "cp": self.cp, "tp": self.tp,
                "pp": self.pp, "ep": self.ep}

    def degrees(self, world_size: int) -> tuple[int, int]:
        """(dp_replicate, dp_shard) for a world of `world_size` ranks, with -1 resolved.

        Takes the world size rather than reading scaling.num_workers, because the world a
        layout is built for can differ from the configured one (a resized world). The
        data-parallel dimensions share what the model dimensions leave: world / (tp x cp x pp).
        """
        if world_size % self.tp:
            raise ConfigError(f"parallel.tp = {self.tp} is invalid: must divide the world "
                              f"size {world_size}")
        if world_size % (self.tp * self.cp):
            raise ConfigError(f"parallel.cp = {self.cp} is invalid: tp x cp = "
                              f"{self.tp * self.cp} must divide the world size {world_size}")
        model = self.tp * self.cp * self.pp
        if world_size % model:
            raise ConfigError(f"parallel.pp = {self.pp} is invalid: tp x cp x pp = "
                              f"{model} must divide the world size {world_size}")
        world_size //= model
        fixed = self.dp_shard if self.dp_replicate == -1 else self.dp_replicate
        if world_size % fixed:
            name = "dp_shard" if self.dp_replicate == -1 else "dp_replicate"
            raise ConfigError(f"parallel.{name} = {fixed} is invalid: must divide the world "
                              f"size {world_size}")
        if self.dp_replicate == -1:
            replicate, shard = world_size // self.dp_shard, self.dp_shard
        elif self.dp_shard == -1:
            replicate, shard = self.dp_replicate, world_size // self.dp_replicate
        elif self.dp_replicate * self.dp_shard != world_size:
            raise ConfigError(f"parallel.dp_shard = {self.dp_shard} is invalid: dp_replicate x "
                              f"dp_shard must equal the world size / (tp x cp x pp) = {world_size} "
                              f"(or set one of them to -1)")
        else:
            replicate, shard = self.dp_replicate, self.dp_shard
        if shard % self.ep:
            raise ConfigError(f"parallel.ep = {self.ep} is invalid: must divide dp_shard = "
                              f"{shard} (the experts are split over data-parallel shard ranks)")
        return replicate, shard


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    steps: int = 200
    """Optimizer steps to train for; the LR schedule spans them."""
    global_batch_size: int = 32
    """Sequences per optimizer step over all ranks, constant whatever the world size; a multiple of `micro_batch_size x` data-parallel ranks."""
    micro_batch_size: int = 8
    """Sequences per forward/backward on one rank; gradient accumulation makes up the rest."""
    lr: float = 3e-3
    """Peak learning rate."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to `lr x min_lr_ratio` at the last step."""
    warmup_steps: int = 20
    """Linear warm-up steps before the cosine decay."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (matrices only)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    seed: int = 0
    """Seeds model initialisation and the sample order."""
    precision: str = "default"
    """`default`: as `parallel.mixed_precision` says; `float8`: the linear layers' matmuls in float8 (TorchAO), on CUDA devices with compute capability 8.9 or later only (GPU workers; `pip install 'stalwart[float8]'`)."""

    def __post_init__(self) -> None:
        _check_kinds(self, "train")
        _require(self.precision in TRAIN_PRECISIONS, "train.precision", self.precision,
                 f"one of {', '.join(TRAIN_PRECISIONS)}")
        _require(self.steps >= 1, "train.steps", self.steps, "must be >= 1")
        _require(self.global_batch_size >= 1, "train.global_batch_size",
                 self.global_batch_size, "must be >= 1")
        _require(self.micro_batch_size >= 1, "train.micro_batch_size", self.micro_batch_size,
                 "must be >= 1")
        _require(self.global_batch_size % self.micro_batch_size == 0, "train.global_batch_size",
                 self.global_batch_size,
                 f"must be a multiple of train.micro_batch_size ({self.micro_batch_size})")
        _require(self.lr > 0, "train.lr", self.lr, "must be > 0")
        _require(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", self.min_lr_ratio,
                 "must be in [0, 1]")
        _require(0 <= self.warmup_steps <= self.steps, "train.warmup_steps", self.warmup_steps,
                 f"must be in [0, train.steps={self.steps}]")
        _require(self.weight_decay >= 0, "train.weight_decay", self.weight_decay, "must be >= 0")
        _require(self.grad_clip >= 0, "train.grad_clip", self.grad_clip, "must be >= 0")
        _require(self.seed >= 0, "train.seed", self.seed, "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    storage: str = ""
    """Checkpoint directory, a path or fsspec URL shared by all workers (`file://`, `s3://`, `gs://`, …; the filesystem's fsspec package must be installed); empty means `<run dir>/checkpoints`. A relative path is made absolute against the current directory when the run starts (config.toml records it). A probe file is written and removed before the run starts, so storage that cannot be written is refused up front."""
    persist_every: int = 50
    """Write a storage checkpoint every this many steps (the final step is always written)."""
    keep_last: int = 3
    """Number of recent checkpoints to retain, or zero to retain all."""
    keep_best: int = 0
    """Also retain this many best checkpoints by `best_metric`, however old (0: none)."""
    best_metric: str = "val_loss"
    """What `keep_best` ranks checkpoints by: `loss`, `val_loss`, or a metric the task's loss returns (`accuracy`, `val_accuracy`). A checkpoint's own step must have it: `val_` metrics exist at validation steps only."""
    best_mode: str = "min"
    """`min`: lower `best_metric` is better; `max`: higher is."""
    async_save: bool = True
    """Write checkpoints in the background while training goes on."""
    snapshot_every: int | str = 1
    """Stage a snapshot in CPU memory every this many steps and replicate it to peers (the in-memory tier, restored first after a failure); `0` turns the memory tier off. `"auto"`: the shortest interval whose measured cost (the training thread's staging and waits for the copy and the exchange, and the exchange's CPU time on CPU workers) stays under `snapshot_budget` of the step time, at most `persist_every`; it grows when the link to the peers is slow and shrinks back when it recovers, and each change is a `snapshot_interval` event (docs/memory-tier.md). Not with `numerics.fingerprint_every`."""
    snapshot_budget: float = 0.02
    """With `snapshot_every = "auto"`: the most the in-memory tier may cost, as a fraction of the step time (0.02: 2%), between 0 and 1 (both excluded)."""
    replicas: int = 1
    """Copies of each snapshot on peers, each on another node: how many nodes can be lost at once without losing a step (on one node: other processes)."""
    memory_limit_gb: float = 0.0
    """Most memory the in-memory tier may hold per worker (two snapshots of its shard and of each peer shard it holds); `0`: 40% of the smallest of the worker's cgroup limit (its container or Slurm job), Ray's `memory` resource of the node and the node's RAM, shared among the node's workers (docs/memory-tier.md). Checked at the first snapshot. At most 1048576 (1 PiB)."""

    @property
    def memory_tier(self) -> bool:
        """Whether the in-memory tier is on (`snapshot_every` is an interval > 0, or auto)."""
        return self.snapshot_every == SNAPSHOT_AUTO or self.snapshot_every > 0

    def __post_init__(self) -> None:
        _check_kinds(self, "checkpoint")
        every = self.snapshot_every
        interval = isinstance(every, int) and not isinstance(every, bool)
        _require(every == SNAPSHOT_AUTO or (interval and 0 <= every <= INT_RANGE[1]),
                 "checkpoint.snapshot_every", every,
                 f'an integer >= 0 (0 turns the in-memory tier off) or "{SNAPSHOT_AUTO}" '
                 f"(an interval chosen to keep the tier's cost under snapshot_budget)")
        _require(0 < self.snapshot_budget < 1, "checkpoint.snapshot_budget",
                 self.snapshot_budget, "must be between 0 and 1, both excluded (a fraction "
                 "of the step time: 0.02 is 2%)")
        _require(self.replicas >= 0, "checkpoint.replicas", self.replicas, "must be >= 0")
        _require(self.memory_limit_gb >= 0, "checkpoint.memory_limit_gb", self.memory_limit_gb,
                 "must be >= 0 (0: 40% of the memory the node's workers may use, shared "
                 "among them)")
        # It becomes bytes on the worker (int(GiB x 2^30)): 1e308 overflows there, mid-run.
        _require(self.memory_limit_gb <= MAX_MEMORY_LIMIT_GB, "checkpoint.memory_limit_gb",
                 self.memory_limit_gb, f"must be at most {MAX_MEMORY_LIMIT_GB} (1 PiB per "
                 f"worker)")
        _require(self.persist_every >= 1, "checkpoint.persist_every", self.persist_every,
                 "must be >= 1")
        _require(self.keep_last >= 0, "checkpoint.keep_last", self.keep_last,
                 "must be >= 0 (0 keeps all)")
        _require(self.keep_best >= 0, "checkpoint.keep_best", self.keep_best, "must be >= 0")
        _require(self.best_metric in ("loss", "val_loss") or is_task_metric(self.best_metric),
                 "checkpoint.best_metric", self.best_metric,
                 "loss, val_loss, or the name of a metric the task's loss returns (val_<name> "
                 "for its validation mean)")
        _require(self.best_mode in ("min", "max"), "checkpoint.best_mode", self.best_mode,
                 "min or max")


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    max_failures: int = 0
    """Failures (a dead worker or node, a hang, a failed collective, a worker that cannot start) to recover from in place before the run fails; -1: no limit."""
    retry_user_errors: bool = False
    """Also recover from exceptions raised by the task's code; by default they fail the run at once with the traceback."""
    backoff_s: float = 0.0
    """Pause before the n-th recovery in a row (no step completed in between): `backoff_s x 2^(n-1)`, at most 60 s."""
    hang_timeout_floor_s: float = 5.0
    """A rank is hung after `max(hang_timeout_floor_s, hang_factor x median step time)` without a heartbeat."""
    hang_factor: float = 10.0
    """Multiple of the median step time a rank may go without a heartbeat (see the floor)."""
    stopped_timeout_s: float = 0.5
    """A worker process stopped this long (SIGSTOP: state `T` in /proc, as its node's agent sees it) is hung, without waiting for the heartbeat limit above."""
    node_silent_timeout_s: float = 0.4
    """A node whose agent answers its poll this late while other nodes' agents answer is frozen, powered off or cut off: its ranks are hung (needs ranks on two or more nodes)."""
    collective_timeout_s: float = 300.0
    """Process-group timeout: a collective stuck longer than this raises on the workers (hangs are normally caught sooner by the heartbeat)."""
    straggler_factor: float = 2.0
    """A rank whose local time per step (its work before its first gradient synchronisation) is above this x the other ranks' median is slow; `0` turns straggler detection off."""
    straggler_steps: int = 10
    """Consecutive slow steps that make a rank a straggler (a `straggler` event)."""
    replace_stragglers: bool = False
    """Also replace a straggler as a failure (`failure_kind` `straggler`, counted against `max_failures`), by a warm spare or a new actor."""
    stop_timeout_s: float = 120.0
    """After a stop (Ctrl-C, SIGTERM, `stalwart stop`): seconds to finish the step in flight and commit its checkpoint; past it that checkpoint is abandoned (the previous one stays) and the driver exits all the same. Keep it below the scheduler's grace period (Slurm's `--signal` lead time, a pod's `terminationGracePeriodSeconds`)."""

    def __post_init__(self) -> None:
        _check_kinds(self, "failure")
        _require(self.max_failures >= -1, "failure.max_failures", self.max_failures,
                 "must be >= 0, or -1 for no limit")
        for name in ("hang_timeout_floor_s", "hang_factor", "stopped_timeout_s",
                     "node_silent_timeout_s", "collective_timeout_s", "stop_timeout_s"):
            _require(getattr(self, name) > 0, f"failure.{name}", getattr(self, name),
                     "must be > 0")
        _require(self.backoff_s >= 0, "failure.backoff_s", self.backoff_s, "must be >= 0")
        _require(self.straggler_factor == 0 or self.straggler_factor > 1,
                 "failure.straggler_factor", self.straggler_factor, "must be > 1, or 0 (off)")
        _require(self.straggler_steps >= 1, "failure.straggler_steps", self.straggler_steps,
                 "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    cache_dir: str = "~/.cache/stalwart"
    """Where tasks keep prepared data (tokenized files), shared between runs on a machine. Not empty: leave the key out for the default."""
    val_every: int = 50
    """Compute the validation loss every this many steps (and at the last); 0 disables it."""
    val_batches: int = 4
    """Size of the fixed validation set, in global batches (the same samples for any world size)."""
    prefetch: int = 2
    """Steps of data each rank reads ahead on a background thread; 0 reads on the step's own thread."""
    ledger: bool = False
    """Write which samples each step trained on to `<run dir>/ledger.parquet` (step, epoch, file, row); `stalwart report` checks each sample was trained exactly once per epoch."""
    accept_changed_files: bool = False
    """Resume a streamed dataset whose files changed since the checkpoint (added, removed or rewritten); the order then follows the new file list. Off: such a resume is refused, naming the files."""

    def __post_init__(self) -> None:
        _check_kinds(self, "data")
        _require(0 <= self.prefetch <= 64, "data.prefetch", self.prefetch, "must be 0 to 64")
        _require(bool(self.cache_dir.strip()), "data.cache_dir", self.cache_dir,
                 "must name a directory; leave it unset for the default "
                 f"({DataConfig.cache_dir})")
        _require(self.val_every >= 0, "data.val_every", self.val_every, "must be >= 0")
        _require(self.val_batches >= 1, "data.val_batches", self.val_batches, "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    name: str = "run"
    """Run name; the default run directory is `runs/<name>-<timestamp>`. At most 200 bytes (UTF-8), no `/`."""
    log_every: int = 10
    """Write a `metrics.jsonl` row every this many steps."""
    progress: bool = True
    """Show a live progress bar on a terminal (plain log lines otherwise)."""
    tensorboard: bool = False
    """Also write the metrics and the run's failures, recoveries and resizes as TensorBoard event files under `<run dir>/tensorboard/`; needs `pip install 'stalwart[tensorboard]'`. The same as `"tensorboard"` in `run.loggers`."""
    loggers: list[str] = field(default_factory=list)
    """Experiment trackers that receive the metrics, the resolved config and the run's failures, recoveries and resizes: any of `"tensorboard"`, `"mlflow"` (MLflow's `MLFLOW_TRACKING_URI`, else a file store in `<run dir>/mlruns`; `pip install 'stalwart[mlflow]'`), `"wandb"` (Weights & Biases; an API key, or `WANDB_MODE=offline` without an account, checked before the run starts; `pip install 'stalwart[wandb]'`). A tracker that fails during the run is switched off with a `tracker_failed` event; training goes on. See docs/trackers.md."""
    dashboard: bool = False
    """Start the Ray dashboard with the Ray that `stalwart run` starts on this machine, and collect Ray's metrics (stalwart's own among them, docs/trackers.md); its address is printed at the start. A cluster (`--address`) keeps its own dashboard."""
    profile_steps: list[int] = field(default_factory=list)
    """Trace these steps with the PyTorch profiler on every rank: `[STEP]` or `[FIRST, LAST]` (inclusive), at most `train.steps`; `[]` is off. `--profile 20-22` sets it."""
    auto_resume: bool = False
    """Continue the run in the run directory when it holds a committed checkpoint of this run, start fresh when there is none, refuse a run directory of another run: a retried job (Slurm `--requeue`, a RayJob's `backoffLimit`) goes on where it was. `--auto-resume` sets it."""

    def __post_init__(self) -> None:
        _check_kinds(self, "run")
        _require(bool(self.name) and "/" not in self.name, "run.name", self.name,
                 "must be non-empty and contain no '/'")
        size = len(self.name.encode(errors="surrogatepass"))
        _require(size <= MAX_RUN_NAME_BYTES, "run.name", self.name,
                 f"must be at most {MAX_RUN_NAME_BYTES} bytes in UTF-8, not {size} (the run "
                 f"dir runs/<name>-<timestamp> must fit in a 255-byte file name)")
        _require(self.log_every >= 1, "run.log_every", self.log_every, "must be >= 1")
        for name in self.loggers:
            _require(name in LOGGERS, "run.loggers", self.loggers,
                     f"{name!r} is not one of {', '.join(LOGGERS)}")
        _require(len(set(self.loggers)) == len(self.loggers), "run.loggers", self.loggers,
                 "names a logger twice")
        steps = self.profile_steps
        _require(len(steps) <= 2 and all(s >= 1 for s in steps) and steps == sorted(steps),
                 "run.profile_steps", steps,
                 "[] (off), [STEP] or [FIRST, LAST] with 1 <= FIRST <= LAST")

    @property
    def active_loggers(self) -> tuple[str, ...]:
        """run.loggers, with `tensorboard` when run.tensorboard (its older switch) is on."""
        extra = ("tensorboard",) if self.tensorboard and "tensorboard" not in self.loggers else ()
        return (*self.loggers, *extra)

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """(first, last) step to trace, both included; None when profiling is off."""
        return (self.profile_steps[0], self.profile_steps[-1]) if self.profile_steps else None


LOGGERS = ("tensorboard", "mlflow", "wandb")

class FaultKind(StrEnum):
    """The faults `--inject` and `[[faults]]` can ask for, named here and nowhere else. The
    values are the spellings of the CLI, the TOML and the events."""

    KILL = "kill"
    """SIGKILL the rank's process."""
    KILL_STAGING = "kill-staging"
    """SIGKILL it half-way through staging the step's snapshot."""
    KILL_REPLICATING = "kill-replicating"
    """SIGKILL it while the step's snapshot is sent to its holders."""
    HANG = "hang"
    """SIGSTOP the rank's process: alive, silent, holding its peers."""
    RAISE = "raise"
    """Raise an exception in the rank's training loop (like a user bug)."""
    TERM = "term"
    """SIGTERM the rank's process: a preemption notice."""
    SLOW = "slow"
    """The rank turns straggler: its local work per step takes 3x as long."""
    KILL_NODE = "kill-node"
    """SIGKILL the raylet of a node: the node and its workers are gone."""
    FREEZE_NODE = "freeze-node"
    """SIGSTOP the raylet of a node and its workers: a frozen machine."""
    DRAIN = "drain"
    """Ask Ray to drain a node for preemption (it stays up, unschedulable)."""
    NAN = "nan"
    """The rank's loss of that step becomes NaN, once (a transient numerical fault)."""
    SPIKE = "spike"
    """The loss of that step's batch is scaled up 100x on the rank (rank 0 if none is
    named), each time the batch is trained: a bad batch."""
    BITFLIP = "bitflip"
    """One bit of one parameter flips in the rank's memory at the start of that step: silent
    data corruption."""
    SLOW_LINK = "slow-link"
    """From that step on, the rank sends its snapshots to its peers at `mbps` megabits per
    second at most: a slow network link for the memory tier's replication."""

    @property
    def target(self) -> str:
        """What the fault is done to: `rank` or `node`."""
        return "node" if self in (FaultKind.KILL_NODE, FaultKind.FREEZE_NODE,
                                  FaultKind.DRAIN) else "rank"


@dataclass(frozen=True, kw_only=True)
class FaultSpec:
    """A fault to inject (`--inject kill:rank=1,step=20` or a `[[faults]]` table).

    It fires once, when its target reaches the start of `step`. Nodes are numbered as the
    run sees them: 0 is the driver's node, 1, 2, ... the others in the order of their lowest
    rank; node 0 cannot be killed (the run would kill itself).
    """

    kind: str
    """The fault: `kill`, `kill-staging`, `kill-replicating`, `hang`, `raise`, `term`, `slow`, `nan`, `spike`, `bitflip`, `slow-link` (a rank); `kill-node`, `freeze-node`, `drain` (a node). The TOML form of `--inject`."""
    step: int
    """The fault fires once, when its target reaches the start of this step."""
    rank: int = -1
    """The rank of a rank fault (as numbered in the world at the time)."""
    node: int = -1
    """The node of a node fault: 0 is the driver's node (it cannot be killed), 1, 2, … the others in the order of their lowest rank."""
    mbps: float = 0.0
    """A `slow-link` fault's cap on the rank's replication sends, in megabits per second (`slow-link:rank=1,step=5,mbps=50`); no other kind takes it."""

    def __post_init__(self) -> None:
        _check_kinds(self, "faults")
        _require(self.kind in set(FaultKind), "faults.kind", self.kind,
                 f"one of {', '.join(FaultKind)}")
        object.__setattr__(self, "kind", FaultKind(self.kind))  # its spelling stays the same
        if self.kind is FaultKind.SLOW_LINK:
            _require(self.mbps > 0, "faults.mbps", self.mbps,
                     "a slow-link fault needs mbps=M with M > 0 (megabits per second)")
        else:
            _require(self.mbps == 0, "faults.mbps", self.mbps,
                     f"only a slow-link fault takes mbps, not a {self.kind} fault")
        if self.kind is FaultKind.SPIKE and self.rank == -1:
            object.__setattr__(self, "rank", 0)  # a bad batch: `spike:step=30` is enough
        _require(self.step >= 1, "faults.step", self.step, "must be >= 1")
        target = self.kind.target
        other = "node" if target == "rank" else "rank"
        _require(getattr(self, other) == -1, f"faults.{other}", getattr(self, other),
                 f"a {self.kind} fault targets a {target}, not a {other}")
        _require(getattr(self, target) >= (1 if target == "node" else 0), f"faults.{target}",
                 getattr(self, target),
                 f"a {self.kind} fault needs {target}=N" + (
                     " with N >= 1 (node 0 is the driver's node)" if target == "node" else
                     " with N >= 0"))

    def __str__(self) -> str:
        target = FaultKind(self.kind).target
        text = f"{self.kind}:{target}={getattr(self, target)},step={self.step}"
        return text + (f",mbps={self.mbps:g}" if self.mbps else "")


def _fault_field(key: str, value: str) -> int | float | None:
    """An --inject field's value: rank, node and step are digits, mbps a decimal number
    (None: neither)."""
    value = value.strip()
    if key in ("rank", "node", "step"):
        return int(value) if re.fullmatch(r"[0-9]+", value) else None
    if key == "mbps":
        return float(value) if re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", value) else None
    return None


def parse_fault(text: str) -> FaultSpec:
    """`kill:rank=1,step=20` -> FaultSpec (the --inject syntax)."""
    syntax = ("expected KIND:TARGET=N,step=S, e.g. kill:rank=1,step=20 or "
              f"kill-node:node=1,step=80 (slow-link also takes mbps=M, e.g. "
              f"slow-link:rank=1,step=5,mbps=50); KIND is one of {', '.join(FaultKind)}")
    kind, sep, rest = text.strip().partition(":")
    fields: dict[str, Any] = {"kind": kind}
    for item in rest.split(",") if sep else []:
        key, eq, value = item.partition("=")
        key = key.strip()
        parsed = _fault_field(key, value) if eq and key not in fields else None
        if parsed is None:
            raise ConfigError(f"--inject {text!r} is invalid: {syntax}")
        fields[key] = parsed
    if "step" not in fields:
        raise ConfigError(f"--inject {text!r} is invalid: {syntax}")
    try:
        return FaultSpec(**fields)
    except ConfigError as exc:
        raise ConfigError(f"--inject {text!r}: {exc}") from None


def parse_profile_steps(text: str) -> list[int]:
    """`20` -> [20, 20], `20-22` -> [20, 22] (the --profile syntax; both steps included)."""
    first, sep, last = text.strip().partition("-")
    parts = [first, last] if sep else [first]
    if not all(p.strip().isdecimal() and p.strip().isascii() for p in parts):
        raise ConfigError(f"--profile {text!r} is invalid: expected STEP or FIRST-LAST (both "
                          f"included), e.g. --profile 20 or --profile 20-22")
    steps = [int(p) for p in parts]
    if steps[0] < 1 or steps[-1] < steps[0]:
        raise ConfigError(f"--profile {text!r} is invalid: steps count from 1, and FIRST "
                          f"must be <= LAST")
    return [steps[0], steps[-1]]
