"""Context parallelism's arithmetic, without a process group: which tokens a rank holds, how a
batch is cut, what the planner makes of it, and the layouts refused before workers start."""

from __future__ import annotations

import pytest
import torch

from stalwart.core.config import load_config
from stalwart.core.errors import ConfigError, TaskError
from stalwart.core.task import build_task
from stalwart.parallel.context_parallel import ContextShard, chunk_positions
from stalwart.parallel.dims import ParallelDims
from stalwart.plan.estimate import ModelShape, PlanLayout, estimate
from stalwart.plan.search import valid_layouts

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def shard(rank: int, size: int) -> ContextShard:
    return ContextShard(group=None, rank=rank, size=size)  # splitting needs no group


def test_each_rank_holds_a_mirrored_pair_of_chunks() -> None:
    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert chunk_positions(16, 4, 1).tolist() == [2, 3, 12, 13]


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_the_ranks_cover_the_sequence_once_with_equal_causal_work(cp: int) -> None:
    held = [chunk_positions(32, cp, r) for r in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(32))
    # A token at position p attends to p + 1 keys: every rank's sum is the same.
    work = {int((h + 1).sum()) for h in held}
    assert len(work) == 1


def test_a_length_that_2_cp_does_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match=r"cannot be split over cp = 2 ranks: its length must "
                                         r"be a multiple of 2 x cp = 4"):
        chunk_positions(6, 2, 0)


def test_split_cuts_every_sequence_tensor_and_keeps_per_sample_values() -> None:
    tokens = torch.arange(16).view(2, 8)
    labels = tokens + 100
    weights = torch.tensor([1.0, 2.0])  # one per sample: not cut
    first = shard(0, 2).split((tokens, labels))
    assert isinstance(first, tuple)
    assert first[0].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert first[1].tolist() == [[100, 101, 106, 107], [108, 109, 114, 115]]
    as_dict = shard(1, 2).split({"input_ids": tokens, "weight": weights, "name": "x"})
    assert as_dict["input_ids"].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert as_dict["weight"] is weights and as_dict["name"] == "x"


def test_positions_are_those_of_the_rank_for_its_local_length() -> None:
    assert shard(1, 2).positions(4).tolist() == [2, 3, 4, 5]
    assert shard(1, 2).positions(4, rank=0).tolist() == [0, 1, 6, 7]


# ------------------------------------------------------------------ layouts refused up front


def test_cp_must_divide_the_world_with_tp() -> None:
    with pytest.raises(ConfigError, match=r"^parallel\.cp = 3 is invalid: tp x cp = 3 must "
                                          r"divide the world size 4"):
        load_config(None, ["scaling.num_workers=4", "parallel.cp=3"])
    config = load_config(None, ["scaling.num_workers=8", "parallel.cp=2", "parallel.tp=2"])
    assert config.parallel.degrees(8) == (1, 2)  # dp_shard takes what tp x cp leaves
    assert config.parallel.layout(8) == {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2,
                                         "pp": 1, "ep": 1}


def test_the_gpt_refuses_a_sequence_that_2_cp_does_not_divide() -> None:
    task = build_task("stalwart.examples.gpt.task:GPTTask", {"seq_len": 34})
    with pytest.raises(ConfigError, match=r"parallel\.cp = 2 is invalid: the sequence length "
                                          r"34 must be a multiple of 2 x cp = 4"):
        task.check_layout(ParallelDims(dp_replicate=1, dp_shard=1, tp=1, cp=2))
    build_task("stalwart.examples.gpt.task:GPTTask", {"seq_len": 36}).check_layout(
        ParallelDims(dp_replicate=1, dp_shard=1, tp=1, cp=2))


def test_a_task_without_context_parallel_attention_is_refused() -> None:
    task = build_task("stalwart.examples.digits.task:DigitsTask", {})
    with pytest.raises(TaskError, match=r"parallel\.cp = 2: task DigitsTask cannot split its "
                                        r"sequences \(implement apply_context_parallel\)"):
        task.check_layout(ParallelDims(dp_replicate=1, dp_shard=1, tp=1, cp=2))


def test_cp_inside_pipeline_stages_is_refused() -> None:
    task = build_task("stalwart.examples.gpt.task:GPTTask", {"tie_embeddings": False})
    with pytest.raises(ConfigError, match=r"parallel\.cp = 2 is invalid with parallel\.pp = 2"):
        task.check_layout(ParallelDims(dp_replicate=1, dp_shard=1, tp=1, cp=2, pp=2))


def test_invariant_reduction_refuses_cp() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.invariant_reduction = True is invalid: "
                                          r"needs .*cp = 1"):
        load_config(None, ["scaling.num_workers=2", "parallel.cp=2", "parallel.dp_shard=1",
                           "parallel.invariant_reduction=true"])


def test_cp_peers_are_never_data_parallel_twins() -> None:
    dims = ParallelDims(dp_replicate=2, dp_shard=1, tp=2, cp=2)
    classes = [dims.replica_class(r) for r in range(dims.world_size)]
    # Ranks 0-3 are one replica (cp x tp), 4-7 the other: twins are 4 apart, nothing else.
    assert classes[:4] == classes[4:] and len(set(classes[:4])) == 4


# ------------------------------------------------------------------ plan

LONG = ModelShape(n_params=10**6, n_layers=2, d_model=64, n_heads=4, seq_len=4096,
                  block_params=100_000)


def test_the_planner_searches_cp_where_the_sequence_allows() -> None:
    got = {(lo.dp_replicate, lo.dp_shard, lo.cp, lo.tp, lo.pp) for lo in valid_layouts(4, LONG)}
    assert (1, 1, 4, 1, 1) in got and (1, 1, 2, 2, 1) in got and (1, 2, 2, 1, 1) in got
    assert not any(cp > 1 and pp > 1 for _, _, cp, _, pp in got)  # cp stays out of pipelines
    unknown = ModelShape(n_params=10**6, n_layers=2, d_model=64, n_heads=4)
    assert {lo.cp for lo in valid_layouts(4, unknown)} == {1}  # no sequence length: no cp
    odd = ModelShape(n_params=10**6, n_layers=2, d_model=64, n_heads=4, seq_len=6)
    assert {lo.cp for lo in valid_layouts(4, odd)} == {1}  # 6 is not a multiple of 4


def test_cp_splits_activations_and_shards_the_model_with_dp_shard() -> None:
    plain = estimate(LONG, PlanLayout(mixed_precision="bf16"))
    cp2 = estimate(LONG, PlanLayout(cp=2, mixed_precision="bf16"))
    s, h, a = 4096, 64, 4
    # Half the tokens' activations, half of the scores, plus the other half's keys and values.
    assert cp2.activations == 2 * (s // 2 * h * 34 + 5 * a * (s // 2) * s + 4 * (s // 2) * h)
    assert cp2.activations < 0.6 * plain.activations
    assert cp2.params * 2 == plain.params  # FSDP2 shards over dp_shard x cp
    assert PlanLayout(cp=2).zero_stage == 3 and PlanLayout(cp=2).uses_fsdp


def test_a_resize_keeps_cp_and_changes_the_data_parallel_degree() -> None:
    config = load_config(None, ["scaling.num_workers=4", "scaling.min_workers=2",
                                "parallel.cp=2", "parallel.dp_replicate=1",
                                "parallel.dp_shard=-1", "train.global_batch_size=8",
                                "train.micro_batch_size=2"])
    assert config.largest_world(3) == 2  # 3 ranks cannot hold cp = 2
    assert config.parallel.layout(2)["cp"] == 2 and config.parallel.degrees(2) == (1, 1)
