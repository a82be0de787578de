"""Mixture of experts without a process group: the MoE model's routing (dropless, every slot
reaches its expert), its checks, and the expert-parallel layouts refused or planned."""

from __future__ import annotations

import pytest
import torch

from stalwart.core.config import load_config
from stalwart.core.errors import ConfigError, TaskError
from stalwart.core.task import build_task
from stalwart.examples.moe.model import MoE, MoEConfig, MoEGPT
from stalwart.parallel.dims import ParallelDims
from stalwart.plan.estimate import ModelShape, PlanLayout, estimate
from stalwart.plan.search import valid_layouts

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

MOE_TASK = "stalwart.examples.moe.task:MoETask"
SMALL = MoEConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2, n_experts=4, top_k=2)


def test_dropless_routing_is_the_weighted_sum_of_each_tokens_experts() -> None:
    torch.manual_seed(0)
    moe = MoE(SMALL)
    x = torch.randn(3, 5, 32)
    out = moe(x)
    flat = x.reshape(-1, 32)
    probs = moe.router(flat).softmax(-1)
    weights, chosen = probs.topk(2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    want = torch.stack([
        sum(w * moe.experts[str(int(e))](t) for w, e in zip(ws, es, strict=True))
        + moe.shared(t) for t, ws, es in zip(flat, weights, chosen, strict=True)])
    torch.testing.assert_close(out.reshape(-1, 32), want, rtol=1e-5, atol=1e-6)
    assert moe.load.sum().item() == pytest.approx(1.0)  # every routed slot counted once
    assert moe.aux_loss.item() >= 1.0 - 1e-6  # E x sum f P is at least 1, 1 when balanced


def test_the_moe_gpt_initialises_identically_and_its_loss_carries_the_load() -> None:
    torch.manual_seed(0)
    a = MoEGPT(SMALL)
    torch.manual_seed(0)
    b = MoEGPT(SMALL)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    task = build_task(MOE_TASK, {"seq_len": 16, "d_model": 32, "n_layers": 2, "n_heads": 2,
                                 "n_experts": 4})
    tokens = torch.randint(0, 256, (2, 16))
    loss, metrics = task.loss(a, tokens, tokens)
    assert sorted(metrics) == ["aux_loss", *(f"expert_load_{e}" for e in range(4))]
    assert sum(metrics[f"expert_load_{e}"] for e in range(4)).item() == pytest.approx(1.0)
    assert all(moe.aux_loss is None for moe in a.moe_layers())  # taken: no graph kept
    loss.backward()


@pytest.mark.parametrize(("args", "message"), [
    ({"top_k": 9}, r"task\.args\.top_k = 9 is invalid: must be <= n_experts = 8"),
    ({"n_experts": 0}, r"task\.args\.n_experts = 0 is invalid: must be an int >= 1"),
    ({"aux_loss_coef": -1}, r"task\.args\.aux_loss_coef = -1 is invalid"),
    ({"n_expertz": 2}, r"unknown key task\.args\.n_expertz"),
])
def test_bad_moe_arguments_are_refused_by_name(args, message) -> None:
    with pytest.raises(TaskError, match=message):
        build_task(MOE_TASK, args)


def test_ep_must_divide_the_experts_and_dp_shard_and_stay_with_data_parallelism() -> None:
    task = build_task(MOE_TASK, {"n_experts": 6})
    with pytest.raises(TaskError, match=r"parallel\.ep = 4 is invalid: must divide the model's "
                                        r"6 experts"):
        task.check_layout(ParallelDims(dp_replicate=1, dp_shard=4, tp=1, ep=4))
    with pytest.raises(ConfigError, match=r"parallel\.ep = 2 is invalid: must divide dp_shard "
                                          r"= 1"):
        load_config(None, ["scaling.num_workers=2", "parallel.dp_replicate=2",
                           "parallel.dp_shard=1", "parallel.ep=2"])
    with pytest.raises(ConfigError, match=r"parallel\.ep = 2 is invalid: expert parallelism "
                                          r"composes with data parallelism only"):
        load_config(None, ["scaling.num_workers=4", "parallel.tp=2", "parallel.ep=2"])
    with pytest.raises(TaskError, match=r"parallel\.ep = 2: task GPTTask has no experts"):
        build_task("stalwart.examples.gpt.task:GPTTask", {}).check_layout(
            ParallelDims(dp_replicate=1, dp_shard=2, tp=1, ep=2))


def test_a_resize_keeps_dp_shard_a_multiple_of_ep() -> None:
    config = load_config(None, ["scaling.num_workers=4", "scaling.min_workers=2",
                                "parallel.dp_replicate=1", "parallel.dp_shard=-1",
                                "parallel.ep=2", "train.global_batch_size=8",
                                "train.micro_batch_size=2"])
    assert config.largest_world(3) == 2  # 3 ranks cannot split the experts in two


def test_the_planner_splits_the_experts_and_searches_ep() -> None:
    shape = ModelShape(n_params=10_000, n_layers=2, block_params=4_000, n_experts=4,
                       expert_params=6_000)
    eps = {(lo.dp_shard, lo.ep) for lo in valid_layouts(4, shape)}
    assert {(4, 1), (4, 2), (4, 4), (2, 2), (1, 1)} <= eps and (1, 2) not in eps
    plain = estimate(shape, PlanLayout(dp_shard=4))
    split = estimate(shape, PlanLayout(dp_shard=4, ep=2))
    # ep = 2: the 6,000 expert parameters split in two, whole; the other 4,000 over 4.
    assert split.params == 4 * (1_000 + 3_000) and plain.params == 4 * 2_500
    assert PlanLayout(dp_shard=4, ep=2).describe().endswith("(ep=2), ZeRO-3")
