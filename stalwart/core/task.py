"""TrainTask: what a user supplies, and how stalwart finds it by `module:attribute` path.

A task is plain Python. It is constructed on the driver (to check it before any worker
starts) and on every worker with the `[task.args]` table as keyword arguments: the
constructor is where a task checks its arguments (type, range, how they combine), so a bad
one is refused before anything starts. stalwart
owns the distributed parts (process groups, sharding, checkpoints, sample order); the
task only says what to train: the model, its loss, the data, the optimizer and schedule.

Contract for datasets: `len(ds)` items, and `ds.get_batch(indices)` for a 1-D array of item
indices, returning CPU tensors: an `(inputs, targets)` pair, a single tensor, or a dict of
tensors (see stalwart.batch). stalwart decides which indices each rank reads (see
stalwart.workers.sampler), so a dataset never needs to know about ranks.
"""

from __future__ import annotations

import importlib
import inspect
import math
import pickle
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F

from stalwart.core.batch import Batch, default_token_count, loss_takes_batch
from stalwart.core.errors import TaskError
from stalwart.core.task_errors import error_line, task_traceback

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from stalwart.core.config import JobConfig


class Layout(Protocol):
    """The layout a task is asked to accept: stalwart.parallel.dims.ParallelDims, named here
    by its shape so that the basement imports no room."""

    tp: int
    pp: int
    cp: int
    ep: int

    def check_composition(self) -> None: ...


