"""An error in the task's code, told in its terms (stalwart/core/task_errors.py): the
traceback trimmed to the task's own frames, and which phase of the task failed, whether named
by the caller (the driver's check, a worker's warm-up) or read from the traceback (a step)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch import nn

from stalwart.core import task_errors as te
from stalwart.core.errors import TaskError
from stalwart.core.task_errors import Frame, Phase, TaskCodeError, task_phase

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

SITE = "/venv/lib/python3.11/site-packages"


def frame(module: str, filename: str = "", function: str = "f", **kw: object) -> Frame:
    return Frame(filename=filename or f"/src/{module.replace('.', '/')}.py", lineno=7,
                 function=function, line="x = y", module=module, **kw)


# ---------------------------------------------------------------------------- whose frame


@pytest.mark.parametrize(("module", "filename", "mine"), [
    ("my_task", "/home/me/proj/my_task.py", True),
    ("__main__", "/home/me/notebook.py", True),
    ("stalwart.examples.digits.task", "/work/examples/digits/task.py", True),
    ("stalwart.tasks.hf", f"{SITE}/stalwart/tasks/hf.py", True),
    ("stalwart.workers.engine", "/work/workers/engine.py", False),
    ("stalwart.core.batch", "/work/stalwart/core/batch.py", False),
    ("torch.nn.modules.linear", "/opt/torch/nn/modules/linear.py", False),
    ("ray.actor", f"{SITE}/ray/actor.py", False),
    ("concurrent.futures.thread", "/usr/lib/python3.11/concurrent/futures/thread.py", False),
    ("importlib._bootstrap", "<frozen importlib._bootstrap>", False),
    ("transformers.models.llama", f"{SITE}/transformers/models/llama.py", False),
    ("numpy.core", "/usr/lib/python3/dist-packages/numpy/core.py", False),
])
def test_a_frame_is_the_tasks_unless_stalwart_torch_ray_stdlib_or_installed(
        module: str, filename: str, mine: bool) -> None:
    assert te.is_task_frame(frame(module, filename)) is mine


def test_trim_keeps_the_tasks_frames_only() -> None:
    frames = [frame("stalwart.workers.engine"), frame("my_task", function="loss"),
              frame("torch.nn.modules.module", function="_call_impl"),
              frame("my_task", function="forward"), frame("torch.nn.functional")]
    kept, mine = te.trim(frames)
    assert mine and [f.function for f in kept] == ["loss", "forward"]


def test_with_none_of_the_tasks_frames_the_last_few_are_kept_without_torchs_plumbing() -> None:
    frames = [frame("stalwart.workers.engine", function=f"e{i}") for i in range(5)] + [
        frame("torch.nn.modules.module", function="_wrapped_call_impl"),
        frame("torch.nn.modules.module", function="_call_impl"),
        frame("torch.nn.modules.linear", function="forward")]
    kept, mine = te.trim(frames)
    assert not mine and [f.function for f in kept] == ["e3", "e4", "forward"]
    assert len(kept) == te.KEEP_LAST


def test_the_traceback_reads_as_pythons_and_ends_with_the_error() -> None:
    frames = [frame("stalwart.core.batch"), Frame(filename="/p/my_task.py", lineno=12,
                                                  function="forward", line="return self.fc(x)",
                                                  module="my_task")]
    assert te.format_traceback(frames, "RuntimeError: bad") == (
        "Traceback (most recent call last; the task's frames only):\n"
        '  File "/p/my_task.py", line 12, in forward\n'
        "    return self.fc(x)\n"
        "RuntimeError: bad")
    assert te.format_traceback([], "RuntimeError: bad") == ""
    assert "the last 1 frames, none in the task's code" in te.format_traceback(
        frames[:1], "RuntimeError: bad")


def test_an_error_is_one_line_and_stalwarts_own_keep_their_message() -> None:
    assert te.error_line(ValueError("bad\n  value")) == "ValueError: bad value"
    assert te.error_line(KeyError()) == "KeyError"
    assert te.error_line(TaskError("task.args.width = 0 is invalid")) == \
        "task.args.width = 0 is invalid"


# ---------------------------------------------------------------------------- which phase


@pytest.mark.parametrize(("frames", "phase"), [
    ([frame("stalwart.workers.engine", function="train_step"),
      frame("stalwart.core.batch", function="compute_loss"),
      frame("my_task", function="forward", in_model="in module `fc` (Linear)"),
      frame("torch.nn.functional", function="linear")],
     "the forward pass failed in module `fc` (Linear): E"),
    ([frame("stalwart.core.batch", function="compute_loss"),
      frame("my_task", function="loss"), frame("torch.nn.functional", function="cross_entropy")],
     "the loss failed: E"),
    ([frame("stalwart.workers.feeder", function="load", samples="samples [3, 4]"),
      frame("my_task", function="get_batch", samples="samples [4]")],
     "reading a batch (get_batch) failed at samples [4]: E"),
    ([frame("my_task", function="get_batch")], "reading a batch (get_batch) failed: E"),
    ([frame("torch._tensor", function="backward"), frame("torch.autograd.graph")],
     "the backward pass failed: E"),
    ([frame("torch.optim.lr_scheduler", function="step"), frame("my_task", function="factor")],
     "the learning-rate schedule failed: E"),
    ([frame("torch.optim.optimizer", function="wrapper"), frame("torch.optim.adamw")],
     "the optimizer step failed: E"),
    ([frame("stalwart.workers.engine", function="validate"),
      frame("stalwart.core.batch", function="compute_loss")],
     "the loss failed during validation: E"),
    ([frame("my_task", function="count_tokens")],
     "counting the batch's tokens (count_tokens) failed: E"),
])
def test_the_phase_is_read_from_the_innermost_frame_that_names_one(
        frames: list[Frame], phase: str) -> None:
    found = te.infer_phase(frames)
    assert found is not None and found.failed("E") == phase


def test_a_traceback_that_names_no_phase_has_none() -> None:
    assert te.infer_phase([frame("stalwart.checkpointing.storage.writer")]) is None
    assert te.task_failure(None, OSError("disk full"), []).summary == "OSError: disk full"


def test_samples_and_modules_are_described_briefly() -> None:
    assert te.describe_samples(np.array([0, 1])) == "samples [0, 1]"
    assert te.describe_samples(range(32)) == \
        "samples [0, 1, 2, 3, 4, 5, 6, 7, ...] (32 in all)"
    assert te.describe_samples(object()) is None
    assert te.describe_samples(["a"]) is None
    assert te.describe_module("fc1", "Linear", [(2, 3)]) == \
        "in module `fc1` (Linear), given input of shape (2, 3)"
    assert te.describe_module("", "Net", [(2, 3), (2,)]) == \
        "in the model (Net), given inputs of shape (2, 3), (2,)"


# ---------------------------------------------------------------------------- the error


def test_a_task_code_error_is_a_task_error_that_crosses_processes() -> None:
    error = TaskCodeError("the loss failed: E", "Traceback ...\nE").where("on a worker")
    again = pickle.loads(pickle.dumps(error))
    assert isinstance(again, TaskError)
    assert (again.summary, again.traceback, str(again)) == (
        "on a worker: the loss failed: E", "Traceback ...\nE",
        "on a worker: the loss failed: E\nTraceback ...\nE")
    assert str(again.noted("(a hint)")).endswith("\nE\n(a hint)")


def test_stalwarts_own_errors_keep_their_message_without_a_traceback() -> None:
    with pytest.raises(TaskCodeError) as caught, task_phase(te.LOSS):
        raise TaskError("a task's loss must return a scalar tensor")
    assert str(caught.value) == "the loss failed: a task's loss must return a scalar tensor"


# ---------------------------------------------------------------------------- live frames


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc1(x)  # the task's line the traceback must show


def test_a_wrong_shape_names_the_module_its_input_and_the_tasks_line() -> None:
    model = Net()
    with pytest.raises(TaskCodeError) as caught, task_phase(te.LOSS, model=model):
        model(torch.zeros(2, 2)).sum()
    error = caught.value
    assert error.summary.startswith(
        "the forward pass failed in module `fc1` (Linear(in_features=3, out_features=4, "
        "bias=True)), given input of shape (2, 2): RuntimeError: mat1 and mat2 shapes")
    # This file's frames are the task's here: the test's own call, then Net.forward.
    lines = error.traceback.splitlines()
    assert lines[0] == "Traceback (most recent call last; the task's frames only):"
    assert all(f'File "{__file__}"' in line for line in lines[1:-1:2])
    assert lines[-3].endswith(", in forward")
    assert lines[-2] == "    return self.fc1(x)  # the task's line the traceback must show"
    assert lines[-1].startswith("RuntimeError: mat1 and mat2 shapes")
    assert isinstance(error.__cause__, RuntimeError)


def test_a_failure_outside_the_models_forward_keeps_the_phase_it_was_given() -> None:
    model = Net()
    with pytest.raises(TaskCodeError) as caught, task_phase(te.LOSS, model=model):
        torch.nn.functional.cross_entropy(model(torch.zeros(2, 3)), torch.tensor([0.5]))
    assert caught.value.summary.startswith("the loss failed: ")


def test_the_samples_a_get_batch_was_asked_for_are_read_from_its_frame() -> None:
    class Data:
        def get_batch(self, rows: np.ndarray) -> None:
            raise IndexError(f"row {rows[-1]} is out of range")

    try:
        Data().get_batch(np.array([5, 9]))
    except IndexError as exc:
        frames = te.frames_of(exc)
    phase = te.infer_phase(frames)
    assert phase == Phase(te.BATCH, "at samples [5, 9]")
    failure = te.task_failure(phase, IndexError("row 9 is out of range"), frames)
    assert failure.summary == ("reading a batch (get_batch) failed at samples [5, 9]: "
                               "IndexError: row 9 is out of range")
    assert 'raise IndexError(f"row {rows[-1]} is out of range")' in failure.traceback
