"""A task's batches and what its loss returns, as the engine handles them.

A dataset's `get_batch(indices)` returns one of:

  a tensor                       the model's input; the task's loss reads what it needs
  a tuple or list of tensors     (inputs, targets) is the classic pair
  a dict of tensors              Hugging Face style: input_ids, attention_mask, labels, ...

A task's loss returns a scalar tensor, or `(loss, metrics)` where metrics is a dict of
scalars (floats or 0-d tensors) averaged like the loss and written to metrics.jsonl under
their own names (and as `val_<name>` after a validation pass).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from stalwart.core.errors import TaskError
from stalwart.core.metric_names import check_metric_name

if TYPE_CHECKING:
    from stalwart.core.task import TrainTask

Batch = Any
"""A tensor, a tuple or list of tensors, or a dict of tensors (nested ones too)."""


def map_tensors(batch: Batch, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """The batch with `fn` applied to every tensor in it (other leaves kept as they are)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, Mapping):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(map_tensors(v, fn) for v in batch)
    return batch


def to_device(batch: Batch, device: torch.device) -> Batch:
    """The batch with every tensor in it moved to `device` (other leaves kept as they are)."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def default_token_count(batch: Batch) -> int:
    """Tokens (or samples) in a batch, for tokens/s: the targets' elements of a pair,
    `labels` (else `input_ids`) of a dict, the samples of anything else."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 \
            and isinstance(batch[1], torch.Tensor):
        return batch[1].numel()
    if isinstance(batch, Mapping):
        for key in ("labels", "input_ids"):
            if isinstance(batch.get(key), torch.Tensor):
                return batch[key].numel()
    return batch_samples(batch)


def batch_samples(batch: Batch) -> int:
    """The batch's first dimension: its number of samples (to weight a validation mean)."""
    if isinstance(batch, torch.Tensor):
        return len(batch) if batch.ndim else 1
    values = batch.values() if isinstance(batch, Mapping) else \
        batch if isinstance(batch, (tuple, list)) else ()
    for v in values:
        if isinstance(v, torch.Tensor) and v.ndim:
            return len(v)
    raise TaskError(f"cannot count the samples of a batch of type {type(batch).__name__}: "
                    f"get_batch must return a tensor, a tuple or list of tensors, or a dict "
                    f"of tensors")


def as_pair(batch: Batch, why: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (inputs, targets) pair that `why` needs, or a TaskError saying what was found."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    found = f"a dict with keys {sorted(batch)}" if isinstance(batch, Mapping) \
        else f"a {type(batch).__name__}"
    raise TaskError(f"{why} needs (inputs, targets) batches, but get_batch returned {found}; "
                    f"define loss(self, model, batch) to take the batch whole")


def loss_takes_batch(task: TrainTask) -> bool:
    """Whether the task's loss is `loss(model, batch)` rather than `loss(model, inputs,
    targets)`: exactly two positional parameters after self, and no *args."""
    try:
        params = list(inspect.signature(task.loss).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return False
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params) == 2


def compute_loss(task: TrainTask, model: torch.nn.Module, batch: Batch, *,
                 takes_batch: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The task's loss of one micro-batch and its metrics (checked, as 0-d tensors).

    A dict batch with the pair-style default loss goes to the model as keyword arguments,
    and the output's `loss` is the loss (what a Hugging Face model computes from `labels`).
    """
    if takes_batch:
        out = task.loss(model, batch)
    elif isinstance(batch, Mapping) and _default_loss(task):
        output = model(**batch)
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, Mapping):
            loss = output.get("loss")
        if loss is None:
            raise TaskError(f"the model's output for a dict batch has no loss (keys: "
                            f"{sorted(batch)}); pass labels, or define loss(self, model, batch)")
        out = loss
    else:
        out = task.loss(model, *as_pair(batch, f"{type(task).__name__}.loss(model, inputs, "
                                               f"targets)"))
    return split_loss_output(out)


def _default_loss(task: TrainTask) -> bool:
    from stalwart.core.task import TrainTask

    return type(task).loss is TrainTask.loss


def split_loss_output(out: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(loss, metrics) of what a loss returned: a scalar tensor, or (loss, dict of scalars)."""
    metrics: Any = {}
    if isinstance(out, tuple) and len(out) == 2:
        out, metrics = out
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        raise TaskError(f"a task's loss must return a scalar tensor, or (loss, metrics); "
                        f"got {_describe(out)}")
    if not isinstance(metrics, Mapping):
        raise TaskError(f"the metrics a loss returns must be a dict of scalars; got "
                        f"{_describe(metrics)}")
    checked: dict[str, torch.Tensor] = {}
    for name, value in metrics.items():
        check_metric_name(name)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            checked[name] = value.detach().reshape(()).float()
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            checked[name] = torch.tensor(float(value), device=out.device)
        else:
            raise TaskError(f"metric {name!r} must be a number or a one-element tensor; got "
                            f"{_describe(value)}")
    return out.reshape(()), checked


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"
