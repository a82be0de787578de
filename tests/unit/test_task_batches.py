"""The task contract beyond (inputs, targets): dict and single-tensor batches, a loss that takes
the batch whole, and the task's own metrics, through one real TrainEngine in one process."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from stalwart.core.batch import (
    compute_loss,
    default_token_count,
    loss_takes_batch,
    split_loss_output,
    to_device,
)
from stalwart.core.config import load_config
from stalwart.core.errors import TaskError
from stalwart.core.events import MetricsRow
from stalwart.core.metric_names import RESERVED, check_metric_name, is_task_metric
from stalwart.core.task import TrainTask
from stalwart.examples.digits.task import DigitsDataset, DigitsTask
from stalwart.parallel.dims import ParallelDims
from stalwart.workers.engine import TrainEngine

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "digits" / "config.toml"


class DictData:
    """The digits as Hugging Face style dict batches."""

    def __init__(self, pairs: DigitsDataset) -> None:
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def get_batch(self, indices: Any) -> dict[str, torch.Tensor]:
        images, labels = self.pairs.get_batch(indices)
        return {"images": images, "labels": labels}


class DictDigits(DigitsTask):
    """The same model and numbers as DigitsTask, from dict batches and loss(model, batch)."""

    def train_dataset(self, config: Any) -> DictData:
        return DictData(super().train_dataset(config))

    def val_dataset(self, config: Any) -> DictData:
        return DictData(super().val_dataset(config))

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
        return super().loss(model, batch["images"], batch["labels"])


class KeywordMLP(nn.Module):
    """A model called as model(**batch) that computes its own loss from `labels`, as a
    Hugging Face model does."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def init_weights(self) -> None:
        self.inner.init_weights()

    def forward(self, images: torch.Tensor, labels: torch.Tensor | None = None
                ) -> SimpleNamespace:
        logits = self.inner(images)
        loss = nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SimpleNamespace(logits=logits, loss=loss)


class KeywordDigits(DictDigits):
    """Dict batches and the default loss: the model's own `loss` output is used."""

    loss = TrainTask.loss  # type: ignore[assignment]

    def build_model(self, config: Any) -> KeywordMLP:
        return KeywordMLP(super().build_model(config))


@pytest.fixture(scope="module")
def config():
    return load_config(CONFIG, ["train.steps=10", "train.warmup_steps=2"])


def _engine(task: TrainTask, config: Any) -> TrainEngine:
    torch.set_num_threads(1)
    return TrainEngine(config, task, rank=0, world_size=1, device=torch.device("cpu"))


def _train(task: TrainTask, config: Any, steps: int = 3) -> tuple[TrainEngine, list[Any]]:
    engine = _engine(task, config)
    return engine, [engine.train_step()[0] for _ in range(steps)]


def test_a_dict_batch_with_loss_of_the_batch_trains_exactly_as_the_pair(config) -> None:
    pair_engine, pair = _train(DigitsTask(), config)
    dict_engine, as_dict = _train(DictDigits(), config)
    assert [r.loss for r in as_dict] == [r.loss for r in pair]
    assert [r.metrics for r in as_dict] == [r.metrics for r in pair]
    assert [r.tokens for r in as_dict] == [r.tokens for r in pair] == [64] * 3  # labels
    for a, b in zip(pair_engine.model.parameters(), dict_engine.model.parameters(),
                    strict=True):
        assert torch.equal(a, b)


def test_metrics_are_the_mean_over_micro_batches(config) -> None:
    """Two micro-batches of 32 per step (global 64, one rank): the step's accuracy is their
    mean, measured before the update on the step's own 64 samples."""
    task = DigitsTask()
    engine = _engine(task, config)
    items = engine.sampler.items(0, 64)
    with torch.no_grad():
        accuracies = [task.loss(engine.model, *engine.train_data.get_batch(items[i:i + 32]))[1]
                      ["accuracy"].item() for i in (0, 32)]
    report, _ = engine.train_step()
    assert set(report.metrics) == {"accuracy"}
    assert report.metrics["accuracy"] == pytest.approx(sum(accuracies) / 2, abs=1e-6)


def test_validation_reports_the_task_metrics_under_val_names(config) -> None:
    engine, _ = _train(DictDigits(), config, steps=2)
    val_loss, metrics = engine.validate()
    assert set(metrics) == {"val_accuracy"} and 0 <= metrics["val_accuracy"] <= 1
    pair_engine, _ = _train(DigitsTask(), config, steps=2)
    assert pair_engine.validate() == (val_loss, metrics)


def test_a_dict_batch_and_the_default_loss_take_the_models_own_loss(config) -> None:
    _, keyword = _train(KeywordDigits(), config)
    _, pair = _train(DigitsTask(), config)
    assert [r.loss for r in keyword] == [r.loss for r in pair]
    assert all(r.metrics == {} for r in keyword)


