"""The task tried on the driver before Ray starts, so that a bug in its code fails in seconds,
with its traceback, rather than on every worker half a minute later.

The model is built (first on the meta device, to count its parameters for free) and, when
that is cheap, two samples are read with the training dataset's `get_batch` and run forward,
through the loss and backward on the CPU: the calls a worker makes at its warm-up
(workers/model_warm_up.py), on the task's own instance. `task.check` says how far it goes:

- `auto` (the default) runs the samples when that is cheap and safe here: CPU workers, at
  most FORWARD_MAX_PARAMS parameters, no tensor or pipeline split (the unsplit model's
  forward is not what a rank runs), a model built for real (not on the meta device), and
  map-style data readable here. A stream is not read (indexing it reads every file, maybe
  remote ones). On a cluster, a task that prepares its data (prepare_data) has it prepared on
  the workers, so it is not read here either; on this machine's Ray the driver prepares it
  first, as the workers would (they then find it done). Anything else: the model is built
  and a one-line note says why the rest is left to the workers.
- `full` runs them whatever the size or the workers' device; `build` only builds the model;
  `off` tries nothing.

`stalwart submit` goes as far as `build`: the data lives where the job runs, and the job's
own `stalwart run` tries the rest there before its workers start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch

from stalwart.core import task_errors as phases
from stalwart.core.ray_private import ray_auto_start_off
from stalwart.core.stream import StreamDataset
from stalwart.core.task import TrainTask
from stalwart.core.task_errors import TaskCodeError, task_phase
from stalwart.parallel.meta_init import on_meta
from stalwart.workers.model_warm_up import (
    build_model,
    open_train_data,
    read_batch,
    run_micro_batch,
)

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig

# Parameters up to which `auto` runs the samples on the driver's CPU: forward and backward
# of two samples through a model this size take about a second.
FORWARD_MAX_PARAMS = 20_000_000
SAMPLES = 2

Where = Literal["local", "cluster", "submit"]
"""Where the run's workers are: on this machine's Ray (`local`), on a cluster this driver
joined (`cluster`), or on the cluster a job is submitted to (`submit`)."""

SUBMITTED = ("its data and forward pass are tried where the job runs, before its workers "
             "start")
HINT = ('(the task was tried on the driver before Ray started; task.check = "build" tries '
        'only its model, "off" nothing)')


def check_task(task: TrainTask, config: JobConfig, *, where: Where) -> str | None:
    """Try the task on the driver (see the module's docstring). An error in its code raises
    TaskCodeError naming the phase, with the task's frames; returns a one-line note when the
    samples were not run although they would be by `full`, else None."""
    mode = config.task.check
    if mode == "off":
        return None
    try:
        return _check(task, config, mode, where)
    except TaskCodeError as exc:
        raise exc.where("task check").noted(HINT) from exc


def _check(task: TrainTask, config: JobConfig, mode: str, where: Where) -> str | None:
    n_params = _count_on_meta(task, config)
    if n_params is not None:
        why = _not_here(task, config, mode, where, n_params)
        if why is not None:
            return _note(n_params, why, mode)
    # Built for real: to run it, or because it could not be built on the meta device (its
    # build then fails for real too, with the error that counts, or it was meta's limit).
    with torch.random.fork_rng(devices=[]):  # the driver's own RNG stays as it was
        torch.manual_seed(config.train.seed)
        model = build_model(task, config)
    n_params = _count(model)
    why = ("the task builds it on the meta device" if on_meta(model) else
           _not_here(task, config, mode, where, n_params))
    if why is not None:
        return _note(n_params, why, mode)
    # Data the task's code builds must not start a Ray of its own before the run's.
    with ray_auto_start_off():
        if where == "local" and _prepares_data(task):
            with task_phase(phases.PREPARE):
                task.prepare_data(config)
        data = open_train_data(task, config)
        if isinstance(data, StreamDataset):
            return _note(n_params, "a stream's files are read by the workers", mode)
        batch = read_batch(task, data, SAMPLES)
    model.train()
    run_micro_batch(task, model, batch)
    return None


def _count_on_meta(task: TrainTask, config: JobConfig) -> int | None:
    """The model's parameters, built on the meta device (no memory, no init); None when it
    cannot be built there."""
    try:
        with torch.device("meta"):
            model = task.build_model(config)
    except Exception:  # user code: its real build says what is wrong, if anything is
        return None
    return _count(model)


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied weight counts once


def _not_here(task: TrainTask, config: JobConfig, mode: str, where: Where,
              n_params: int) -> str | None:
    """Why the samples are not run on the driver, or None to run them."""
    if mode == "build":
        return "task.check = \"build\""
    if where == "submit":
        return SUBMITTED
    par = config.parallel
    if par.tp > 1 or par.pp > 1:
        return (f"parallel.tp = {par.tp} and parallel.pp = {par.pp} split it, and the unsplit "
                f"model is not what a rank runs")
    if where == "cluster" and _prepares_data(task):
        return "the task prepares its data on the workers (prepare_data)"
    if mode == "full":
        return None
    if config.scaling.gpus_per_worker > 0:
        return "the workers train on GPUs (task.check = \"full\" tries it on this CPU)"
    if n_params > FORWARD_MAX_PARAMS:
        return (f"it has more than {FORWARD_MAX_PARAMS:,} parameters (task.check = \"full\" "
                f"tries it here all the same)")
    return None


def _prepares_data(task: TrainTask) -> bool:
    return type(task).prepare_data is not TrainTask.prepare_data


def _note(n_params: int, why: str, mode: str) -> str | None:
    if mode == "build":  # what was asked for: nothing to explain
        return None
    rest = why if why == SUBMITTED else f"its data and forward pass are left to the workers: {why}"
    return f"task check: the model builds ({n_params:,} parameters); {rest}"
