"""A checkpoint saved in one layout loads into another through DCP resharding: identical full
weights after the load, and training continues exactly as it would have in the first layout."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from stalwart.checkpointing.storage.catalog import read_step_dir
from stalwart.checkpointing.storage.layout import join, step_dir_name
from stalwart.checkpointing.storage.writer import StorageCheckpointer
from stalwart.core.task import build_task
from stalwart.workers.engine import TrainEngine
from tests.dist.launcher import run_ranks
from tests.dist.test_data_parallel import cache_dir, tiny_config  # noqa: F401 (fixture)
from tests.keys import trust

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

SAVE_AT, CONTINUE = 4, 3
UNTIED = ["task.args.n_layers=4", "task.args.tie_embeddings=false"]
REFERENCE_SIZE = ["task.args.d_model=128", "task.args.n_heads=4", "task.args.n_layers=4"]
POWERSGD = ["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.grad_compression=powersgd",
            "parallel.powersgd_start_step=2", "parallel.powersgd_rank=4"]


def full_weights(engine: TrainEngine) -> dict[str, torch.Tensor]:
    # cpu_offload=False: with True only global rank 0 gets the tensors, and with a pipeline
    # every pp rank holds other layers.
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {k: v.clone() for k, v in get_model_state_dict(engine.model, options=options).items()}


def make_engine(rank: int, world: int, cache: str, layout: list[str]) -> TrainEngine:
    config = tiny_config(world, cache, layout)
    task = build_task(config.task.path, config.task.args)
    return TrainEngine(config, task, rank=rank, world_size=world, device=torch.device("cpu"))


def save_then_continue(rank, world, cache, layout, storage):
    engine = make_engine(rank, world, cache, layout)
    for _ in range(SAVE_AT):
        engine.train_step()
    ckpt = StorageCheckpointer(storage, rank=rank, keep_last=0, async_save=False,
                               manifest_extra={"world_size": world}, trust=trust())
    ckpt.save(SAVE_AT, engine.state_dict())
    ckpt.close()
    weights = full_weights(engine)
    losses = [engine.train_step()[0].loss for _ in range(CONTINUE)]
    return weights, losses


def load_then_continue(rank, world, cache, layout, storage):
    engine = make_engine(rank, world, cache, layout)
    ckpt = StorageCheckpointer(storage, rank=rank, keep_last=0, async_save=False,
                               manifest_extra={}, trust=trust())
    state = engine.state_dict()
    path = join(storage, step_dir_name(SAVE_AT))
    ckpt.load(path, read_step_dir(path).manifest["files"], state)
    engine.load_state_dict(state)
    ckpt.close()
    assert engine.step == SAVE_AT and engine.samples_seen == SAVE_AT * 8
    weights = full_weights(engine)
    losses = [engine.train_step()[0].loss for _ in range(CONTINUE)]
    return weights, losses


@pytest.mark.parametrize(("source", "target"), [
    pytest.param((4, ["parallel.dp_shard=4"]), (4, ["parallel.tp=2", "parallel.dp_shard=2"]),
                 id="fsdp4-to-fsdp2xtp2"),
    pytest.param((2, ["parallel.tp=2", "parallel.dp_shard=1"]), (2, ["parallel.dp_shard=2"]),
                 id="tp2-to-fsdp2"),
    pytest.param((2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"]), (1, []),
                 id="ddp2-to-one-process"),
    pytest.param((2, ["parallel.cp=2", "parallel.dp_shard=1"]), (1, []), id="cp2-to-one-process"),
    pytest.param((4, ["parallel.dp_shard=4"]), (4, ["parallel.cp=2", "parallel.tp=2",
                                                    "parallel.dp_shard=1"]),
                 id="fsdp4-to-tp2xcp2"),
    pytest.param((4, ["parallel.cp=2", "parallel.dp_shard=2"]),
                 (4, ["parallel.cp=2", "parallel.dp_shard=2"]), id="cp2xfsdp2-to-itself"),
    # PowerSGD's error feedback and factors come back: the resume is exact (a restarted
    # process has other DDP buckets in its first step; the state is kept per parameter).
    pytest.param((2, POWERSGD), (2, POWERSGD), id="ddp2-powersgd-to-itself"),
    # The reference model's size: DDP makes two buckets (its first holds 1 MB), whose
    # reductions must start in the same order on every rank.
    pytest.param((2, [*POWERSGD, *REFERENCE_SIZE]), (2, [*POWERSGD, *REFERENCE_SIZE]),
                 id="ddp2-powersgd-two-buckets-to-itself"),
    pytest.param((2, [*UNTIED, "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"]),
                 (4, [*UNTIED, "parallel.tp=2", "parallel.dp_shard=2"]),
                 id="pp2-interleaved-to-fsdp2xtp2"),
    pytest.param((4, [*UNTIED, "parallel.dp_shard=4"]), (4, [*UNTIED, "parallel.pp=2",
                                                               "parallel.tp=2"]),
                 id="fsdp4-to-tp2xpp2"),
    pytest.param((4, [*UNTIED, "parallel.pp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"]),
                 (4, [*UNTIED, "parallel.pp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"]),
                 id="replicate2xpp2-to-itself"),
    # Each stage's optimizer state is keyed by parameter name: with keys by group index the
    # stages' entries collided in DCP and a stage restored without its learning rate.
    pytest.param((2, [*UNTIED, "parallel.pp=2", "parallel.dp_shard=1"]),
                 (2, [*UNTIED, "parallel.pp=2", "parallel.dp_shard=1"]), id="pp2-to-itself"),
])
def test_checkpoint_loads_into_another_layout(tmp_path, cache_dir, source, target):  # noqa: F811
    storage = str(tmp_path / "ckpt")
    saved = run_ranks(save_then_continue, source[0], cache_dir, source[1], storage)
    loaded = run_ranks(load_then_continue, target[0], cache_dir, target[1], storage)
    # With a pipeline each rank holds only its stages' weights: merge what all ranks hold.
    saved_weights = {k: v for weights, _ in saved for k, v in weights.items()}
    loaded_weights = {k: v for weights, _ in loaded for k, v in weights.items()}
    saved_losses, loaded_losses = saved[0][1], loaded[0][1]
    assert saved_weights.keys() == loaded_weights.keys()
    for key, value in saved_weights.items():
        assert torch.equal(value, loaded_weights[key]), f"{key} differs after resharding"
    # The optimizer state and data position came along: training continues the same way.
    assert loaded_losses == pytest.approx(saved_losses, rel=1e-5)
    if source == target:  # a restore into the same layout is exact
        assert loaded_losses == saved_losses
