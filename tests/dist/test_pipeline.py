"""Pipeline parallelism is exact: every schedule, alone and composed with FSDP and TP, trains
like one process with the same global batch (the GPT untied: its head is on the last stage)."""

from __future__ import annotations

import pytest

from tests.dist.launcher import run_ranks
from tests.dist.test_data_parallel import STEPS, cache_dir, train_losses  # noqa: F401 (fixture)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

# Four blocks, so that the interleaved schedules have 2 stages on each of 2 ranks.
PP_MODEL = ["task.args.n_layers=4", "task.args.tie_embeddings=false"]


@pytest.fixture(scope="module")
def untied_losses(cache_dir) -> list[float]:  # noqa: F811
    return run_ranks(train_losses, 1, cache_dir, PP_MODEL)[0]


@pytest.mark.parametrize(("world", "layout"), [
    pytest.param(2, ["parallel.pp=2", "parallel.pp_schedule=gpipe"], id="pp2-gpipe"),
    pytest.param(2, ["parallel.pp=2", "parallel.pp_schedule=1f1b"], id="pp2-1f1b"),
    pytest.param(2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"],
                 id="pp2-interleaved"),
    pytest.param(2, ["parallel.pp=2", "parallel.pp_schedule=zero_bubble"], id="pp2-zero-bubble"),
    pytest.param(4, ["parallel.pp=2", "parallel.dp_shard=2"], id="fsdp2xpp2"),
    # Replicas of each stage: HSDP with a shard group of one (DDP cannot take a schedule).
    pytest.param(4, ["parallel.pp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"],
                 id="replicate2xpp2"),
    pytest.param(4, ["parallel.pp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1",
                     "parallel.pp_schedule=interleaved_1f1b"], id="replicate2xpp2-interleaved"),
    pytest.param(4, ["parallel.pp=2", "parallel.tp=2", "parallel.dp_shard=1"], id="tp2xpp2"),
])
def test_pipeline_matches_one_process(cache_dir, untied_losses, world, layout):  # noqa: F811
    per_rank = run_ranks(train_losses, world, cache_dir, [*PP_MODEL, *layout])
    assert all(losses == per_rank[0] for losses in per_rank), "ranks disagree on the loss"
    assert len(untied_losses) == STEPS and untied_losses[-1] < untied_losses[0] - 0.5
    assert per_rank[0] == pytest.approx(untied_losses, rel=1e-5)


def val_loss_after_training(rank: int, world: int, cache: str, layout: list[str]) -> float:
    import torch

    from stalwart.core.task import build_task
    from stalwart.workers.engine import TrainEngine
    from tests.dist.test_data_parallel import tiny_config

    config = tiny_config(world, cache, layout)
    engine = TrainEngine(config, build_task(config.task.path, config.task.args), rank=rank,
                         world_size=world, device=torch.device("cpu"))
    for _ in range(3):
        engine.train_step()
    return engine.validate()[0]


@pytest.fixture(scope="module")
def single_val_loss(cache_dir) -> float:  # noqa: F811
    return run_ranks(val_loss_after_training, 1, cache_dir, PP_MODEL)[0]


@pytest.mark.parametrize(("world", "layout"), [
    pytest.param(2, ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"], id="pp2"),
    pytest.param(2, ["parallel.tp=2", "parallel.dp_shard=1"], id="tp2"),
])
def test_validation_loss_is_layout_independent(cache_dir, single_val_loss, world,  # noqa: F811
                                               layout):
    per_rank = run_ranks(val_loss_after_training, world, cache_dir, [*PP_MODEL, *layout])
    assert per_rank == pytest.approx([single_val_loss] * world, rel=1e-5)
