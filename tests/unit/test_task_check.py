"""The task tried on the driver before Ray starts (stalwart/task_check.py), with the calls a
worker's warm-up makes (workers/model_warm_up.py): a bug in the task's code fails in
seconds, naming the phase and the task's line; what is not cheap or safe to try here is
built only, with a one-line note; and the warm-up reports the same errors as user errors.
No Ray: every task here is small, on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from stalwart.core.config import JobConfig, config_from_dict
from stalwart.core.task import TrainTask
from stalwart.core.task_errors import TaskCodeError
from stalwart.orchestrator import classify
from stalwart.orchestrator.failures import FailureKind
from stalwart.task_check import FORWARD_MAX_PARAMS, HINT, check_task
from stalwart.trainer import Trainer
from stalwart.workers.model_warm_up import warm_model

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


def config(*, check: str = "auto", **sections: dict[str, Any]) -> JobConfig:
    tables: dict[str, Any] = {
        "task": {"path": "unused:Task", "check": check},
        "scaling": {"num_workers": 1},
        "train": {"steps": 4, "warmup_steps": 1, "global_batch_size": 8,
                  "micro_batch_size": 8},
    }
    for name, table in sections.items():
        tables[name] = {**tables.get(name, {}), **table}
    return config_from_dict(tables)


class Rows:
    """Three features and a class label per sample; `bad_from` and up cannot be read."""

    def __init__(self, n: int = 64, bad_from: int | None = None) -> None:
        self.n, self.bad_from = n, bad_from

    def __len__(self) -> int:
        return self.n

    def get_batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        if self.bad_from is not None and max(indices) >= self.bad_from:
            raise IndexError(f"row {max(indices)} is not in the file")
        g = torch.Generator().manual_seed(int(indices[0]))
        return torch.randn(len(indices), 3, generator=g), torch.as_tensor(indices) % 2


class Net(nn.Module):
    def __init__(self, n_in: int = 3, width: int = 8) -> None:
        super().__init__()
        self.fc1 = nn.Linear(n_in, width)
        self.fc2 = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))  # the task's line a traceback shows


class Task(TrainTask):
    """A small classifier; each argument plants one kind of bug, or records what ran."""

    def __init__(self, *, n_in: int = 3, width: int = 8, data: Any = None,
                 build_error: bool = False, loss_shape: bool = False) -> None:
        self.n_in, self.width, self.build_error, self.loss_shape = \
            n_in, width, build_error, loss_shape
        self.data = Rows() if data is None else data
        self.calls: list[str] = []

    def build_model(self, config: JobConfig) -> nn.Module:
        self.calls.append("build_model")
        if self.build_error:
            return Net(n_in=self.n_in, widht=self.width)  # type: ignore[call-arg]
        return Net(self.n_in, self.width)

    def train_dataset(self, config: JobConfig) -> Any:
        self.calls.append("train_dataset")
        return self.data

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> Any:
        self.calls.append("loss")
        logits = model(inputs)
        if self.loss_shape:
            return nn.functional.cross_entropy(logits, targets, reduction="none")
        return nn.functional.cross_entropy(logits, targets)


def refused(task: TrainTask, cfg: JobConfig | None = None) -> TaskCodeError:
    with pytest.raises(TaskCodeError) as caught:
        check_task(task, cfg or config(), where="local")
    return caught.value


# ---------------------------------------------------------------------------- what fails


def test_a_good_task_runs_two_samples_through_its_loss_quietly() -> None:
    task = Task()
    assert check_task(task, config(), where="local") is None
    assert task.calls[-2:] == ["train_dataset", "loss"]


def test_a_wrong_in_features_fails_naming_the_module_and_the_tasks_line() -> None:
    error = refused(Task(n_in=5))
    assert error.summary == (
        "task check: the forward pass failed in module `fc1` (Linear(in_features=5, "
        "out_features=8, bias=True)), given input of shape (2, 3): RuntimeError: mat1 and "
        "mat2 shapes cannot be multiplied (2x3 and 5x8)")
    assert f'File "{__file__}"' in error.traceback
    assert "return self.fc2(torch.relu(self.fc1(x)))" in error.traceback
    assert "stalwart" not in error.traceback.replace(__file__, "")  # no frame of ours
    assert error.note == HINT and str(error).endswith(HINT)


def test_a_batch_that_cannot_be_read_names_its_samples() -> None:
    error = refused(Task(data=Rows(bad_from=1)))
    assert error.summary == ("task check: reading a batch (get_batch) failed at samples "
                             "[0, 1]: IndexError: row 1 is not in the file")
    assert 'raise IndexError(f"row {max(indices)} is not in the file")' in error.traceback


def test_a_model_that_cannot_be_built_says_so() -> None:
    error = refused(Task(build_error=True))
    assert error.summary.startswith("task check: building the model (build_model) failed: "
                                    "TypeError: ")
    assert "widht" in error.summary and "Net(n_in=self.n_in, widht" in error.traceback


def test_a_loss_that_is_not_a_scalar_fails_as_the_loss() -> None:
    error = refused(Task(loss_shape=True))
    assert error.summary == ("task check: the loss failed: a task's loss must return a scalar "
                             "tensor, or (loss, metrics); got a tensor of shape (2,)")


# ---------------------------------------------------------------------------- how far it goes


class Boom:
    """A dataset the check must not open: its length raises."""

    def __len__(self) -> int:
        raise AssertionError("the data was read")


def test_a_model_over_the_limit_is_built_on_meta_only_with_a_note() -> None:
    side = int(FORWARD_MAX_PARAMS ** 0.5) + 1
    task = Task(n_in=side, width=side, data=Boom())
    note = check_task(task, config(), where="local")
    assert note is not None and note.startswith("task check: the model builds (")
    assert f"more than {FORWARD_MAX_PARAMS:,} parameters" in note and "\n" not in note
    assert task.calls == ["build_model"]  # on the meta device: nothing allocated


@pytest.mark.parametrize(("cfg", "where", "why"), [
    (config(scaling={"gpus_per_worker": 1.0}), "local", "the workers train on GPUs"),
    (config(scaling={"num_workers": 2}, parallel={"tp": 2}), "local", "parallel.tp = 2"),
    (config(), "submit", "its data and forward pass are tried where the job runs"),
], ids=["gpus", "tensor-parallel", "submit"])
def test_what_is_not_cheap_or_safe_here_is_built_only(cfg: JobConfig, where: str,
                                                       why: str) -> None:
    task = Task(data=Boom())
    note = check_task(task, cfg, where=where)  # type: ignore[arg-type]
    assert note is not None and why in note and "\n" not in note
    assert "train_dataset" not in task.calls


def test_full_runs_the_samples_for_gpu_workers_on_this_cpu() -> None:
    task = Task()
    assert check_task(task, config(check="full", scaling={"gpus_per_worker": 1.0}),
                      where="local") is None
    assert task.calls[-1] == "loss"


def test_build_tries_the_model_only_and_off_nothing() -> None:
    task = Task(data=Boom())
    assert check_task(task, config(check="build"), where="local") is None
    assert task.calls == ["build_model"]
    broken = Task(build_error=True)
    assert check_task(broken, config(check="off"), where="local") is None
    assert broken.calls == []
    with pytest.raises(TaskCodeError, match="building the model"):
        check_task(broken, config(check="build"), where="local")


class Stream(Rows):
    """What the StreamDataset protocol asks for: the check must read none of it."""

    def bind(self, *, seed: int, global_batch: int, cache_dir: str) -> None:
        raise AssertionError("the stream was indexed")

    def read(self, start: int, count: int) -> Any:
        raise AssertionError("the stream was read")

    def identity(self) -> dict[str, Any]:
        return {}


def test_a_stream_is_not_read_here() -> None:
    note = check_task(Task(data=Stream()), config(), where="local")
    assert note is not None and "a stream's files are read by the workers" in note


class Prepared(Task):
    """Its data exists once prepare_data has run (as on a worker)."""

    def __init__(self, *, folder: str) -> None:
        super().__init__()
        self.folder = Path(folder)

    def prepare_data(self, config: JobConfig) -> None:
        self.calls.append("prepare_data")
        (self.folder / "ready").write_text("yes")

    def train_dataset(self, config: JobConfig) -> Any:
        assert (self.folder / "ready").exists(), "prepare_data did not run first"
        return super().train_dataset(config)


def test_data_a_task_prepares_is_prepared_here_for_this_machines_workers_only(
        tmp_path: Path) -> None:
    task = Prepared(folder=str(tmp_path))
    note = check_task(task, config(), where="cluster")
    assert note is not None and "prepares its data on the workers (prepare_data)" in note
    assert not (tmp_path / "ready").exists()
    assert check_task(task, config(), where="local") is None
    assert task.calls[-3:] == ["prepare_data", "train_dataset", "loss"]


class MetaTask(Task):
    def build_model(self, config: JobConfig) -> nn.Module:
        with torch.device("meta"):
            return Net()


def test_a_model_the_task_builds_on_the_meta_device_is_built_only() -> None:
    note = check_task(MetaTask(data=Boom()), config(), where="local")
    assert note is not None and "the task builds it on the meta device" in note


class RayCheckingData(Rows):
    def __init__(self) -> None:
        from ray._private import auto_init_hook

        # A lazy Ray Data pipeline built here would start a Ray of its own, with Ray's
        # defaults, before the run's.
        assert auto_init_hook.enable_auto_connect is False
        super().__init__()


def test_the_data_cannot_start_a_ray_of_its_own() -> None:
    from ray._private import auto_init_hook

    class RayTask(Task):
        def train_dataset(self, config: JobConfig) -> Any:
            return RayCheckingData()

    before = auto_init_hook.enable_auto_connect
    assert check_task(RayTask(), config(), where="local") is None
    assert auto_init_hook.enable_auto_connect is before


# ---------------------------------------------------------------------------- the trainer


def test_the_trainer_refuses_a_broken_task_before_ray_and_writes_nothing(
        tmp_path: Path) -> None:
    import ray

    with pytest.raises(TaskCodeError, match="task check: the forward pass failed"):
        Trainer(config(), task=Task(n_in=5), run_dir=tmp_path / "run").fit()
    assert not ray.is_initialized()
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------- a worker


def test_a_workers_warm_up_fails_the_same_way_as_a_user_error() -> None:
    with pytest.raises(TaskCodeError) as caught:
        warm_model(Task(n_in=5), config())
    assert caught.value.summary.startswith("the forward pass failed in module `fc1`")
    assert "given input of shape (8, 3)" in caught.value.summary  # a whole micro-batch
    failure = classify.warm_up_failed(caught.value, now=5.0)
    assert failure.kind is FailureKind.USER_ERROR and failure.rank is None
    summary, _, traceback = failure.message.partition("\n")
    assert summary.startswith("on a worker, before training: the forward pass failed in "
                              "module `fc1`")
    assert traceback == caught.value.traceback


# ---------------------------------------------------------------------------- import, construct


def test_an_import_error_in_the_tasks_module_shows_its_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stalwart.core.errors import TaskError
    from stalwart.core.task import build_task

    (tmp_path / "needs_a_package.py").write_text("import numpy\nimport not_installed_pkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(TaskError) as caught:
        build_task("needs_a_package:Task", {})
    first, *rest = str(caught.value).splitlines()
    assert first == ("task path 'needs_a_package:Task': cannot import module "
                     "'needs_a_package': ModuleNotFoundError: No module named "
                     "'not_installed_pkg'")
    assert rest[1:] == [f'  File "{tmp_path / "needs_a_package.py"}", line 2, in <module>',
                        "    import not_installed_pkg",
                        "ModuleNotFoundError: No module named 'not_installed_pkg'"]
    # a module that is not there at all: one line, nothing of importlib's
    with pytest.raises(TaskError) as missing:
        build_task("no_such_module_here:Task", {})
    assert "\n" not in str(missing.value)


class Clumsy(TrainTask):
    def __init__(self, *, width: int = 4) -> None:
        self.width = width
        self.layers = {}.pop("layers")  # a bug, not a refused argument


def test_a_bug_in_the_constructor_is_told_with_its_line() -> None:
    from stalwart.core.errors import TaskError
    from stalwart.core.task import resolve_task

    with pytest.raises(TaskError) as caught:
        resolve_task("unused:Path", {}, Clumsy)
    first, *rest = str(caught.value).splitlines()
    assert first == ("constructing the task 'tests.unit.test_task_check:Clumsy' failed: "
                     "KeyError: 'layers'")
    assert '    self.layers = {}.pop("layers")  # a bug, not a refused argument' in rest


# ---------------------------------------------------------------------------- a training step


class ScheduleBug(Task):
    def build_lr_scheduler(self, optimizer: torch.optim.Optimizer, config: JobConfig) -> Any:
        def factor(step: int) -> float:
            if step == 1:
                raise ZeroDivisionError("the schedule's bug")
            return 1.0

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@pytest.mark.parametrize(("task", "says"), [
    (Task(n_in=5), "the forward pass failed in module `fc1` (Linear(in_features=5, "
                   "out_features=8, bias=True)), given input of shape (8, 3): RuntimeError"),
    (Task(data=Rows(bad_from=40)), "reading a batch (get_batch) failed at samples ["),
    (ScheduleBug(), "the learning-rate schedule failed: ZeroDivisionError: the schedule's bug"),
], ids=["forward", "batch", "schedule"])
def test_a_training_steps_error_is_named_from_its_traceback(task: Task, says: str) -> None:
    """What a worker reports of its training thread's error (Worker._step_failure), read from
    a real step's traceback: no phase wrapper runs there."""
    from stalwart.core.task_errors import frames_of, infer_phase, task_failure
    from stalwart.workers.engine import TrainEngine

    engine = TrainEngine(config(), task, rank=0, world_size=1, device=torch.device("cpu"))
    try:
        with pytest.raises(Exception) as caught:
            for _ in range(4):
                engine.train_step()
        frames = frames_of(caught.value, engine.model)
        failure = task_failure(infer_phase(frames), caught.value, frames)
    finally:
        engine.close()
    assert failure.summary.startswith(says), failure.summary
    assert f'File "{__file__}"' in failure.traceback
