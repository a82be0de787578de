"""JobConfig: the tree of sections that describes a run, and the checks that span sections.

A world size must split into the parallel layout and the global batch into micro-batches,
for every world size the run may take (scaling's floor, ceiling and num_workers).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from stalwart.core.config.numerics import NumericsConfig
from stalwart.core.config.sections import (
    CheckpointConfig,
    DataConfig,
    FailureConfig,
    FaultSpec,
    ParallelConfig,
    RunConfig,
    ScalingConfig,
    TaskConfig,
    TrainConfig,
    _require,
)
from stalwart.core.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    task: TaskConfig = field(default_factory=TaskConfig)
    """What to train: the TrainTask and its constructor's arguments."""
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    """How many workers, their resources, and how the world shrinks and grows."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How the model is split: data, tensor and pipeline parallel degrees and their options."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The optimisation: steps, batch sizes, learning-rate schedule, seed."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Storage checkpoints and the in-memory snapshot tier."""
    failure: FailureConfig = field(default_factory=FailureConfig)
    """Failure budget, hang and straggler detection."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prepared data and validation."""
    run: RunConfig = field(default_factory=RunConfig)
    """The run's name, logging, progress, TensorBoard and profiling."""
    numerics: NumericsConfig = field(default_factory=NumericsConfig)
    """Numerical faults: NaN, loss spikes and replicas that differ (silent corruption)."""
    faults: tuple[FaultSpec, ...] = ()
    """Faults to inject, as [[faults]] tables (kind, step, rank or node); see FaultSpec."""

    def __post_init__(self) -> None:
        for fault in self.faults:
            _require(fault.step <= self.train.steps, "faults.step", fault.step,
                     f"must be <= train.steps = {self.train.steps} ({fault})")
            _require(fault.rank < self.scaling.num_workers, "faults.rank", fault.rank,
                     f"must be < scaling.num_workers = {self.scaling.num_workers} ({fault})")
        _require(not self.run.profile_steps or self.run.profile_steps[-1] <= self.train.steps,
                 "run.profile_steps", self.run.profile_steps,
                 f"steps must be <= train.steps = {self.train.steps}")
        self._check_keep_best()
        self._check_numerics()
        for name in ("floor", "ceiling"):
            # Every world size the run may take must split into the layout and the batch.
            self.check_world(getattr(self.scaling, name))
        # Cross-section checks: the world must be splittable into the data-parallel layout,
        # and the global batch into micro-batches on each data-parallel rank.
        self.check_world(self.scaling.num_workers)

    def _check_keep_best(self) -> None:
        """keep_best ranks checkpoints by a value their own step recorded: a `val_` metric
        needs checkpoints at validation steps before the last."""
        ck, val_every = self.checkpoint, self.data.val_every
        if not ck.keep_best or not ck.best_metric.startswith("val_"):
            return
        _require(val_every > 0, "checkpoint.best_metric", ck.best_metric,
                 "is never measured: data.val_every = 0 (validate, or rank by loss)")
        first = math.lcm(ck.persist_every, val_every)
        _require(first < self.train.steps, "checkpoint.keep_best", ck.keep_best,
                 f"ranks checkpoints by {ck.best_metric}, measured at validation steps only: "
                 f"checkpoint.persist_every = {ck.persist_every} and data.val_every = "
                 f"{val_every} first meet at step {first}, not before train.steps = "
                 f"{self.train.steps}")

    def _check_numerics(self) -> None:
        """A fingerprint mismatch rolls back to a snapshot of the memory tier: every step's.
        An auto interval is refused with it, not pinned to 1: that would silently drop the
        budget the run asked for."""
        nc = self.numerics
        _require(nc.fingerprint_every == 0 or self.checkpoint.snapshot_every != "auto",
                 "numerics.fingerprint_every", nc.fingerprint_every,
                 'needs a snapshot every step, and checkpoint.snapshot_every = "auto" '
                 "chooses its own interval: set checkpoint.snapshot_every = 1, or "
                 "numerics.fingerprint_every = 0 (off)")
        _require(nc.fingerprint_every == 0 or self.checkpoint.snapshot_every == 1,
                 "numerics.fingerprint_every", nc.fingerprint_every,
                 f"needs checkpoint.snapshot_every = 1 (it is "
                 f"{self.checkpoint.snapshot_every}): a mismatch rolls back to the snapshot "
                 f"before the last matching fingerprint; or set it to 0 (off)")
        late = [s for s in nc.skip_steps if s > self.train.steps]
        _require(not late, "numerics.skip_steps", nc.skip_steps,
                 f"steps must be <= train.steps = {self.train.steps}")

    def check_world(self, world: int) -> None:
        """Raise ConfigError unless a world of `world` ranks can run this job: the global
        batch splits into micro-batches over its data-parallel ranks (at least parallel.pp of
        them each with pipeline parallelism), and cpu_offload has GPU workers."""
        replicate, shard = self.parallel.degrees(world)
        dp = replicate * shard
        _require(self.train.precision != "float8" or self.scaling.gpus_per_worker > 0,
                 "train.precision", self.train.precision,
                 "float8 needs GPU workers (scaling.gpus_per_worker > 0) whose devices have "
                 "compute capability 8.9 or later (Ada, Hopper); CPU workers have no float8 "
                 "matmuls")
        _require(not self.parallel.cpu_offload or self.scaling.gpus_per_worker > 0,
                 "parallel.cpu_offload", self.parallel.cpu_offload,
                 "needs GPU workers (scaling.gpus_per_worker > 0); on CPU workers the "
                 "parameters and optimizer state already live in host memory")
        if self.parallel.pp > 1:
            microbatches = self.train.global_batch_size // max(1, self.train.micro_batch_size * dp)
            _require(microbatches >= self.parallel.pp, "train.global_batch_size",
                     self.train.global_batch_size,
                     f"with parallel.pp = {self.parallel.pp} each data-parallel rank needs at "
                     f"least pp micro-batches per step (global_batch_size >= micro_batch_size x "
                     f"data-parallel ranks x pp = {self.train.micro_batch_size * dp * self.parallel.pp})")
        per_step = self.train.micro_batch_size * dp
        _require(self.train.global_batch_size % per_step == 0, "train.global_batch_size",
                 self.train.global_batch_size,
                 f"must be a multiple of micro_batch_size x data-parallel ranks = "
                 f"{self.train.micro_batch_size} x {dp} = {per_step}")

    def largest_world(self, up_to: int) -> int:
        """The largest world size <= up_to that check_world accepts (0: none)."""
        for world in range(up_to, 0, -1):
            try:
                self.check_world(world)
            except ConfigError:
                continue
            return world
        return 0

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the configured world (dp_replicate x dp_shard)."""
        replicate, shard = self.parallel.degrees(self.scaling.num_workers)
        return replicate * shard

    @property
    def grad_accum_steps(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.dp_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