def test_metric_names_must_stay_the_same_from_step_to_step(config) -> None:
    class Fickle(DigitsTask):
        calls = 0

        def loss(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> Any:
            Fickle.calls += 1
            loss, metrics = super().loss(model, images, labels)
            return (loss, metrics) if Fickle.calls <= 2 else loss  # two micro-batches a step

    engine = _engine(Fickle(), config)
    engine.train_step()
    with pytest.raises(TaskError, match=r"returned metrics \[\] at step 2, but \['accuracy'\]"):
        engine.train_step()


def test_which_loss_signature_a_task_has() -> None:
    class Whole(TrainTask):
        def loss(self, model: Any, batch: Any) -> Any: ...

    class Pair(TrainTask):
        def loss(self, model: Any, inputs: Any, targets: Any = None) -> Any: ...

    class Star(TrainTask):
        def loss(self, model: Any, *batch: Any) -> Any: ...

    assert loss_takes_batch(Whole())
    assert not loss_takes_batch(TrainTask())
    assert not loss_takes_batch(Pair())
    assert not loss_takes_batch(Star())


def test_a_loss_of_the_whole_batch_cannot_be_pipelined() -> None:
    class Whole(DigitsTask):
        def loss(self, model: Any, batch: Any) -> Any: ...

        def split_pipeline(self, model: Any, stage_ids: Any, num_stages: int) -> Any: ...

    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=2)
    with pytest.raises(TaskError, match="loss.model, batch. cannot run across pipeline stages"):
        Whole().check_layout(dims)


def test_batches_move_to_the_device_whole() -> None:
    batch = {"a": torch.ones(2), "b": (torch.zeros(1), [torch.ones(1)]), "n": 3}
    moved = to_device(batch, torch.device("cpu"))
    assert moved["n"] == 3 and isinstance(moved["b"], tuple) and isinstance(moved["b"][1], list)
    assert torch.equal(moved["b"][1][0], torch.ones(1))


@pytest.mark.parametrize(("batch", "tokens"), [
    ((torch.zeros(4, 8), torch.zeros(4, 8)), 32),                  # a pair: its targets
    ({"input_ids": torch.zeros(4, 8), "labels": torch.zeros(4, 7)}, 28),
    ({"input_ids": torch.zeros(4, 8), "attention_mask": torch.ones(4, 8)}, 32),
    (torch.zeros(5, 3, 2), 5),                                      # samples
    ({"pixels": torch.zeros(6, 3)}, 6),
])
def test_tokens_of_a_batch(batch: Any, tokens: int) -> None:
    assert default_token_count(batch) == tokens


def test_what_a_loss_may_return() -> None:
    loss, metrics = split_loss_output((torch.tensor([2.0]), {"acc": torch.tensor(0.5), "n": 3}))
    assert loss.shape == () and metrics["acc"].item() == 0.5 and metrics["n"].item() == 3.0
    with pytest.raises(TaskError, match=r"scalar tensor, or \(loss, metrics\); got a tensor "
                                        r"of shape \(2,\)"):
        split_loss_output(torch.zeros(2))
    with pytest.raises(TaskError, match="must be a dict of scalars; got a list"):
        split_loss_output((torch.tensor(1.0), [1.0]))
    with pytest.raises(TaskError, match="metric 'acc' must be a number or a one-element tensor"):
        split_loss_output((torch.tensor(1.0), {"acc": torch.zeros(3)}))
    with pytest.raises(TaskError, match="metric name 'loss' is taken"):
        split_loss_output((torch.tensor(1.0), {"loss": 1.0}))


def test_a_pair_loss_refuses_another_batch_by_name() -> None:
    with pytest.raises(TaskError, match=r"needs \(inputs, targets\) batches, but get_batch "
                                        r"returned a Tensor; define loss\(self, model, batch\)"):
        compute_loss(DigitsTask(), nn.Identity(), torch.zeros(2, 64), takes_batch=False)


def test_a_dict_batch_whose_model_computes_no_loss() -> None:
    model = KeywordMLP(DigitsTask().build_model(None))
    batch = {"images": torch.zeros(2, 64)}
    with pytest.raises(TaskError, match=r"has no loss \(keys: \['images'\]\); pass labels"):
        compute_loss(KeywordDigits(), model, batch, takes_batch=False)


@pytest.mark.parametrize("name", ["accuracy", "top5", "f1_macro"])
def test_good_metric_names(name: str) -> None:
    check_metric_name(name)
    assert is_task_metric(name) and is_task_metric(f"val_{name}")


@pytest.mark.parametrize("name", ["", "5top", "acc-1", "val_acc", "step", "tokens_per_s", 3])
def test_bad_metric_names(name: Any) -> None:
    with pytest.raises(TaskError, match="metric name"):
        check_metric_name(name)


def test_reserved_names_are_the_columns_every_row_has() -> None:
    row = MetricsRow(step=1, loss=1.0, lr=1.0, tokens_per_s=1.0, world_size=1,
                     samples_seen=1, time=1.0, window_s=1.0, steps_in_window=1).to_row()
    assert set(row) == RESERVED


def test_a_row_carries_the_task_metrics_as_columns(tmp_path: Path) -> None:
    from stalwart.core.events import dumps, read_metrics

    row = MetricsRow(step=5, loss=1.0, lr=1.0, tokens_per_s=1.0, world_size=1, samples_seen=1,
                     time=1.0, val_loss=0.5, task_metrics={"accuracy": 0.9,
                                                           "val_accuracy": 0.8})
    assert row.to_row()["accuracy"] == 0.9 and row.to_row()["val_accuracy"] == 0.8
    path = tmp_path / "metrics.jsonl"
    path.write_text(dumps(row) + "\n")
    assert read_metrics(path) == [row]


def test_digits_arrays_are_what_the_tests_above_train_on() -> None:
    # DictData wraps the pair dataset item for item.
    data = DictDigits().train_dataset(load_config(CONFIG))
    batch = data.get_batch(np.arange(3))
    images, labels = data.pairs.get_batch(np.arange(3))
    assert torch.equal(batch["images"], images) and torch.equal(batch["labels"], labels)
