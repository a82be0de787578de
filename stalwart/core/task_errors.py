"""An error in the task's own code, told in the task's terms: which phase of the task failed
(building the model, a batch and its samples, the forward pass and in which module, the loss,
...) and the traceback trimmed to the task's own frames.

The driver's task check and a worker's warm-up run each phase inside `task_phase`, which
turns whatever the task's code raises into a TaskCodeError. A training step has no such
wrapper around each call, so its phase is read from the traceback itself (`infer_phase`).
Both see the traceback as `Frame` records (`frames_of`): plain text, holding no reference to
the frames, so an error can cross to the driver. Everything but `frames_of` and
`task_phase` is a pure function of those records.
"""

from __future__ import annotations

import linecache
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import PurePath
from typing import Any

from stalwart.core.errors import StalwartError, TaskError

# The phases of a task, as a message names them: "<phase> failed: <error>" (see Phase).
PREPARE = "preparing the data (prepare_data)"
BUILD = "building the model (build_model)"
INIT = "initialising the weights (init_weights)"
DATASET = "opening the training data (train_dataset)"
BATCH = "reading a batch (get_batch)"
TOKENS = "counting the batch's tokens (count_tokens)"
FORWARD = "the forward pass"
LOSS = "the loss"
BACKWARD = "the backward pass"
SCHEDULE = "the learning-rate schedule"
OPTIMIZER = "the optimizer step"
SAMPLES = "writing validation samples (validation_samples)"

# Frames kept when none is the task's own: the innermost ones, where it broke.
KEEP_LAST = 3
# How many sample indices a message lists before it says how many there are in all.
SHOWN_INDICES = 8
# Packages whose frames are never the task's (beside the standard library and installed
# packages): stalwart's own machinery, torch and Ray, wherever they were installed from.
LIBRARIES = ("stalwart", "torch", "ray")
# torch's frames between a module's call and its forward.
MODULE_CALL = {("torch.nn.modules.module", "_wrapped_call_impl"),
               ("torch.nn.modules.module", "_call_impl")}
# stalwart's modules that are tasks (its examples and the tasks it ships): the task's code.
TASK_MODULES = ("stalwart.examples", "stalwart.tasks")


@dataclass(frozen=True, kw_only=True)
class Frame:
    """One frame of a traceback, as text."""

    filename: str
    lineno: int
    function: str
    line: str = ""
    """The source line, stripped; empty when the file cannot be read."""
    module: str = ""
    """The frame's module (`__name__` of its globals)."""
    in_model: str | None = None
    """For the forward of one of the model's modules: which one, and on what inputs."""
    samples: str | None = None
    """For a dataset's read: the samples it was asked for."""


# ---------------------------------------------------------------------------- pure


def is_task_frame(frame: Frame) -> bool:
    """Whether a frame is in the task's own code: not stalwart's machinery, torch, Ray, the
    standard library or an installed package. stalwart's examples and shipped tasks count as
    task code."""
    module = frame.module
    if module == TASK_MODULES[0] or module.startswith(tuple(m + "." for m in TASK_MODULES)):
        return True
    top = module.partition(".")[0]
    if top in LIBRARIES or top in sys.stdlib_module_names:
        return False
    if frame.filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    return not {"site-packages", "dist-packages"} & set(PurePath(frame.filename).parts)


def trim(frames: Sequence[Frame]) -> tuple[list[Frame], bool]:
    """The task's frames, and True; or, when none is the task's, the last KEEP_LAST frames
    (but torch's module-call plumbing, which says nothing) and False."""
    mine = [f for f in frames if is_task_frame(f)]
    if mine:
        return mine, True
    said = [f for f in frames if (f.module, f.function) not in MODULE_CALL]
    return said[-KEEP_LAST:], False


