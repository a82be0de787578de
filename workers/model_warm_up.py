"""A worker's first model: built and run once before the worker joins a world, so the world
does not wait for torch's lazy start-up, and so the task's model, data and loss are checked
before any world forms.

Each call into the task runs as a named phase (stalwart.core.task_errors): an error in the
task's code says which one failed, with its traceback trimmed to the task's frames. The
driver's task check (stalwart/task_check.py) tries the task with these same steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from stalwart.core import task_errors as phases
from stalwart.core.batch import compute_loss, loss_takes_batch
from stalwart.core.task_errors import task_phase
from stalwart.parallel.meta_init import on_meta, tied_groups
from stalwart.workers.feeder import bind_dataset

if TYPE_CHECKING:
    import torch

    from stalwart.core.batch import Batch
    from stalwart.core.config import JobConfig
    from stalwart.core.task import Dataset, TrainTask


def warm_model(task: TrainTask, config: JobConfig) -> list[list[str]]:
    """Build the model and run one micro-batch forward and backward, then drop it all.

    The first model built in a process pays for torch's lazy initialisation (allocator,
    kernels, autograd), about 0.2 s even for a tiny model; a replacement should not pay it
    while its peers wait. The world's model is built anew at setup (its sharding depends on
    the world), from the seed, so this one is thrown away. Returns the groups of parameter
    names that share one tensor (tied embeddings), which checkpoints record for exporters.
    """
    model = build_model(task, config)
    data = open_train_data(task, config)
    # A stream indexes its files here, before any world forms (the index is cached).
    with task_phase(phases.DATASET):
        bind_dataset(data, seed=config.train.seed,
                     global_batch=config.train.global_batch_size,
                     cache_dir=config.data.cache_dir)
    # A batch it cannot read or count fails here, before the world forms.
    batch = read_batch(task, data, config.train.micro_batch_size)
    if not on_meta(model):  # one built on the meta device is too big to hold whole here
        run_micro_batch(task, model, batch)
    return tied_groups(model)


def build_model(task: TrainTask, config: JobConfig) -> torch.nn.Module:
    """The task's model as a rank builds it: `build_model`, then `init_weights` unless it was
    built on the meta device (a rank then initialises its shards once they are allocated)."""
    with task_phase(phases.BUILD):
        model = task.build_model(config)
    if not on_meta(model):
        with task_phase(phases.INIT):
            task.init_weights(model)
    return model


def open_train_data(task: TrainTask, config: JobConfig) -> Dataset:
    with task_phase(phases.DATASET):
        return task.train_dataset(config)


def read_batch(task: TrainTask, data: Dataset, samples: int) -> Batch:
    """The first `samples` samples of `data` (fewer if it holds fewer), counted as a step
    counts them."""
    with task_phase(phases.DATASET):
        indices = np.arange(min(len(data), samples))
    with task_phase(phases.batch_phase(phases.describe_samples(indices))):
        batch = data.get_batch(indices)
    with task_phase(phases.TOKENS):
        task.count_tokens(batch)
    return batch


def run_micro_batch(task: TrainTask, model: torch.nn.Module, batch: Batch) -> Any:
    """One micro-batch forward through the task's loss, and backward; returns the loss."""
    with task_phase(phases.LOSS, model=model):
        loss, _ = compute_loss(task, model, batch, takes_batch=loss_takes_batch(task))
    with task_phase(phases.BACKWARD):
        loss.backward()
    return loss
