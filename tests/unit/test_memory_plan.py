"""The memory model (ZeRO and Korthikanti formulas, by hand) and the layout planner."""

from __future__ import annotations

import itertools

import pytest
import torch

from stalwart.cli.plan import parse_count
from stalwart.core.task import TrainTask
from stalwart.examples.gpt.model import GPT, GPTConfig
from stalwart.examples.gpt.task import GPTTask
from stalwart.plan.estimate import ModelShape, PlanError, PlanLayout, estimate
from stalwart.plan.search import (
    Candidate,
    NoLayoutFits,
    format_bytes,
    plan,
    recommend,
    refused,
    runnable_check,
    valid_layouts,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

# 4 blocks of 200 parameters and 200 outside them (embedding, norm, head).
BLOCKS = ModelShape(n_params=1000, n_layers=4, block_params=200)
# s=16, h=8, a=2: sbh = 128 per sequence, and 5as/h = 20, so sbh(34 + 5as/h) = 6912.
SMALL = ModelShape(n_params=1000, n_layers=2, d_model=8, n_heads=2, seq_len=16,
                   block_params=200)
BF16 = PlanLayout(mixed_precision="bf16")


def gpt_shape(cfg: GPTConfig) -> ModelShape:
    """The example GPT's shape as `stalwart plan CONFIG` reads it: through its task."""
    fields = {k: getattr(cfg, k) for k in ("vocab_size", "seq_len", "d_model", "n_layers",
                                           "n_heads", "ffn_hidden")}
    return ModelShape.from_task(GPTTask(**fields), None)


# ------------------------------------------------------------------ model state (ZeRO)


def test_one_rank_fp32_adam_is_16_bytes_per_parameter() -> None:
    est = estimate(ModelShape.from_param_count(1000), PlanLayout())
    assert (est.params, est.grads, est.optimizer) == (4000, 4000, 8000)
    assert est.buffers == 0 and est.activations is None  # no wrapper; shape unknown
    assert est.device == 16000 and est.host == 0 and not est.complete


def test_mixed_precision_keeps_the_zero_total_of_2_plus_2_plus_12() -> None:
    # FSDP2 stores the fp32 master as the parameter itself: 4 + 4 + 8 = 2 + 2 + K(12).
    assert estimate(BLOCKS, BF16).state == estimate(BLOCKS, PlanLayout()).state == 16 * 1000


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_zero3_divides_params_grads_and_optimizer_by_dp_shard(n: int) -> None:
    shape = ModelShape.from_param_count(8000)
    est = estimate(shape, PlanLayout(dp_shard=n))
    assert (est.params, est.grads, est.optimizer) == (32000 // n, 32000 // n, 64000 // n)


def test_replicas_do_not_divide_and_ddp_adds_a_bucket_copy_of_the_gradients() -> None:
    est = estimate(BLOCKS, PlanLayout(dp_replicate=4))
    assert est.state == 16000 and est.buffers == 4000
    hsdp = estimate(BLOCKS, PlanLayout(dp_replicate=2, dp_shard=2))
    assert hsdp.state == 8000


def test_tp_and_pp_divide_the_model_and_the_first_stage_holds_the_rest() -> None:
    assert estimate(BLOCKS, PlanLayout(tp=2)).params == 4 * 500
    # pp=2: 2 blocks (400) + the 200 outside blocks = 600 on the first stage.
    assert estimate(BLOCKS, PlanLayout(pp=2)).params == 4 * 600
    assert estimate(BLOCKS, PlanLayout(pp=2, tp=2)).params == 4 * 300
    assert estimate(BLOCKS, PlanLayout(pp=4, tp=2, dp_shard=2)).params == 4 * 100  # (200+200)/2/2
    # Without a block structure, stages split the count evenly.
    assert estimate(ModelShape.from_param_count(1000), PlanLayout(pp=4)).params == 4 * 250


def test_zero3_buffers_are_root_plus_two_gathered_blocks_plus_one_gradient() -> None:
    # fp32: 4 x (200 root + 2 x 200 blocks) + one block's fp32 gradient 4 x 200.
    assert estimate(BLOCKS, PlanLayout(dp_shard=2)).buffers == 4 * 600 + 800
    # bf16: gathered at 2 bytes; the gradient at 2 plus its fp32 reduce buffer at 4.
    assert estimate(BLOCKS, PlanLayout(dp_shard=2, mixed_precision="bf16")).buffers == 2 * 600 + 1200


def test_zero2_keeps_every_parameter_gathered_until_backward() -> None:
    assert estimate(BLOCKS, PlanLayout(dp_shard=2, zero3=False)).buffers == 4 * 1000 + 800
    zero2, zero3 = (estimate(BLOCKS, PlanLayout(dp_shard=4, zero3=z)) for z in (False, True))
    assert zero2.state == zero3.state  # FSDP2 shards what it stores in both
    assert zero2.device > zero3.device


def test_zero3_buffers_are_unknown_without_a_block_size() -> None:
    assert estimate(ModelShape.from_param_count(1000), PlanLayout(dp_shard=2)).buffers is None


def test_cpu_offload_moves_model_state_to_the_host() -> None:
    on, off = (estimate(BLOCKS, PlanLayout(dp_shard=2, cpu_offload=c)) for c in (False, True))
    assert off.host == on.state == 8000 and on.host == 0
    assert off.device == on.device - on.state
    assert off.buffers == on.buffers  # gathered units still live on the device


# ------------------------------------------------------------------ activations (Korthikanti)


def test_activations_follow_sbh_34_plus_5as_over_h() -> None:
    # bf16 is the paper's 16-bit figure: 2 blocks x 128 x 54 = 13824 bytes.
    assert estimate(SMALL, BF16).activations == 2 * 6912
    assert estimate(SMALL, PlanLayout()).activations == 2 * 2 * 6912  # fp32 doubles
    b4 = estimate(SMALL, PlanLayout(mixed_precision="bf16", micro_batch_size=4)).activations
    assert b4 == 4 * 2 * 6912
    # A GPT-3-like block: s=2048, b=1, h=12288, a=96.
    big = ModelShape(n_params=10**9, n_layers=1, d_model=12288, n_heads=96, seq_len=2048)
    assert estimate(big, BF16).activations == 2048 * 12288 * (34 + 5 * 96 * 2048 // 12288)


def test_recompute_orders_full_below_selective_below_none() -> None:
    def acts(mode: str) -> int:
        return estimate(SMALL, PlanLayout(mixed_precision="bf16", activation_checkpointing=mode)
                        ).activations

    assert acts("selective") == 2 * 128 * 34  # the 5as/h attention term is recomputed
    assert acts("full") == 2 * 2 * 128 + 6912  # block inputs + one block rebuilt in backward
    assert acts("full") < acts("selective") < acts("none")


def test_tensor_parallel_splits_activations_with_and_without_sequence_parallel() -> None:
    sp = estimate(SMALL, PlanLayout(tp=2, mixed_precision="bf16")).activations
    assert sp == 2 * 128 * (34 // 2 + 20 // 2)
    no_sp = estimate(SMALL, PlanLayout(tp=2, mixed_precision="bf16", sequence_parallel=False))
    assert no_sp.activations == 2 * 128 * (10 + 24 // 2 + 20 // 2)


def test_logits_and_pipeline_microbatches() -> None:
    shape = ModelShape(n_params=1000, n_layers=2, d_model=8, n_heads=2, seq_len=16,
                       vocab_size=32, block_params=200)
    logits = 8 * 16 * 32  # fp32 logits + log-softmax: 8sbV
    assert estimate(shape, BF16).activations == 2 * 6912 + logits
    # 1F1B, pp=2 with 1 block per stage: the first stage holds 2 micro-batches.
    one_f_one_b = estimate(shape, PlanLayout(pp=2, mixed_precision="bf16")).activations
    assert one_f_one_b == max(2 * 6912, 6912 + logits)
    gpipe = PlanLayout(pp=2, mixed_precision="bf16", pp_schedule="gpipe", pp_microbatches=4)
    assert estimate(shape, gpipe).activations == 4 * (6912 + logits)


def test_activations_are_unknown_without_the_sizes() -> None:
    assert estimate(ModelShape.from_param_count(10**9, n_layers=32), PlanLayout()).activations is None


# ------------------------------------------------------------------ shapes and validation


def test_shape_from_the_gpt_task_counts_like_the_model() -> None:
    cfg = GPTConfig(vocab_size=256, seq_len=64, d_model=64, n_layers=3, n_heads=4)
    shape = gpt_shape(cfg)
    model = GPT(cfg)
    assert shape.n_params == model.num_params()  # the tied head counted once
    assert shape.block_params == sum(p.numel() for p in model.layers[0].parameters())
    assert shape.root_params == 256 * 64 + 64  # embedding (= head) and the final norm
    assert (shape.n_layers, shape.n_heads, shape.seq_len, shape.vocab_size) == (3, 4, 64, 256)


def test_shape_from_param_count_sizes_a_block_like_the_example_gpt() -> None:
    d = 4096
    shape = ModelShape.from_param_count(7 * 10**9, n_layers=32, d_model=d)
    assert shape.block_params == 4 * d * d + 3 * d * 10944 + 2 * d
    cfg = GPTConfig(d_model=64, n_heads=4, n_layers=2)
    assert (ModelShape.from_param_count(10**6, d_model=64).block_params
            == gpt_shape(cfg).block_params)


@pytest.mark.parametrize("make", [
    lambda: ModelShape(n_params=0),
    lambda: ModelShape.from_param_count(100, n_layers=0),
    lambda: ModelShape(n_params=1000, d_model=64, n_heads=3),
    lambda: ModelShape.from_param_count(1000, n_layers=2, d_model=64),  # blocks > count
    lambda: PlanLayout(tp=0),
    lambda: PlanLayout(mixed_precision="fp16"),
    lambda: PlanLayout(activation_checkpointing="some"),
    lambda: PlanLayout(pp_schedule="zb"),
])
def test_bad_shapes_and_layouts_raise_plan_error(make) -> None:
    with pytest.raises(PlanError):
        make()


@pytest.mark.parametrize(("text", "count"), [("7e9", 7 * 10**9), ("1.3B", 1_300_000_000),
                                             ("350M", 350_000_000), ("125k", 125_000),
                                             ("7_000", 7000)])
def test_parse_count(text: str, count: int) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["abc", "0", "-5", "1.3X", "inf", ""])
def test_parse_count_refuses_what_is_not_a_count(text: str) -> None:
    with pytest.raises(PlanError, match="--params"):
        parse_count(text)


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (512, 13 * 2**20, int(1.3 * 2**30), 104 * 2**30)] == [
        "512 B", "13.0 MiB", "1.30 GiB", "104 GiB"]


# ------------------------------------------------------------------ planner


def test_valid_layouts_are_every_factorization_the_model_allows() -> None:
    shape = ModelShape(n_params=10**6, n_layers=2, d_model=64, n_heads=4, block_params=1000)
    got = {(lo.dp_replicate, lo.dp_shard, lo.tp, lo.pp) for lo in valid_layouts(8, shape)}
    want = {f for f in itertools.product(range(1, 9), repeat=4)
            if f[0] * f[1] * f[2] * f[3] == 8 and 4 % f[2] == 0 and f[3] <= 2}
    assert got == want and len(got) == len(valid_layouts(8, shape))
    assert (1, 1, 8, 1) not in got  # 8 does not divide 4 heads
    bare = {(lo.tp, lo.pp) for lo in valid_layouts(8, ModelShape.from_param_count(10**6))}
    assert (8, 1) in bare and (1, 8) in bare  # nothing known: any split
    assert all(lo.tp <= 2 for lo in valid_layouts(8, shape, max_tp=2))


def test_valid_layouts_keep_the_options() -> None:
    options = PlanLayout(mixed_precision="bf16", activation_checkpointing="full", micro_batch_size=3)
    for lo in valid_layouts(4, BLOCKS, options):
        assert (lo.mixed_precision, lo.activation_checkpointing, lo.micro_batch_size) == (
            "bf16", "full", 3)
        assert lo.devices == 4


def test_recommendation_prefers_pure_data_parallel_with_the_widest_sharding() -> None:
    candidates = plan(BLOCKS, 8, 2**40)
    best = recommend(candidates, 2**40)
    assert best is candidates[0] and best.fits
    assert (best.layout.dp_replicate, best.layout.dp_shard, best.layout.tp, best.layout.pp) == (
        1, 8, 1, 1)


def test_recommendation_takes_the_least_model_parallelism_that_fits_and_tp_before_pp() -> None:
    # Activations dominate (long sequences): data parallelism cannot shrink them, tp/pp can.
    shape = ModelShape(n_params=10**6, n_layers=8, d_model=256, n_heads=8, seq_len=4096,
                       block_params=100_000)
    options = PlanLayout(mixed_precision="bf16")
    by_layout = {(c.layout.dp_shard, c.layout.tp, c.layout.pp): c.estimate.device
                 for c in plan(shape, 4, 2**50, options) if c.layout.dp_replicate == 1}
    memory = by_layout[(1, 4, 1)]  # only tp x pp = 4 fits
    assert min(v for (s, t, p), v in by_layout.items() if t * p < 4) > memory
    best = recommend(plan(shape, 4, memory, options), memory)
    assert (best.layout.tp, best.layout.pp) == (4, 1)
    # At the same degree tensor parallel wins over pipeline parallel, even with more memory.
    small, large = (estimate(BLOCKS, PlanLayout(dp_shard=n)) for n in (4, 1))
    both = [Candidate(PlanLayout(dp_shard=2, pp=2), small, True),
            Candidate(PlanLayout(dp_shard=2, tp=2), large, True)]
    assert recommend(both, 2**30).layout.tp == 2


def test_nothing_fits_raises_naming_the_smallest_estimate() -> None:
    shape = ModelShape.from_param_count(70 * 10**9)
    candidates = plan(shape, 2, 16 * 2**30)
    assert not any(c.fits for c in candidates)
    smallest = min(c.estimate.device for c in candidates)
    with pytest.raises(NoLayoutFits) as info:
        recommend(candidates, 16 * 2**30)
    message = str(info.value)
    assert format_bytes(smallest) in message and "16.0 GiB" in message
    assert "dp_replicate=1 x dp_shard=2" in message and "lower bound" in message


def test_plan_refuses_bad_devices_and_memory() -> None:
    with pytest.raises(PlanError, match="devices"):
        plan(BLOCKS, 0, 2**30)
    with pytest.raises(PlanError, match="memory"):
        plan(BLOCKS, 2, 0)


def test_meta_counting_needs_no_memory() -> None:
    # A 7B-sized GPT is counted on the meta device: nothing is allocated.
    cfg = GPTConfig(vocab_size=32000, seq_len=4096, d_model=4096, n_layers=32, n_heads=32)
    shape = gpt_shape(cfg)
    assert 6 * 10**9 < shape.n_params < 7 * 10**9
    assert torch.empty(0).device.type == "cpu"  # the meta context did not leak


def test_a_task_without_model_dims_is_planned_by_its_parameter_count() -> None:
    class Linear(TrainTask):
        def build_model(self, config):
            return torch.nn.Linear(10, 10)

    shape = ModelShape.from_task(Linear(), None)
    assert shape.n_params == 110 and shape.n_layers is None and shape.block_params is None


def test_a_model_that_cannot_be_counted_names_the_hook() -> None:
    class Broken(TrainTask):
        def build_model(self, config):
            raise RuntimeError("needs data")

    with pytest.raises(PlanError, match="TrainTask.model_dims or use --params"):
        ModelShape.from_task(Broken(), None)


def test_plan_leaves_out_every_layout_a_run_of_the_config_refuses() -> None:
    from stalwart.core.config import load_config

    tiny = ["task.args.n_layers=2", "task.args.n_heads=2", "task.args.d_model=16",
            "train.global_batch_size=8", "train.micro_batch_size=2"]
    shape = ModelShape(n_params=1000, n_layers=2, n_heads=2, block_params=200)
    tied = runnable_check(load_config(None, tiny))
    assert "tie_embeddings = false" in tied(PlanLayout(pp=2))
    assert tied(PlanLayout(dp_shard=2)) is None
    # Batch rules of the layout's own world: 8 samples split into micro-batches of 2 over
    # 8 data-parallel ranks cannot be; invariant_reduction refuses sharding.
    assert "train.global_batch_size" in tied(PlanLayout(dp_shard=8))
    untied = runnable_check(load_config(None, [*tiny, "task.args.tie_embeddings=false",
                                               "parallel.pp_schedule=zero_bubble"]))
    left = {(lo.dp_replicate, lo.dp_shard, lo.tp, lo.pp) for lo, _ in
            refused(valid_layouts(4, shape), untied)}
    # zero_bubble with data parallelism; its 2 stages per rank x pp 2 > 2 blocks.
    assert left == {(2, 1, 1, 2), (1, 2, 1, 2), (1, 1, 2, 2)}
    listed = {(c.layout.dp_replicate, c.layout.dp_shard, c.layout.tp, c.layout.pp)
              for c in plan(shape, 4, 2**30, check=untied)}
    assert listed == {(4, 1, 1, 1), (2, 2, 1, 1), (1, 4, 1, 1), (2, 1, 2, 1), (1, 2, 2, 1)}
    with pytest.raises(PlanError, match=r"^no layout of 2 devices can run this config; "
                                        r"dp_replicate=2 x dp_shard=1 x tp=1 x pp=1, ZeRO-0: no$"):
        plan(ModelShape(n_params=1000, n_layers=2), 2, 2**30, check=lambda lo: "no")
