"""Unit tests for the digits example task: data split, batches, model, validation, learning."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from stalwart.core.config import load_config
from stalwart.core.errors import TaskError
from stalwart.core.task import build_task
from stalwart.examples.digits.task import DigitsTask, split_indices

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

pytest.importorskip("sklearn")

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "digits" / "config.toml"
N_DIGITS = 1797


@pytest.fixture(scope="module")
def config():
    return load_config(CONFIG)


@pytest.fixture(scope="module")
def task() -> DigitsTask:
    return DigitsTask()


def test_train_and_val_add_up_to_the_whole_dataset(task, config) -> None:
    train, val = task.train_dataset(config), task.val_dataset(config)
    assert len(train) + len(val) == N_DIGITS
    assert len(val) == round(N_DIGITS * 0.2)


def test_split_is_disjoint_complete_and_deterministic() -> None:
    train, val = split_indices(N_DIGITS, 0.2)
    assert not set(train.tolist()) & set(val.tolist())
    assert sorted([*train.tolist(), *val.tolist()]) == list(range(N_DIGITS))
    again_train, again_val = split_indices(N_DIGITS, 0.2)
    assert np.array_equal(train, again_train) and np.array_equal(val, again_val)
    # a tiny fraction still holds out one image, and leaves at least one to train on
    assert [len(part) for part in split_indices(10, 0.001)] == [9, 1]
    assert [len(part) for part in split_indices(10, 0.999)] == [1, 9]


def test_two_tasks_hold_out_the_same_images(config) -> None:
    a, b = DigitsTask(hidden=8), DigitsTask(hidden=16)
    for ds_a, ds_b in ((a.train_dataset(config), b.train_dataset(config)),
                       (a.val_dataset(config), b.val_dataset(config))):
        assert torch.equal(ds_a.images, ds_b.images) and torch.equal(ds_a.labels, ds_b.labels)


def test_get_batch_dtypes_shapes_and_range(task, config) -> None:
    train = task.train_dataset(config)
    inputs, targets = train.get_batch(np.array([0, 5, 5, len(train) - 1]))
    assert inputs.shape == (4, 64) and inputs.dtype == torch.float32
    assert targets.shape == (4,) and targets.dtype == torch.int64
    assert torch.equal(inputs[1], inputs[2])
    assert 0 <= train.images.min() and train.images.max() == 1.0
    assert set(train.labels.unique().tolist()) == set(range(10))
    # the sampler hands out int64 numpy arrays; a plain list works too
    assert torch.equal(train.get_batch([0, 5])[1], targets[:2])


def test_model_shapes_blocks_and_initial_loss(config) -> None:
    task = DigitsTask(hidden=32, depth=3)
    torch.manual_seed(0)
    model = task.build_model(config)
    task.init_weights(model)
    assert len(model.layers) == 3  # one FSDP unit per hidden block
    inputs, targets = task.train_dataset(config).get_batch(np.arange(16))
    logits = model(inputs)
    assert logits.shape == (16, 10) and logits.dtype == torch.float32
    # Plain cross entropy for [B, 10] logits and [B] labels, and the accuracy beside it.
    loss, metrics = task.loss(model, inputs, targets)
    assert loss.shape == () and torch.allclose(loss, F.cross_entropy(logits, targets))
    assert abs(loss.item() - math.log(10)) < 0.1  # near-uniform first predictions
    assert set(metrics) == {"accuracy"}
    right = (logits.argmax(-1) == targets).sum().item()
    assert metrics["accuracy"].item() == pytest.approx(right / 16)


def test_init_weights_is_deterministic_from_the_global_seed(config) -> None:
    def weights(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        model = DigitsTask(hidden=16).build_model(config)
        model.init_weights()
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(weights(1), weights(1), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(weights(1), weights(2), strict=True))


@pytest.mark.parametrize(("args", "key"), [
    ({"hidden": 0}, "task.args.hidden"),
    ({"hidden": 1.5}, "task.args.hidden"),
    ({"hidden": True}, "task.args.hidden"),
    ({"depth": 0}, "task.args.depth"),
    ({"depth": "2"}, "task.args.depth"),
    ({"val_fraction": 0.0}, "task.args.val_fraction"),
    ({"val_fraction": 1.0}, "task.args.val_fraction"),
    ({"val_fraction": 1}, "task.args.val_fraction"),
])
def test_constructor_rejects_bad_args_naming_the_key(args, key) -> None:
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        DigitsTask(**args)


def test_build_task_by_path() -> None:
    task = build_task("stalwart.examples.digits.task:DigitsTask", {"hidden": 32})
    assert isinstance(task, DigitsTask) and task.hidden == 32 and task.depth == 2
    with pytest.raises(TaskError, match=r"task\.args\.depth"):
        build_task("stalwart.examples.digits.task:DigitsTask", {"depth": -1})
    with pytest.raises(TaskError, match="width"):
        build_task("stalwart.examples.digits.task:DigitsTask", {"width": 32})


def test_the_shipped_config_builds_its_task(config) -> None:
    assert config.task.path == "stalwart.examples.digits.task:DigitsTask"
    assert config.run.name == "digits" and config.scaling.num_workers == 2
    task = build_task(config.task.path, config.task.args)
    assert isinstance(task, DigitsTask)
    # the FSDP layout the ray tier also runs is a valid config
    fsdp = load_config(CONFIG, ["parallel.dp_shard=2", "parallel.dp_replicate=1"])
    assert fsdp.dp_size == 2 and fsdp.grad_accum_steps == 1


def test_missing_scikit_learn_is_one_clear_error(monkeypatch, config) -> None:
    task = DigitsTask()  # built while scikit-learn is importable
    monkeypatch.setitem(sys.modules, "sklearn", None)  # now `import sklearn` fails
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(TaskError, match="pip install scikit-learn"):
        DigitsTask()  # on the driver, before any worker starts
    with pytest.raises(TaskError, match="pip install scikit-learn"):
        task.train_dataset(config)  # and on a worker, where the data is loaded


def test_importing_the_module_does_not_import_scikit_learn() -> None:
    code = ("import sys, stalwart.examples.digits.task; "
            "assert 'sklearn' not in sys.modules, 'sklearn imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def one_thread():
    # One intra-op thread: 4x faster for matrices this small on a busy 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_shipped_schedule_learns_to_over_90_percent(config, one_thread) -> None:
    """The config's own steps, batch and lr in one process, through the task's optimizer and
    schedule (what each worker runs, minus the data-parallel split)."""
    task = build_task(config.task.path, config.task.args)
    torch.manual_seed(config.train.seed)
    model = task.build_model(config)
    task.init_weights(model)
    optimizer = task.build_optimizer(model, config)
    scheduler = task.build_lr_scheduler(optimizer, config)
    train, val = task.train_dataset(config), task.val_dataset(config)

    rng = np.random.default_rng(0)
    order = np.empty(0, dtype=np.int64)
    batch = config.train.global_batch_size
    for _ in range(config.train.steps):
        if len(order) < batch:
            order = np.concatenate([order, rng.permutation(len(train))])
        indices, order = order[:batch], order[batch:]
        loss, _ = task.loss(model, *train.get_batch(indices))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.train.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    with torch.no_grad():
        inputs, targets = val.get_batch(np.arange(len(val)))
        logits = model(inputs)
    accuracy = (logits.argmax(-1) == targets).float().mean().item()
    assert accuracy > 0.9, accuracy
    assert task.loss(model, inputs, targets)[1]["accuracy"].item() == pytest.approx(accuracy)
    assert F.cross_entropy(logits, targets).item() < 0.5
