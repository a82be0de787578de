"""TrainEngine: one rank's model, optimizer, data position and step, with no Ray in sight.

The worker (workers/worker.py) drives it from a thread; the dist tests drive it directly
in plain processes. A step reads the rank's slice of the global batch (workers/sampler.py),
accumulates micro-batches (or hands them to the pipeline schedule), syncs gradients once,
steps the optimizer and all-reduces a tiny tensor holding the loss and a stop flag, so every
rank agrees on the loss and on when to stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import torch._dynamo  # noqa: F401 (at the rank's start, not in a world: see below)
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from stalwart.checkpointing.memory.tier import StateAccess
from stalwart.core.batch import as_pair, batch_samples, compute_loss, loss_takes_batch, to_device
from stalwart.core.errors import TaskError
from stalwart.core.numerics import Action
from stalwart.core.stream import SampleIds, StreamDataset
from stalwart.parallel import grad_compression
from stalwart.parallel.context_parallel import ContextShard
from stalwart.parallel.data_parallel import gradient_sync, unwrapped
from stalwart.parallel.dims import ParallelDims, dp_coordinates
from stalwart.parallel.expert_parallel import ExpertGradients, expert_shard
from stalwart.parallel.grad_norm import clip_grad_norm
from stalwart.parallel.invariant_reduce import PairwiseAccumulator
from stalwart.parallel.meta_init import materialize, on_meta
from stalwart.parallel.recipe import parallelize
from stalwart.workers.errors import RestoredStepMismatch
from stalwart.workers.feeder import Feeder, bind_dataset, step_ranges
from stalwart.workers.local_timer import LocalTimer
from stalwart.workers.numerics import (
    NumericsEscalation,
    NumericsGuard,
    NumericsRollback,
    state_tensors,
)
from stalwart.workers.reports import StepReport
from stalwart.workers.sampler import rank_slice

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig
    from stalwart.core.task import TrainTask
    from stalwart.parallel.pipeline import Pipeline

# torch._dynamo is imported with the engine, when the rank starts. DDP's constructor and an
# optimizer's first step import it otherwise: inside a world, which it then keeps alive past
# destroy_process_group (torch 2.13), and on the recovery path (0.9 s of a warm spare's join).

# The optimizer's state and param groups keyed by parameter name, not by group index: the
# stages of a pipeline hold different parameters under the same indices, and DCP would keep
# one stage's entry of a key that every rank writes (TorchTitan flattens for the same reason).
OPTIM_BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)


class StepHooks(Protocol):
    """What the step asks of whoever may tamper with it (the worker's fault injector)."""

    def loss_factor(self, step: int) -> float:
        """What this rank's loss of `step` is multiplied by (1.0: nothing due)."""

    def tamper(self, step: int, model: torch.nn.Module) -> None:
        """At the start of `step`, before its forward pass."""


@dataclass(frozen=True)
class Attempt:
    """One try of a step, up to its agreed summary (before the update)."""

    loss: float
    stop: bool
    data_failed: bool
    data_wait: float
    metrics: dict[str, float]
    checks: list[float]
    fingerprinted: bool
    tokens: int
    local_s: float
    next_error: str | None


class TrainEngine:
    def __init__(self, config: JobConfig, task: TrainTask, *, rank: int, world_size: int,
                 device: torch.device) -> None:
        self.config = config
        self.task = task
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.dims = ParallelDims.from_config(config.parallel, world_size)
        task.check_layout(self.dims)
        self.mesh = self.dims.build_mesh(device.type) if dist.is_initialized() else None
        self.dp_rank, self.dp_size = dp_coordinates(self.mesh) if self.mesh else (0, 1)
        # Context parallel: the model sees this rank's part of each sequence (its peers read
        # the same samples: they share a data-parallel rank).
        self.context = ContextShard.of(self.mesh["cp"]) if self.dims.cp > 1 else None
        self.accum = config.train.global_batch_size // (config.train.micro_batch_size
                                                        * self.dp_size)

        # Initialise the full model identically on every rank from the seed, then split it:
        # the initial weights are then the same for any layout (an invariant the dist tests
        # check). A model built on the meta device is split first and then allocated and
        # initialised shard by shard (parallel/meta_init.py): no rank holds all of it.
        torch.manual_seed(config.train.seed)
        model = task.build_model(config)
        deferred = on_meta(model)
        if not deferred:
            model = model.to(device)
            task.init_weights(model)
        if config.train.precision == "float8":  # before any split (parallel/float8.py)
            from stalwart.parallel.float8 import apply_float8

            apply_float8(model, device)
        self.pipeline: Pipeline | None = None
        self.expert_grads: ExpertGradients | None = None
        if self.dims.pp > 1:
            assert self.mesh is not None, "pipeline parallelism needs a process group"
            # Imported here: torch's pipelining costs every rank's start half a second.
            from stalwart.parallel.pipeline import build_pipeline

            self.pipeline = build_pipeline(
                model, task=task, dims=self.dims, mesh=self.mesh, config=config.parallel,
                device=device, n_microbatches=self.accum, loss_fn=task.output_loss,
                init=task.init_weights if deferred else None)
            # The optimizer and checkpoints see this rank's stages as one module.
            self.model = self.pipeline.rank_module
        else:
            # Expert parallel: this rank keeps its experts, which data parallelism leaves out.
            experts: list[torch.nn.Parameter] = []
            if self.dims.ep > 1:
                shard = expert_shard(self.dp_rank, self.dp_size, self.dims.ep,
                                     list(range(world_size)))  # tp = cp = pp = 1
                experts = task.apply_expert_parallel(model, shard)
                self.expert_grads = ExpertGradients(experts, shard)
            self.model = parallelize(
                model, mesh=self.mesh, config=config.parallel, task=task,
                materialize=partial(materialize, device=device, init=task.init_weights)
                if deferred else None, context=self.context, experts=set(experts))
        # DDP's compression hook; PowerSGD's state rides in the checkpoint ("comm").
        self.compression = (grad_compression.register(self.model, config.parallel, rank=rank)
                            if isinstance(self.model, DistributedDataParallel) else None)
        # Counted where a rank reduces its parameters' whole gradients: not split by tp, nor
        # experts reduced over their replicas only.
        self.grad_bytes = (grad_compression.reduction_bytes(self.model, config.parallel)
                           if self.dp_size > 1 and self.dims.tp == 1 and self.dims.ep == 1
                           else None)
        # A model with frozen parameters (adapters on a pretrained base) checkpoints only
        # what trains: the frozen rest comes from the task's own files at every start, so
        # a load leaves it as it is (not strict). DCP's load still refuses a checkpoint
        # that lacks a trainable tensor.
        self.frozen = {name for name, p in
                       unwrapped(self.model).named_parameters(remove_duplicate=False)
                       if not p.requires_grad}  # as DCP names them: without DDP's "module."
        self.options = replace(OPTIM_BY_NAME, ignore_frozen_params=bool(self.frozen),
                               strict=not self.frozen)
        # Ranks holding the loss: the last pipeline stage (tp peers hold the same one).
        self.loss_ranks = world_size // self.dims.pp
        # Gradients summed in one order for any dp degree (parallel/invariant_reduce.py).
        self.invariant: PairwiseAccumulator | None = None
        if config.parallel.invariant_reduction:
            self.invariant = PairwiseAccumulator(self.model.parameters())
            self.dp_group = (self.mesh["dp_replicate"].get_group()
                             if self.mesh is not None and self.dp_size > 1 else None)
        self.optimizer = task.build_optimizer(self.model, config)
        self.scheduler = task.build_lr_scheduler(self.optimizer, config)
        # What this run's config asks of the optimizer, re-applied over a checkpoint's own.
        self._configured = [{k: v for k, v in g.items() if k not in ("params", "lr")}
                            for g in self.optimizer.param_groups]

        self.takes_batch = loss_takes_batch(task)
        self.metric_names: tuple[str, ...] | None = None
        """The names of the metrics the task's loss returns, fixed by the first step: every
        step's all-reduce carries them in this order."""
        self.train_data = task.train_dataset(config)
        self.val_data = task.val_dataset(config)
        t, data_cfg = config.train, config.data
        bind_dataset(self.train_data, seed=t.seed, global_batch=t.global_batch_size,
                     cache_dir=data_cfg.cache_dir)
        bind_dataset(self.val_data, seed=t.seed, global_batch=1, cache_dir=data_cfg.cache_dir)
        # The plan holds numbers, not the engine: a cycle through it would keep the engine
        # (and its world's process groups) alive past its world, until a full collection.
        plan = partial(step_ranges, global_batch=t.global_batch_size, dp_rank=self.dp_rank,
                       dp_size=self.dp_size, micro_batch=t.micro_batch_size,
                       micro_batches=1 if self.pipeline is not None else self.accum)
        self.feeder = Feeder(self.train_data, seed=t.seed, plan=plan,
                             step_size=t.global_batch_size, depth=data_cfg.prefetch)
        self.sampler = self.feeder.sampler
        self.data_failure: str | None = None
        """Why this rank could not read the next step (all ranks then stop after this one)."""
        self.step = 0
        self.samples_seen = 0
        self._group_names: list[list[str]] | None = None
        """Each optimizer param group's parameter names (scalar_state's keys), once."""
        self._loads = 0  # state loads so far: a load may replace the optimizer's tensors
        self.numerics = NumericsGuard(config, rank=rank, world_size=world_size,
                                      classes=[self.dims.replica_class(r)
                                               for r in range(world_size)])

    # ------------------------------------------------------------------ training

    def train_step(self, *, stop_requested: bool = False,
                   before_update: Callable[[], None] | None = None,
                   before_summary: Callable[[], None] | None = None,
                   after_local_work: Callable[[float], None] | None = None,
                   hooks: StepHooks | None = None) -> tuple[StepReport, bool]:
        """Run one optimizer step; returns its report and whether any rank asked to stop.

        `before_update` runs before the weights can change (a snapshot's device-to-host
        copy must be done by then; the fingerprint reads the state after it),
        `before_summary` before the step's last all-reduce (the previous snapshot must be on
        its holders by then: see checkpointing/memory/replication.py). `after_local_work` is
        told how long this rank's own work took, before its first synchronisation.

        The update waits for the summary all-reduce, which carries the numerical checks
        (workers/numerics.py): a NaN or a spike on any rank stops it on every rank, so a bad
        step never reaches the weights. It is replayed from the same state, batch and random
        state, then skipped; a replica that differs raises NumericsRollback for the worker.
        """
        t0 = time.perf_counter()
        cfg = self.config.train
        step_data, data_wait = self.feeder.take(self.samples_seen)
        step = self.step + 1
        if hooks is not None:
            hooks.tamper(step, self.model)
        guard = self.numerics
        rng = _rng_state(self.device) if guard.on else None
        lr = self.optimizer.param_groups[0]["lr"]
        replays = 0
        while True:
            tried = self._attempt(step_data, step, stop_requested=stop_requested,
                                  data_wait=data_wait, hooks=hooks, before_update=before_update,
                                  before_summary=before_summary,
                                  after_local_work=after_local_work)
            finding = (guard.verdict(step, tried.loss, tried.checks, tried.fingerprinted)
                       if guard.on else None)
            if guard.must_skip(step):
                skipped = True  # its update is dropped, whatever the checks found
                break
            if finding is None:
                skipped = False
                guard.accept(tried.loss)
                self.optimizer.step()
                self.scheduler.step()
                break
            decision = guard.decide(finding, replays + 1, t0)
            self.optimizer.zero_grad(set_to_none=True)
            if decision.action is Action.REPLAY:
                replays += 1
                _set_rng_state(rng, self.device)
                continue
            if decision.action is Action.SKIP:
                guard.skipped(step)
                skipped = True
                break
            if decision.action is Action.ROLLBACK:
                raise NumericsRollback(decision)
            raise NumericsEscalation(decision)
        self.optimizer.zero_grad(set_to_none=True)
        ledger = self._ledger(step_data.ids) if self.config.data.ledger else None
        # Only the rank that failed to read raises (with its file's name); its peers stop.
        self.data_failure = tried.next_error
        self.step += 1
        self.samples_seen += cfg.global_batch_size
        report = StepReport(rank=self.rank, step=self.step, loss=tried.loss, lr=lr,
                            tokens=tried.tokens * self.dp_size,
                            step_time_s=time.perf_counter() - t0, time=time.time(),
                            samples_seen=self.samples_seen, local_s=tried.local_s,
                            data_wait_s=tried.data_wait,
                            ledger=ledger if self.rank == 0 else None,
                            metrics=tried.metrics, skipped=skipped, replays=replays,
                            grad_bytes=self._grad_bytes(step))
        return report, tried.stop or tried.data_failed

    def _attempt(self, step_data: Any, step: int, *, stop_requested: bool, data_wait: float,
                 hooks: StepHooks | None, before_update: Callable[[], None] | None,
                 before_summary: Callable[[], None] | None,
                 after_local_work: Callable[[float], None] | None) -> Attempt:
        """Forward, backward and gradient sync of one step, then its summary all-reduce."""
        cfg = self.config.train
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)
        metric_sums: dict[str, torch.Tensor] = {}
        tokens = 0
        factor = hooks.loss_factor(step) if hooks is not None else 1.0
        local = LocalTimer(self.device, after_local_work)  # own work before the first sync
        if self.pipeline is not None:
            # The schedule splits the rank's batch into the accumulation micro-batches.
            batch = to_device(step_data.batches[0], self.device)
            inputs, targets = as_pair(batch, "pipeline parallelism")
            tokens = self.task.count_tokens(batch)
            local.done()  # stages exchange activations from here on
            loss = self.pipeline.step(inputs, targets)
            if loss is not None:
                loss_sum += loss.detach()
        else:
            for i in range(self.accum):
                batch = to_device(step_data.batches[i], self.device)
                tokens += self.task.count_tokens(batch)
                if self.invariant is not None:
                    # Each micro-batch is a leaf of the global sum: scaled by 1 / (all the
                    # global batch's micro-batches), the same factor for any dp degree.
                    loss, metrics = self._loss(batch)
                    loss = loss * factor if factor != 1.0 else loss
                    _accumulate(metric_sums, metrics, self.accum)
                    (loss / (self.accum * self.dp_size)).backward()
                    self.invariant.add()
                    loss_sum += loss.detach() / self.accum
                    continue
                last = i == self.accum - 1
                with gradient_sync(self.model, last):
                    loss, metrics = self._loss(batch)
                    loss = loss * factor if factor != 1.0 else loss
                    _accumulate(metric_sums, metrics, self.accum)
                    loss = loss / self.accum
                    if last:  # DDP syncs gradients during this backward
                        local.done()
                    loss.backward()
                loss_sum += loss.detach()
            if self.invariant is not None:
                local.done()
                self.invariant.reduce_into_grads(self.dp_group)
            if self.expert_grads is not None:
                self.expert_grads.reduce()
        grad_norm = None
        if cfg.grad_clip > 0:
            grad_norm = clip_grad_norm(self.model.parameters(), cfg.grad_clip,
                                       pp_group=self.mesh["pp"].get_group()
                                       if self.pipeline else None,
                                       split=self.expert_grads.norm_split
                                       if self.expert_grads is not None else None)
        if before_update is not None:
            before_update()
        checks = self.numerics.checks(
            step, loss_sum,
            [grad_norm] if grad_norm is not None else
            [p.grad for p in self.model.parameters() if p.grad is not None],
            lambda: state_tensors(self.model, self.optimizer),
            (len(self.optimizer.state), self._loads))

        # One all-reduce of a few numbers per step: the mean loss for logging, the stop
        # flag (all ranks stop after the same step whoever was asked first), the numerical
        # checks (all ranks agree whether to update). Every rank holds its data-parallel
        # slice's loss (tensor-parallel peers hold the same one; with a pipeline only the
        # last stage has it), so the sum over the world divided by the number of ranks
        # holding a loss is the mean over the global batch. The task's metrics ride along,
        # averaged as the loss is.
        names = self._fix_metric_names(metric_sums)
        # A rank that cannot read the next step says so here: all ranks then stop after
        # this step, which is checkpointed, instead of waiting on it in the next one.
        next_error, waited = (self.feeder.check_ahead(self.samples_seen + cfg.global_batch_size)
                              if self.step + 1 < cfg.steps else (None, 0.0))
        data_wait += waited
        summary = torch.cat([torch.stack(
            [loss_sum, torch.tensor(float(stop_requested), device=self.device),
             torch.tensor(float(next_error is not None), device=self.device),
             torch.tensor(data_wait, device=self.device),
             *(metric_sums[n] for n in names)]),
            torch.stack(checks.values).to(loss_sum.dtype)])
        if before_summary is not None:
            before_summary()
        if dist.is_initialized():
            dist.all_reduce(summary)
        head = 4 + len(names)
        divisors = torch.tensor([self.loss_ranks, 1.0, 1.0, self.world_size]
                                + [self.loss_ranks] * len(names), device=self.device)
        values = torch.cat([summary[:head] / divisors, summary[head:]]).tolist()
        loss_mean, stop_votes, data_failures, wait_mean, *metric_means = values[:head]
        return Attempt(loss=loss_mean, stop=stop_votes > 0, data_failed=data_failures > 0,
                       data_wait=wait_mean,
                       metrics=dict(zip(names, metric_means, strict=True)),
                       checks=values[head:], fingerprinted=checks.fingerprinted,
                       tokens=tokens, local_s=local.seconds(), next_error=next_error)

    def _grad_bytes(self, step: int) -> int | None:
        """What this rank's gradient reduction carried in `step` (PowerSGD's factors from its
        start step on); None without data parallelism, or with tp or ep (not counted)."""
        if self.grad_bytes is None:
            return None
        return self.grad_bytes[step > self.config.parallel.powersgd_start_step]

    def replica_classes(self) -> list[tuple[int, ...]]:
        """Each rank's class: ranks of one class hold the same state (the memory tier sends
        them no copy of each other's snapshots). PowerSGD's error feedback is each rank's own."""
        own = self.compression is not None
        return [self.dims.replica_class(r) + ((r,) if own else ())
                for r in range(self.world_size)]

    def _ledger(self, ids: SampleIds) -> SampleIds:
        """The whole global batch's sample ids, gathered from every data-parallel rank (each
        fills its slice; tensor and pipeline peers fill the same one, hence the division)."""
        g = self.config.train.global_batch_size
        per_rank = g // self.dp_size
        table = torch.zeros(g, 3, dtype=torch.float64, device=self.device)
        mine = np.stack([ids.epoch, ids.file, ids.row], axis=1).astype(np.float64)
        table[self.dp_rank * per_rank:(self.dp_rank + 1) * per_rank] = torch.from_numpy(mine)
        if dist.is_initialized():
            dist.all_reduce(table)
            table /= self.world_size // self.dp_size
        whole = table.round().to(torch.int64).cpu().numpy()
        return SampleIds(epoch=whole[:, 0], file=whole[:, 1], row=whole[:, 2], files=ids.files)

    def _loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.context is not None:
            batch = self.context.split(batch)
        return compute_loss(self.task, self.model, batch, takes_batch=self.takes_batch)

    def _fix_metric_names(self, metric_sums: dict[str, torch.Tensor]) -> tuple[str, ...]:
        """The metric names in all-reduce order: the first step's, then checked every step
        (a rank sending other names would garble its peers' numbers)."""
        names = tuple(sorted(metric_sums))
        if self.pipeline is not None:
            return ()  # the last stage runs output_loss, which has no metrics
        if self.metric_names is None:
            self.metric_names = names
        elif names != self.metric_names:
            raise TaskError(f"the task's loss returned metrics {list(names)} at step "
                            f"{self.step + 1}, but {list(self.metric_names)} before: every "
                            f"step must return the same names")
        return names

    @torch.no_grad()
    def validate(self) -> tuple[float, dict[str, float]] | None:
        """Mean loss and task metrics (as `val_<name>`) over a fixed held-out set (the same
        samples for any world size), weighted by samples; None without a held-out set."""
        if self.val_data is None:
            return None
        cfg = self.config
        total = cfg.data.val_batches * cfg.train.global_batch_size
        start, count = rank_slice(0, total, self.dp_rank, self.dp_size)
        items = np.arange(start, start + count) % len(self.val_data)
        self.model.eval()
        mb = cfg.train.micro_batch_size
        acc = torch.zeros(2, device=self.device)
        names: tuple[str, ...] = ()
        if self.pipeline is not None:
            # One step's worth at a time: the schedule splits it into its micro-batches.
            chunk = count // cfg.data.val_batches
            for i in range(0, count, chunk):
                inputs, targets = as_pair(to_device(
                    self.val_data.get_batch(items[i:i + chunk]), self.device),
                    "pipeline parallelism")
                loss = self.pipeline.eval_loss(inputs, targets)
                if loss is not None:
                    acc += torch.stack([loss * len(inputs), torch.tensor(
                        float(len(inputs)), device=self.device)])
        else:
            for i in range(0, count, mb):
                batch = to_device(self.val_data.get_batch(items[i:i + mb]), self.device)
                n = float(batch_samples(batch))
                loss, metrics = self._loss(batch)
                if i == 0:  # sized by the first micro-batch's metrics, in name order
                    names = tuple(sorted(metrics))
                    acc = torch.zeros(2 + len(names), device=self.device)
                if tuple(sorted(metrics)) != names:
                    raise TaskError(f"the task's loss returned metrics {sorted(metrics)} in "
                                    f"validation, but {list(names)} before")
                acc += torch.stack([loss * n, torch.tensor(n, device=self.device),
                                    *(metrics[k] * n for k in names)])
        if dist.is_initialized():
            dist.all_reduce(acc)
        means = (acc / acc[1]).tolist()
        return means[0], {f"val_{k}": v for k, v in zip(names, means[2:], strict=True)}

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of everything a bit-exact resume needs (DCP-ready)."""
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        if self.frozen:  # torch keeps a frozen tied parameter's second name (lm_head)
            model_sd = {k: v for k, v in model_sd.items() if k not in self.frozen}
        return {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "train": self._train_state(),
            **({"comm": self.compression.state_dict()} if self.compression else {}),
        }

    def _train_state(self) -> dict[str, Any]:
        return {"step": self.step, "samples_seen": self.samples_seen,
                "numerics": self.numerics.snapshot_state()}

    def scalar_state(self) -> dict[str, Any]:
        """The non-tensor leaves of state_dict(), cheaply and with the same flattened names
        (the snapshot stager asks for them at every snapshot): each param group's settings
        under each of its parameters' names."""
        if self._group_names is None:
            _, nested = get_state_dict(self.model, self.optimizer)
            self._group_names = [g["params"] for g in nested["param_groups"]]
        optim = {f"param_groups.{name}.{k}": v
                 for g, names in zip(self.optimizer.param_groups, self._group_names, strict=True)
                 for name in names for k, v in g.items() if k != "params"}
        return {
            "optim": optim,
            "scheduler": self.scheduler.state_dict(),
            "train": self._train_state(),
            **({"comm": self.compression.scalar_state()} if self.compression else {}),
        }

    def state_signature(self) -> tuple[int, ...]:
        """Changes when the optimizer creates or replaces a state tensor (so a snapshot's
        cached view of the live tensors must be rebuilt)."""
        sig = [len(self.optimizer.state)]
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    local = value.to_local() if isinstance(value, DTensor) else value
                    sig.append(local.data_ptr())
        return tuple(sig)

    def check_restored_step(self) -> None:
        """Collective: every rank of this world restored the same step (one all-reduce of
        step and -step with MAX), or RestoredStepMismatch before training goes on."""
        if not dist.is_initialized():
            return
        both = torch.tensor([self.step, -self.step], dtype=torch.int64, device=self.device)
        dist.all_reduce(both, op=dist.ReduceOp.MAX)
        highest, lowest = int(both[0]), -int(both[1])
        if highest != lowest:
            raise RestoredStepMismatch(
                f"the ranks of this world restored different steps (from {lowest} to "
                f"{highest}; rank {self.rank} has {self.step}): it must not train on")

    def data_identity(self) -> dict[str, Any]:
        """What the training stream's order depends on (for manifests); {} for map-style."""
        return self.train_data.identity() if isinstance(self.train_data, StreamDataset) else {}

    def close(self) -> None:
        """Stop reading ahead: the engine's world has ended."""
        self.feeder.close()

    def tier_view(self) -> StateAccess:
        """This engine as the in-memory checkpoint tier sees it."""
        return StateAccess(state_dict=self.state_dict, scalar_state=self.scalar_state,
                      signature=self.state_signature, load_state_dict=self.load_state_dict,
                      device=self.device)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._loads += 1
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=self.options)
        self.scheduler.load_state_dict(state["scheduler"])
        self._apply_configured_hyperparameters()
        self.step = int(state["train"]["step"])
        self.samples_seen = int(state["train"]["samples_seen"])
        self.numerics.load_state(state["train"].get("numerics", ""))
        if self.compression is not None:
            self.compression.load_state_dict(state.get("comm", {}))

    def _apply_configured_hyperparameters(self) -> None:
        """A checkpoint carries the hyperparameters it was trained with. A run restored from
        it with others (a resume with a new train.lr; a Population Based Training trial that
        takes another trial's checkpoint with mutated values) trains with its own. The LR
        keeps its place in the schedule: scaled by new base / old base. With the same config
        nothing changes, so a restore stays bit-exact."""
        base_lrs = getattr(self.scheduler, "base_lrs", None)
        for i, (group, wanted) in enumerate(zip(self.optimizer.param_groups, self._configured,
                                                strict=True)):
            for key, value in wanted.items():
                if key != "initial_lr" and group.get(key) != value:
                    group[key] = value
            old_base, new_base = group.get("initial_lr"), wanted.get("initial_lr")
            if old_base and new_base is not None and new_base != old_base:
                group["lr"] = group["lr"] * new_base / old_base
                group["initial_lr"] = new_base
                if base_lrs is not None:
                    base_lrs[i] = new_base
        if hasattr(self.scheduler, "_last_lr"):  # what get_last_lr() answers
            self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]


def _accumulate(sums: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor],
                accum: int) -> None:
    """Add one micro-batch's metrics to the step's sums, as its loss is (1 / accum each)."""
    for name, value in metrics.items():
        share = value / accum
        sums[name] = sums[name] + share if name in sums else share


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The random state a replay starts from (dropout draws the same masks again)."""
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None] | None,
                   device: torch.device) -> None:
    if state is None:
        return
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