def error_line(exc: BaseException) -> str:
    """The error as one line: stalwart's own errors by their message (written for the user),
    any other as `Type: message`."""
    text = " ".join(str(exc).split())
    if isinstance(exc, StalwartError) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def format_traceback(frames: Sequence[Frame], error: str) -> str:
    """The frames (trimmed to the task's) as Python prints a traceback, ending with `error`;
    empty without frames."""
    if not frames:
        return ""
    kept, mine = trim(frames)
    head = ("Traceback (most recent call last; the task's frames only):" if mine else
            f"Traceback (most recent call last; the last {len(kept)} frames, none in the "
            f"task's code):")
    lines = [head]
    for f in kept:
        lines.append(f'  File "{f.filename}", line {f.lineno}, in {f.function}')
        if f.line:
            lines.append(f"    {f.line}")
    return "\n".join([*lines, error])


@dataclass(frozen=True)
class Phase:
    """A phase of the task, as a message names it: `<what> failed <detail>: <error>`."""

    what: str
    detail: str = ""
    """Where inside it: the module of a forward pass, the samples of a batch."""

    def failed(self, error: str) -> str:
        return f"{self.what} failed{' ' + self.detail if self.detail else ''}: {error}"

    def during(self, context: str) -> Phase:
        return Phase(self.what, f"{self.detail} {context}".strip())


def batch_phase(samples: str | None) -> Phase:
    """Reading a batch, at the samples it was asked for when they are known."""
    return Phase(BATCH, f"at {samples}" if samples else "")


def infer_phase(frames: Sequence[Frame]) -> Phase | None:
    """Which phase of the task a traceback failed in, read from its frames (innermost first);
    None when none says. A validation step's phase says so."""
    phase = next((p for p in map(_phase_of_frame, reversed(frames)) if p), None)
    if phase and any(f.function == "validate" and f.module == "stalwart.workers.engine"
                     for f in frames):
        phase = phase.during("during validation")
    return phase


def _phase_of_frame(f: Frame) -> Phase | None:
    if f.in_model is not None:
        return Phase(FORWARD, f.in_model)
    if (f.module, f.function) == ("stalwart.core.batch", "compute_loss") \
            or f.function == "output_loss":
        return Phase(LOSS)
    if f.samples is not None or f.function == "get_batch":
        return batch_phase(f.samples)
    named = {"count_tokens": TOKENS, "validation_samples": SAMPLES}.get(f.function)
    if named:
        return Phase(named)
    if f.module == "torch._tensor" and f.function == "backward" \
            or f.module.startswith("torch.autograd"):
        return Phase(BACKWARD)
    if f.module.startswith("torch.optim.lr_scheduler"):
        return Phase(SCHEDULE)
    if f.module.startswith("torch.optim"):
        return Phase(OPTIMIZER)
    return None


def describe_samples(indices: Any) -> str | None:
    """`samples [0, 1]` (the first SHOWN_INDICES, and how many in all); None when `indices`
    are not a sequence of integers."""
    try:
        values = [int(i) for i in list(indices)[:SHOWN_INDICES + 1]]
        total = len(indices)
    except (TypeError, ValueError):
        return None
    shown = ", ".join(map(str, values[:SHOWN_INDICES]))
    return f"samples [{shown}]" if total <= SHOWN_INDICES else \
        f"samples [{shown}, ...] ({total} in all)"


def describe_module(name: str, text: str, shapes: Sequence[tuple[int, ...]]) -> str:
    """Where in the model a forward failed: in module `fc1` (Linear(...)), with the shapes of
    the tensors it was given. `text`: the module's repr when that is one short line, else its
    class name."""
    where = f"in module `{name}` ({text})" if name else f"in the model ({text})"
    if shapes:
        given = ", ".join(str(tuple(s)) for s in shapes)
        where += f", given input{'s' if len(shapes) > 1 else ''} of shape {given}"
    return where


# ---------------------------------------------------------------------------- the error


