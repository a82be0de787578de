"""A worker's first model: built and run once before the worker joins a world, so the world
does not wait for torch's lazy start-up, and so the task's model, data and loss are checked
before any world forms."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from stalwart.core.batch import compute_loss, loss_takes_batch
from stalwart.parallel.meta_init import on_meta, tied_groups
from stalwart.workers.feeder import bind_dataset

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig
    from stalwart.core.task import TrainTask


def warm_model(task: TrainTask, config: JobConfig) -> list[list[str]]:
    """Build the model and run one micro-batch forward and backward, then drop it all.

    The first model built in a process pays for torch's lazy initialisation (allocator,
    kernels, autograd), about 0.2 s even for a tiny model; a replacement should not pay it
    while its peers wait. The world's model is built anew at setup (its sharding depends on
    the world), from the seed, so this one is thrown away. Returns the groups of parameter
    names that share one tensor (tied embeddings), which checkpoints record for exporters.
    """
    model = task.build_model(config)
    data = task.train_dataset(config)
    # A stream indexes its files here, before any world forms (the index is cached).
    bind_dataset(data, seed=config.train.seed, global_batch=config.train.global_batch_size,
                 cache_dir=config.data.cache_dir)
    batch = data.get_batch(np.arange(min(len(data), config.train.micro_batch_size)))
    task.count_tokens(batch)  # a batch it cannot count fails here, before the world forms
    if not on_meta(model):  # one built on the meta device is too big to hold whole here
        task.init_weights(model)
        loss, _ = compute_loss(task, model, batch, takes_batch=loss_takes_batch(task))
        loss.backward()
    return tied_groups(model)
