"""Every parallel layout is exact: its ranks train like 1 process with the same global batch."""

from __future__ import annotations

import pytest
import torch

from stalwart.core.config import load_config
from stalwart.core.task import build_task
from stalwart.examples.gpt.data import build_token_files
from stalwart.workers.engine import TrainEngine
from tests.dist.launcher import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

# Eight steps: two of warm-up, six at full rate with Adam's moments built up; the one-process
# loss falls by over 1.5 nats in them (the learning check below asks for 0.5).
STEPS = 8


def tiny_config(world: int, cache_dir: str, layout: list[str]):
    return load_config(None, [
        f"scaling.num_workers={world}", "task.args.seq_len=32", "task.args.d_model=32",
        "task.args.n_layers=2", "task.args.n_heads=2", "train.global_batch_size=8",
        "train.micro_batch_size=2", f"train.steps={STEPS}", "train.warmup_steps=2",
        "train.lr=1e-2", f'data.cache_dir="{cache_dir}"', *layout])


def trained(rank: int, world: int, cache_dir: str, layout: list[str]
            ) -> tuple[TrainEngine, list[float]]:
    """This rank's engine after STEPS steps of the tiny config, and each step's loss."""
    config = tiny_config(world, cache_dir, layout)
    task = build_task(config.task.path, config.task.args)
    engine = TrainEngine(config, task, rank=rank, world_size=world, device=torch.device("cpu"))
    return engine, [engine.train_step()[0].loss for _ in range(STEPS)]


def train_losses(rank: int, world: int, cache_dir: str, layout: list[str]) -> list[float]:
    return trained(rank, world, cache_dir, layout)[1]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data")
    build_token_files(path / "gpt-stdlib")  # once, before the ranks race for it
    return str(path)


def final_weights(engine: TrainEngine) -> dict[str, torch.Tensor]:
    model = getattr(engine.model, "module", engine.model)  # DDP wraps the model
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_losses_and_weights(rank: int, world: int, cache_dir: str, layout: list[str]
                             ) -> tuple[list[float], dict[str, torch.Tensor]]:
    engine, losses = trained(rank, world, cache_dir, layout)
    return losses, final_weights(engine)


@pytest.fixture(scope="module")
def single_process(cache_dir) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, no parallelism: the losses every layout must reproduce, and the weights
    plain DDP's control compares with (one run serves both)."""
    return run_ranks(train_losses_and_weights, 1, cache_dir, [])[0]


@pytest.fixture(scope="module")
def single_process_losses(single_process) -> list[float]:
    return single_process[0]


# Plain FSDP2 ZeRO-3 at 2 ranks and plain TP at 2 (with sequence parallelism) are not cases of
# their own: fsdp2-selective-ac is that FSDP2 layout and tp2-full-ac that TP layout, each with
# activation checkpointing on top, under the same exactness check (fsdp4 shards ZeRO-3 too).
@pytest.mark.parametrize(("world", "layout"), [
    pytest.param(2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"], id="ddp2"),
    pytest.param(2, ["parallel.dp_shard=2", "parallel.reshard_after_forward=false"],
                 id="fsdp2-zero2"),
    pytest.param(4, ["parallel.dp_replicate=4", "parallel.dp_shard=1"], id="ddp4"),
    pytest.param(4, ["parallel.dp_shard=4"], id="fsdp4"),
    pytest.param(4, ["parallel.dp_replicate=2", "parallel.dp_shard=2"], id="hsdp2x2"),
    pytest.param(2, ["parallel.tp=2", "parallel.dp_shard=1", "parallel.sequence_parallel=false"],
                 id="tp2-no-sp"),
    pytest.param(4, ["parallel.tp=2", "parallel.dp_shard=2"], id="fsdp2xtp2"),
    pytest.param(4, ["parallel.tp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"],
                 id="replicate2xtp2"),
    pytest.param(2, ["parallel.dp_shard=2", "parallel.activation_checkpointing=selective"],
                 id="fsdp2-selective-ac"),
    pytest.param(2, ["parallel.tp=2", "parallel.dp_shard=1",
                     "parallel.activation_checkpointing=full"], id="tp2-full-ac"),
])
def test_layout_matches_one_process(cache_dir, single_process_losses, world, layout):
    per_rank = run_ranks(train_losses, world, cache_dir, layout)
    assert all(losses == per_rank[0] for losses in per_rank), "ranks disagree on the loss"
    assert single_process_losses[-1] < single_process_losses[0] - 0.5, "the model did not learn"
    assert per_rank[0] == pytest.approx(single_process_losses, rel=1e-5)


@pytest.mark.parametrize(("world", "layout", "rel"), [
    # bf16 compute with fp32 master weights and reduction: close to fp32, not equal.
    pytest.param(2, ["parallel.dp_shard=2", "parallel.mixed_precision=bf16"], 3e-2,
                 id="fsdp2-bf16"),
])
def test_mixed_precision_trains_close_to_fp32(cache_dir, single_process_losses, world, layout,
                                             rel):
    per_rank = run_ranks(train_losses, world, cache_dir, layout)
    assert per_rank[0] == pytest.approx(single_process_losses, rel=rel)


def test_compiled_blocks_match_eager(cache_dir, single_process_losses):
    # torch.compile (inductor, C++ on CPU) fuses ops, so the float results move slightly.
    per_rank = run_ranks(train_losses, 2, cache_dir, ["parallel.dp_shard=2", "parallel.compile=true"])
    assert per_rank[0] == pytest.approx(single_process_losses, rel=1e-3)


def train_weights(rank: int, world: int, cache_dir: str, layout: list[str]
                  ) -> dict[str, torch.Tensor]:
    return final_weights(trained(rank, world, cache_dir, layout)[0])


INVARIANT = ["parallel.dp_replicate=-1", "parallel.dp_shard=1", "parallel.invariant_reduction=true"]


def test_invariant_reduction_gives_the_same_bits_for_any_dp_degree(cache_dir):
    # 4 micro-batches per global batch: 1, 2 and 4 data-parallel ranks sum them in one order.
    weights = {world: run_ranks(train_weights, world, cache_dir, INVARIANT)[0]
               for world in (1, 2, 4)}
    for world in (2, 4):
        for key, value in weights[1].items():
            assert torch.equal(value, weights[world][key]), f"{key} differs at dp={world}"


def test_plain_ddp_is_not_bitwise_invariant(cache_dir, single_process):
    # The control: DDP's all-reduce sums in another order for another world size.
    one = single_process[1]  # one process, plain: no reduction at all
    four = run_ranks(train_weights, 4, cache_dir, ["parallel.dp_replicate=4",
                                                   "parallel.dp_shard=1"])[0]
    assert any(not torch.equal(v, four[k]) for k, v in one.items())