class TaskCodeError(TaskError):
    """The task's code raised during one of its phases: `summary` says where and what (one
    line), `traceback` holds its frames (trimmed to the task's), `note` what to do."""

    def __init__(self, summary: str, traceback: str = "", note: str = "") -> None:
        self.summary, self.traceback, self.note = summary, traceback, note
        super().__init__("\n".join(p for p in (summary, traceback, note) if p))

    def __reduce__(self) -> tuple[Any, ...]:  # crosses from a worker to the driver (Ray)
        return type(self), (self.summary, self.traceback, self.note)

    def where(self, prefix: str) -> TaskCodeError:
        """The same error, its summary starting with where it happened."""
        return TaskCodeError(f"{prefix}: {self.summary}", self.traceback, self.note)

    def noted(self, note: str) -> TaskCodeError:
        return TaskCodeError(self.summary, self.traceback, note)


def task_failure(phase: Phase | str | None, exc: BaseException, frames: Sequence[Frame]
                 ) -> TaskCodeError:
    """`<phase> failed: <error>`, with the trimmed traceback. stalwart's own errors carry a
    message written for the user: theirs is left out, as is a phase that is not known."""
    error = error_line(exc)
    phase = Phase(phase) if isinstance(phase, str) else phase
    summary = phase.failed(error) if phase else error
    if isinstance(exc, StalwartError):
        return TaskCodeError(summary)
    return TaskCodeError(summary, format_traceback(frames, error))


# ---------------------------------------------------------------------------- live frames


def task_traceback(exc: BaseException) -> str:
    """`exc`'s traceback trimmed to the task's frames, on lines of its own after a newline;
    empty when none of its frames is the task's (a module that is not there at all)."""
    frames = frames_of(exc)
    if not any(map(is_task_frame, frames)):
        return ""
    return "\n" + format_traceback(frames, error_line(exc))


def frames_of(exc: BaseException, model: Any = None) -> list[Frame]:
    """The frames of `exc`'s traceback as text. `model` (a torch module): a frame running the
    forward of one of its modules says which one (`Frame.in_model`)."""
    names = {id(m): n for n, m in model.named_modules()} if model is not None else {}
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frame, code = tb.tb_frame, tb.tb_frame.f_code
        local = frame.f_locals
        frames.append(Frame(
            filename=code.co_filename, lineno=tb.tb_lineno, function=code.co_name,
            line=linecache.getline(code.co_filename, tb.tb_lineno).strip(),
            module=str(frame.f_globals.get("__name__", "")),
            in_model=_in_model(code, local, names),
            samples=_samples(code, local, frame.f_globals.get("__name__"))))
        tb = tb.tb_next
    return frames


def _in_model(code: Any, local: dict[str, Any], names: dict[int, str]) -> str | None:
    module = local.get("self")
    if code.co_name != "forward" or id(module) not in names:
        return None
    text = repr(module)
    if "\n" in text or len(text) > 100:
        text = type(module).__name__
    args = [local.get(a) for a in code.co_varnames[1:code.co_argcount]]
    shapes = [tuple(a.shape) for a in args if hasattr(a, "shape") and hasattr(a, "dtype")]
    return describe_module(names[id(module)], text, shapes)


def _samples(code: Any, local: dict[str, Any], module: Any) -> str | None:
    """The samples a dataset's get_batch was asked for (its first argument), or those the
    feeder was reading."""
    if code.co_name == "get_batch" and code.co_argcount >= 2:
        return describe_samples(local.get(code.co_varnames[1]))
    if (module, code.co_name) == ("stalwart.workers.feeder", "load") and "start" in local:
        items = local.get("items")
        if items is not None:
            return describe_samples(items)
        start, count = local["start"], local["count"]
        return f"positions {start}-{start + count - 1} of the sample order"
    return None


@contextmanager
def task_phase(phase: Phase | str, *, model: Any = None) -> Iterator[None]:
    """Run one phase of the task: what its code raises becomes a TaskCodeError naming the
    phase. With `model`, a failure inside one of its modules' forward is named as that."""
    try:
        yield
    except TaskCodeError:
        raise
    except Exception as exc:
        frames = frames_of(exc, model)
        found = infer_phase(frames) if model is not None else None
        raise task_failure(found if found and found.what == FORWARD else phase, exc,
                           frames) from exc
