"""Expert parallelism is exact: the MoE example with its experts split over ep ranks (alone,
with more data-parallel ranks than ep, under HSDP) trains like one process on the same batch,
loss and gradients; its checkpoints load into any other ep."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.dist.launcher import run_ranks
from tests.dist.test_checkpoint_reshard import load_then_continue, save_then_continue
from tests.dist.test_context_parallel import first_gradients
from tests.dist.test_data_parallel import cache_dir, train_losses  # noqa: F401 (fixture)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

MOE = ['task.path="stalwart.examples.moe.task:MoETask"', "task.args.n_experts=4",
       "task.args.top_k=2"]
LAYOUTS = [
    pytest.param(2, ["parallel.dp_shard=2", "parallel.ep=2"], id="ep2"),
    pytest.param(4, ["parallel.dp_shard=4", "parallel.ep=2"], id="ep2xfsdp4"),
    pytest.param(4, ["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.ep=2"],
                 id="ep2xhsdp2x2"),
]


@pytest.fixture(scope="module")
def one_process(cache_dir) -> list[float]:  # noqa: F811
    return run_ranks(train_losses, 1, cache_dir, MOE)[0]


def test_the_moe_example_learns_and_balances(one_process) -> None:
    assert one_process[-1] < one_process[0] - 0.5


@pytest.mark.parametrize(("world", "layout"), LAYOUTS)
def test_expert_parallel_trains_like_one_process(cache_dir, one_process, world,  # noqa: F811
                                                 layout):
    per_rank = run_ranks(train_losses, world, cache_dir, [*MOE, *layout])
    assert all(losses == per_rank[0] for losses in per_rank), "ranks disagree on the loss"
    assert per_rank[0] == pytest.approx(one_process, rel=1e-5)


@pytest.mark.parametrize(("world", "layout"), LAYOUTS[:2])
def test_expert_parallel_gradients_equal_one_process(cache_dir, world, layout):  # noqa: F811
    want = run_ranks(first_gradients, 1, cache_dir, MOE)[0]
    # Each rank holds its own experts whole: the union over ranks is the whole model.
    got = {k: v for rank in run_ranks(first_gradients, world, cache_dir, [*MOE, *layout])
           for k, v in rank.items()}
    assert got.keys() == want.keys()
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    assert not any(isinstance(g, DTensor) for g in got.values())


@pytest.mark.parametrize(("source", "target"), [
    pytest.param((2, ["parallel.dp_shard=2", "parallel.ep=2"]), (1, []), id="ep2-to-ep1"),
    pytest.param((1, []), (2, ["parallel.dp_shard=2", "parallel.ep=2"]), id="ep1-to-ep2"),
    pytest.param((4, ["parallel.dp_shard=4", "parallel.ep=2"]),
                 (4, ["parallel.dp_shard=4", "parallel.ep=4"]), id="ep2-to-ep4"),
])
def test_moe_checkpoints_load_into_another_ep(tmp_path, cache_dir, source, target):  # noqa: F811
    storage = str(tmp_path / "ckpt")
    saved = run_ranks(save_then_continue, source[0], cache_dir, [*MOE, *source[1]], storage)
    loaded = run_ranks(load_then_continue, target[0], cache_dir, [*MOE, *target[1]], storage)
    merge = lambda ranks: {k: v for weights, _ in ranks for k, v in weights.items()}  # noqa: E731
    saved_weights, loaded_weights = merge(saved), merge(loaded)
    assert saved_weights.keys() == loaded_weights.keys()
    for key, value in saved_weights.items():
        assert torch.equal(value, loaded_weights[key]), f"{key} differs after resharding"
    assert loaded[0][1] == pytest.approx(saved[0][1], rel=1e-5)
