"""Context parallelism is exact: a sequence split over cp ranks (alone, under FSDP2, beside
tensor parallelism) trains like one process on the same batch, loss and gradients."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from stalwart.core.task import build_task
from stalwart.workers.engine import TrainEngine
from tests.dist.launcher import run_ranks
from tests.dist.test_data_parallel import (  # noqa: F401 (fixtures)
    cache_dir,
    single_process,
    single_process_losses,
    tiny_config,
    train_losses,
)

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

LAYOUTS = [
    pytest.param(2, ["parallel.cp=2", "parallel.dp_shard=1"], id="cp2"),
    pytest.param(4, ["parallel.cp=2", "parallel.dp_shard=2"], id="cp2xfsdp2"),
    pytest.param(4, ["parallel.cp=2", "parallel.tp=2", "parallel.dp_shard=1"], id="tp2xcp2"),
]
# Every layout with cp that `stalwart plan` lists for 4 workers (test_cli_layout_matrix.py).
MORE = [
    pytest.param(4, ["parallel.cp=2", "parallel.dp_replicate=2", "parallel.dp_shard=1"],
                 id="replicate2xcp2"),
    pytest.param(4, ["parallel.cp=4", "parallel.dp_shard=1"], id="cp4"),
]


def first_gradients(rank: int, world: int, cache: str, layout: list[str]
                    ) -> dict[str, torch.Tensor]:
    """The whole gradient of every parameter at the first step, before the update."""
    config = tiny_config(world, cache, layout)
    task = build_task(config.task.path, config.task.args)
    engine = TrainEngine(config, task, rank=rank, world_size=world, device=torch.device("cpu"))
    grads: dict[str, torch.Tensor] = {}

    def keep() -> None:
        for name, p in engine.model.named_parameters():
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name.removeprefix("module.")] = g.detach().clone()

    engine.train_step(before_update=keep)
    return grads


@pytest.fixture(scope="module")
def one_process_gradients(cache_dir) -> dict[str, torch.Tensor]:  # noqa: F811
    return run_ranks(first_gradients, 1, cache_dir, [])[0]


@pytest.mark.parametrize(("world", "layout"), LAYOUTS + MORE)
def test_context_parallel_trains_like_one_process(cache_dir, single_process_losses,  # noqa: F811
                                                  world, layout):
    per_rank = run_ranks(train_losses, world, cache_dir, layout)
    assert all(losses == per_rank[0] for losses in per_rank), "ranks disagree on the loss"
    assert per_rank[0] == pytest.approx(single_process_losses, rel=1e-5)


@pytest.mark.parametrize(("world", "layout"), LAYOUTS)
def test_context_parallel_gradients_equal_one_process(cache_dir, one_process_gradients,  # noqa: F811
                                                      world, layout):
    grads = run_ranks(first_gradients, world, cache_dir, layout)[0]
    assert grads.keys() == one_process_gradients.keys()
    for name, want in one_process_gradients.items():
        torch.testing.assert_close(grads[name], want, rtol=1e-5, atol=1e-6, msg=name)
