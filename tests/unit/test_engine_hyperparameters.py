"""A restore trains with the restoring run's hyperparameters, not the checkpoint's: what
`--resume` with a new train.lr and Population Based Training's exploit rely on."""

from __future__ import annotations

import copy

import pytest
import torch

from stalwart.core.config import load_config
from stalwart.core.task import build_task
from stalwart.workers.engine import TrainEngine
from tests.cli_helpers import REFERENCE_CONFIG, TINY

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("data"))


def _engine(data_dir: str, *overrides: str) -> TrainEngine:
    torch.set_num_threads(1)
    config = load_config(REFERENCE_CONFIG, [*TINY, f"data.cache_dir={data_dir}",
                                            "train.steps=20", *overrides])
    task = build_task(config.task.path, config.task.args)
    task.prepare_data(config)
    torch.manual_seed(config.train.seed)
    return TrainEngine(config, task, rank=0, world_size=1, device=torch.device("cpu"))


def _lrs(engine: TrainEngine) -> list[float]:
    return [g["lr"] for g in engine.optimizer.param_groups]


def test_same_config_restores_the_checkpoints_lr_exactly(data_dir: str) -> None:
    trained = _engine(data_dir)
    for _ in range(7):
        trained.train_step()
    restored = _engine(data_dir)
    restored.load_state_dict(copy.deepcopy(trained.state_dict()))
    assert _lrs(restored) == _lrs(trained)
    assert restored.scheduler.get_last_lr() == trained.scheduler.get_last_lr()


def test_a_new_lr_applies_at_the_same_place_in_the_schedule(data_dir: str) -> None:
    trained = _engine(data_dir, "train.lr=3e-3", "train.weight_decay=0.1")
    for _ in range(7):
        trained.train_step()
    restored = _engine(data_dir, "train.lr=1e-3", "train.weight_decay=0.0")
    restored.load_state_dict(copy.deepcopy(trained.state_dict()))
    fresh = _engine(data_dir, "train.lr=1e-3", "train.weight_decay=0.0")
    for _ in range(7):  # the same schedule from scratch with the new base LR
        fresh.train_step()
    assert _lrs(restored) == pytest.approx(_lrs(fresh), rel=1e-12)
    assert [g["weight_decay"] for g in restored.optimizer.param_groups] == [0.0, 0.0]
    assert restored.scheduler.base_lrs == [1e-3, 1e-3]
    assert restored.step == 7
    restored.train_step()
    fresh.train_step()
    assert _lrs(restored) == pytest.approx(_lrs(fresh), rel=1e-12)  # and it stays on it