class SequenceShard(Protocol):
    """A rank's part of every sequence under context parallelism:
    stalwart.parallel.context_parallel.ContextShard, named here by its shape."""

    rank: int
    size: int

    def positions(self, local_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Global positions of this rank's `local_len` tokens."""

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries [B, H, T/cp, hd] over the whole sequence."""


class ExpertPlace(Protocol):
    """A rank's share of every MoE layer's experts under expert parallelism:
    stalwart.parallel.expert_parallel.ExpertShard, named here by its shape."""

    rank: int
    size: int

    def local_experts(self, n_experts: int) -> range:
        """The global ids of the experts this rank holds."""


class Dataset(Protocol):
    def __len__(self) -> int: ...
    def get_batch(self, indices: Any) -> Batch: ...


@dataclass(frozen=True, kw_only=True)
class ModelDims:
    """A transformer's shape beyond its parameter count: what `stalwart plan` needs to size
    blocks and activations. The parameter count itself comes from the model."""

    n_layers: int
    """Transformer blocks; each is one FSDP unit."""
    d_model: int
    """Hidden size."""
    n_heads: int
    """Attention heads."""
    seq_len: int
    """Tokens per sequence."""
    vocab_size: int | None = None
    """Size of the logits; None leaves the logits out of the activations."""
    ffn_hidden: int | None = None
    """Feed-forward hidden width."""
    block_params: int | None = None
    """Parameters of one block (the largest FSDP unit); None: sized from d_model."""
    n_experts: int | None = None
    """Routed experts per MoE layer; None: a dense model."""
    expert_params: int | None = None
    """Parameters of all routed experts (every layer): what expert parallelism splits."""


class TrainTask:
    """Subclass and override `build_model`, `train_dataset` (and whatever else differs)."""

    def prepare_data(self, config: JobConfig) -> None:
        """Download or preprocess data; runs on every worker before datasets are opened.

        It must be idempotent and safe when several workers on a node call it at once.
        """

    def build_model(self, config: JobConfig) -> torch.nn.Module:
        raise TaskError(f"{type(self).__name__} must implement build_model(config)")

    def init_weights(self, model: torch.nn.Module) -> None:
        """Initialise every parameter from torch's global RNG (seeded by train.seed)."""
        if hasattr(model, "init_weights"):
            model.init_weights()

    def model_dims(self, model: torch.nn.Module) -> ModelDims | None:
        """The transformer shape of `model` (built by `build_model` on the meta device), for
        `stalwart plan`'s activation and block estimates. None: unknown, so plan counts the
        parameters only and its totals are lower bounds."""
        return None

    def check_layout(self, dims: Layout) -> None:
        """Refuse a layout this task's model cannot take (runs on the driver, before workers).

        An override calls super() first: that refuses compositions no model can train."""
        dims.check_composition()
        if dims.tp > 1 and type(self).apply_tensor_parallel is TrainTask.apply_tensor_parallel:
            raise TaskError(f"parallel.tp = {dims.tp}: task {type(self).__name__} has no "
                            f"tensor-parallel plan (implement apply_tensor_parallel)")
        if dims.cp > 1 and (type(self).apply_context_parallel
                            is TrainTask.apply_context_parallel):
            raise TaskError(f"parallel.cp = {dims.cp}: task {type(self).__name__} cannot split "
                            f"its sequences (implement apply_context_parallel)")
        if dims.ep > 1 and (type(self).apply_expert_parallel
                            is TrainTask.apply_expert_parallel):
            raise TaskError(f"parallel.ep = {dims.ep}: task {type(self).__name__} has no "
                            f"experts to split (implement apply_expert_parallel)")
        if dims.pp > 1 and type(self).split_pipeline is TrainTask.split_pipeline:
            raise TaskError(f"parallel.pp = {dims.pp}: task {type(self).__name__} has no "
                            f"pipeline split (implement split_pipeline)")
        if dims.pp > 1 and loss_takes_batch(self):
            raise TaskError(f"parallel.pp = {dims.pp}: task {type(self).__name__}'s "
                            f"loss(model, batch) cannot run across pipeline stages; the last "
                            f"stage computes output_loss(output, targets) instead")

    def apply_tensor_parallel(self, model: torch.nn.Module, tp_mesh: DeviceMesh, *,
                              sequence_parallel: bool) -> None:
        """Split the model's layers over `tp_mesh` in place (torch parallelize_module plans)."""
        raise TaskError(f"task {type(self).__name__} has no tensor-parallel plan")

    def apply_context_parallel(self, model: torch.nn.Module, shard: SequenceShard) -> None:
        """Make the model's attention and positions work on `shard`'s part of each sequence
        (stalwart.parallel.context_parallel): the engine hands the model only those tokens,
        every batch tensor of two or more dimensions cut along dim 1. The loss must be a mean
        over tokens that every rank holds equally many of (no padding masked out)."""
        raise TaskError(f"task {type(self).__name__} has no context-parallel attention")

    def apply_expert_parallel(self, model: torch.nn.Module, shard: ExpertPlace
                              ) -> list[torch.nn.Parameter]:
        """Keep only `shard`'s experts of each MoE layer (under their names in the whole
        model) and make the layers send tokens to the others' (`shard` is a
        stalwart.parallel.expert_parallel.ExpertShard); return the kept experts' parameters:
        data parallelism leaves them out, and their gradients are reduced over the expert
        replicas instead."""
        raise TaskError(f"task {type(self).__name__} has no experts to split")

    def split_pipeline(self, model: torch.nn.Module, stage_ids: list[int], num_stages: int
                       ) -> tuple[list[torch.nn.Module], torch.nn.Module]:
        """Cut the model into `num_stages` pipeline stages and return (the stages `stage_ids`
        that this rank runs, one module holding all their parameters under the whole model's
        names, for the optimizer and checkpoints)."""
        raise TaskError(f"task {type(self).__name__} has no pipeline split")

    def train_dataset(self, config: JobConfig) -> Dataset:
        raise TaskError(f"{type(self).__name__} must implement train_dataset(config)")

    def val_dataset(self, config: JobConfig) -> Dataset | None:
        """Held-out data for the periodic validation loss, or None."""
        return None

    def loss(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
             ) -> Any:
        """Mean loss of one micro-batch: `output_loss` of the model's output.

        An override may take the batch whole instead, as `loss(self, model, batch)`, for
        batches that are not pairs. Either may return `(loss, metrics)`: a dict of scalars
        averaged like the loss and logged under their names (see stalwart.batch). A dict
        batch with this default loss calls `model(**batch)` and takes the output's `loss`.
        """
        return self.output_loss(model(inputs), targets)

    def validation_samples(self, model: torch.nn.Module) -> list[dict[str, str]]:
        """Text the model writes at each validation step, as {"prompt", "text"} dicts:
        written to events.jsonl (`validation_samples`) from rank 0's list. Every rank calls
        it (a sharded model's forward is collective); none by default."""
        return []

    def export_files(self, config: JobConfig) -> dict[str, bytes]:
        """Files an exporter needs besides the weights, by name: for `stalwart export
        --format hf`, `config.json` and the tokenizer's files. Rank 0 writes them into every
        checkpoint (signed with it), so export reads no task code."""
        return {}

    def checkpoint_identity(self, config: JobConfig) -> dict[str, Any]:
        """What this task's checkpoints are bound to beyond their tensors, by manifest key:
        a pretrained base model's files, for a task that checkpoints only adapters. Rank 0
        writes it into every manifest; `check_checkpoint` reads it back."""
        return {}

    def check_checkpoint(self, manifest: dict[str, Any], config: JobConfig) -> None:
        """Refuse (TaskError) a checkpoint this task cannot restore: runs on the driver for
        --resume and start_from, before any worker starts. The default compares each
        `checkpoint_identity` entry with the manifest's."""
        for key, value in self.checkpoint_identity(config).items():
            if manifest.get(key) != value:
                raise TaskError(f"checkpoint step {manifest.get('step')} has {key} = "
                                f"{manifest.get(key)!r}, but this task has {value!r}")

    def count_tokens(self, batch: Batch) -> int:
        """Tokens in one micro-batch, for tokens/s: the targets' elements of a pair,
        `labels` (else `input_ids`) of a dict, the samples of anything else."""
        return default_token_count(batch)

    def output_loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean loss of a model output (also what a pipeline's last stage computes); the
        default is cross entropy (next-token for [B, T, V] logits, classes for [B, C])."""
        return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten())

    def build_optimizer(self, model: torch.nn.Module, config: JobConfig
                        ) -> torch.optim.Optimizer:
        """AdamW; weight decay on matrices only (not norms or biases)."""
        decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
        groups = [{"params": decay, "weight_decay": config.train.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        # An empty group (adapters are all matrices) would break the flattened optimizer
        # state's round trip: every group must name a parameter.
        groups = [g for g in groups if g["params"]]
        # foreach=False: the per-tensor loop gives the same numbers for any sharding.
        return torch.optim.AdamW(groups, lr=config.train.lr, betas=(0.9, 0.95),
                                 foreach=False)

    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer, config: JobConfig
                           ) -> torch.optim.lr_scheduler.LRScheduler:
        """Linear warm-up to train.lr, then cosine decay to lr x min_lr_ratio at train.steps."""
        t = config.train

        def factor(step: int) -> float:
            if step < t.warmup_steps:
                return (step + 1) / t.warmup_steps
            span = max(1, t.steps - t.warmup_steps)
            progress = min(1.0, (step - t.warmup_steps) / span)
            return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def load_task_class(path: str) -> type[TrainTask]:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise TaskError(f"task path {path!r} is invalid: expected 'module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any import-time error of user code belongs in the message
        raise TaskError(f"task path {path!r}: cannot import module {module_name!r}: "
                        f"{type(exc).__name__}: {exc}{task_traceback(exc)}") from exc
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise TaskError(f"task path {path!r}: module {module_name!r} has no attribute "
                        f"{attr!r}") from None
    if not (inspect.isclass(obj) and issubclass(obj, TrainTask)):
        raise TaskError(f"task path {path!r} names {obj!r}, which is not a TrainTask subclass")
    return obj


def check_arg_names(cls: type[TrainTask], args: dict[str, Any]) -> None:
    """Refuse a [task.args] key the task's constructor does not take (one that takes
    `**kwargs` checks its own), before the constructor runs."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the constructor checks
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    allowed = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = sorted(set(args) - set(allowed))
    if unknown:
        raise TaskError(f"unknown key task.args.{unknown[0]} for {cls.__name__}; allowed: "
                        f"{', '.join(allowed) or 'none'}")


def build_task(path: str, args: dict[str, Any]) -> TrainTask:
    """Import and construct the task; errors name the path or the bad argument.

    This is how a task checks its arguments: its constructor runs here, on the driver,
    before Ray or any worker starts (Trainer.fit, `stalwart plan`), and raises TaskError,
    ValueError or TypeError naming the `task.args` key (see docs/tasks.md).
    """
    cls = load_task_class(path)
    check_arg_names(cls, args)
    return _construct(cls, args, path)


TaskLike = type[TrainTask] | TrainTask
"""A task handed over as itself (Trainer(task=...)) rather than by `task.path`."""


def task_path_of(task: TaskLike) -> str:
    """The `module:qualname` a handed-over task is recorded under (config.toml, manifests,
    events); `__main__:MyTask` for one defined in a script or a notebook."""
    cls = task if isinstance(task, type) else type(task)
    return f"{cls.__module__}:{cls.__qualname__}"


def resolve_task(path: str, args: dict[str, Any], supplied: TaskLike | None = None
                 ) -> TrainTask:
    """The run's task: built from `path` and `args`, or from a handed-over class (constructed
    with `args`) or instance (used as it is, so `args` must be empty).

    A handed-over task reaches the workers by value (shipped_task): pickled with cloudpickle,
    which copies a class defined in `__main__` or a notebook whole, as Ray does a function."""
    if supplied is None:
        return build_task(path, args)
    if isinstance(supplied, TrainTask):
        if args:
            raise TaskError(f"task.args {sorted(args)} cannot apply to a task that is already "
                            f"constructed ({type(supplied).__name__}); pass the class, or "
                            f"leave task.args empty")
        return supplied
    if not (inspect.isclass(supplied) and issubclass(supplied, TrainTask)):
        raise TaskError(f"task {supplied!r} is not a TrainTask subclass or instance")
    check_arg_names(supplied, args)
    return _construct(supplied, args, task_path_of(supplied))


def _construct(cls: type[TrainTask], args: dict[str, Any], path: str) -> TrainTask:
    """The task constructed with `args`: its TaskError, ValueError or TypeError refuses them
    (the message names the key); anything else is a bug in its constructor, told with its
    traceback."""
    try:
        return cls(**args)
    except TaskError:
        raise
    except (TypeError, ValueError) as exc:
        raise TaskError(f"task.args for {path!r} are invalid: {exc}") from exc
    except Exception as exc:
        raise TaskError(f"constructing the task {path!r} failed: {error_line(exc)}"
                        f"{task_traceback(exc)}") from exc


def shipped_task(task: TaskLike | bytes | None, import_paths: Sequence[str]
                 ) -> TaskLike | None:
    """A handed-over task as a worker receives it: pickled by the worker group, and loaded
    here once `import_paths` (where the driver finds the task's modules) are on sys.path."""
    for path in reversed(import_paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    return pickle.loads(task) if isinstance(task, bytes) else task
