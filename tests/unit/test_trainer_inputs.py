"""What Trainer(task=..., config=...) accepts, checked on the driver before anything starts:
a task class or instance instead of task.path, and a config as a file, a dict or nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.core.config import JobConfig, load_config
from stalwart.core.errors import ConfigError, TaskError
from stalwart.core.events import MetricsRow
from stalwart.core.task import TrainTask, resolve_task, task_path_of
from stalwart.examples.digits.task import DigitsTask
from stalwart.trainer import LastMetrics, Trainer, as_job_config

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits" / "config.toml"


class Inline(TrainTask):
    def __init__(self, *, width: int = 4) -> None:
        if width < 1:
            raise ValueError(f"task.args.width = {width} is invalid: must be >= 1")
        self.width = width


def test_a_class_is_constructed_with_task_args_and_checked() -> None:
    assert resolve_task("unused:Path", {"width": 7}, Inline).width == 7
    with pytest.raises(TaskError, match="unknown key task.args.depth for Inline; allowed: width"):
        resolve_task("unused:Path", {"depth": 1}, Inline)
    with pytest.raises(TaskError, match="task.args for .*Inline' are invalid: task.args.width"):
        resolve_task("unused:Path", {"width": 0}, Inline)


def test_an_instance_is_used_as_it_is_and_takes_no_args() -> None:
    task = Inline(width=3)
    assert resolve_task("unused:Path", {}, task) is task
    with pytest.raises(TaskError, match=r"task.args \['width'\] cannot apply to a task that is "
                                        r"already constructed \(Inline\)"):
        resolve_task("unused:Path", {"width": 2}, task)


def test_anything_else_is_refused() -> None:
    with pytest.raises(TaskError, match="is not a TrainTask subclass or instance"):
        resolve_task("unused:Path", {}, object)  # type: ignore[arg-type]


def test_without_a_task_the_path_is_imported() -> None:
    assert isinstance(resolve_task("stalwart.examples.digits.task:DigitsTask", {}), DigitsTask)


def test_a_handed_over_task_is_recorded_by_its_name(tmp_path: Path) -> None:
    assert task_path_of(Inline) == task_path_of(Inline()) == \
        "tests.unit.test_trainer_inputs:Inline"
    trainer = Trainer(DIGITS, task=Inline, run_dir=tmp_path / "run")
    assert trainer.config.task.path == "tests.unit.test_trainer_inputs:Inline"
    assert trainer.config.task.args == load_config(DIGITS).task.args  # the file's own


def test_a_config_may_be_a_file_a_dict_or_nothing() -> None:
    assert as_job_config(DIGITS) == as_job_config(str(DIGITS)) == load_config(DIGITS)
    assert as_job_config(None) == load_config(None)
    config = as_job_config({"train": {"steps": 7, "warmup_steps": 2}})
    assert isinstance(config, JobConfig) and config.train.steps == 7
    with pytest.raises(ConfigError, match="unknown key train.stepz"):
        as_job_config({"train": {"stepz": 7}})
    with pytest.raises(ConfigError, match="must be a JobConfig, a TOML file's path, a dict"):
        as_job_config(42)  # type: ignore[arg-type]


def test_the_last_metrics_keep_the_last_validation() -> None:
    last = LastMetrics()

    def row(step: int, **extra) -> MetricsRow:
        return MetricsRow(step=step, loss=1.0, lr=1.0, tokens_per_s=1.0, world_size=2,
                          samples_seen=step, time=1.0, **extra)

    last.on_metrics(row(10, val_loss=0.5, task_metrics={"acc": 0.1, "val_acc": 0.2}))
    last.on_metrics(row(20, task_metrics={"acc": 0.3}))
    assert last.row["step"] == 20 and last.row["acc"] == 0.3
    assert last.row["val_loss"] == 0.5 and last.row["val_acc"] == 0.2
