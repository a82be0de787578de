"""Gradient compression without a process group: the settings refused before start, the bytes a
step reduces, and the order torch's PowerSGD hook lays its factors out in."""

from __future__ import annotations

import pytest
from torch import nn

from stalwart.core.config import load_config
from stalwart.core.errors import ConfigError
from stalwart.parallel.grad_compression import MIN_COMPRESSION_RATE, reduction_bytes

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def parallel(*sets: str):
    return load_config(None, ["scaling.num_workers=2", *sets]).parallel


@pytest.mark.parametrize("sets", [
    ["parallel.dp_shard=2"], ["parallel.tp=2", "parallel.dp_shard=1"],
    ["parallel.cp=2", "parallel.dp_shard=1"],
    ["parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.mixed_precision=bf16"],
])
def test_powersgd_outside_ddp_is_refused_naming_what_it_needs(sets) -> None:
    with pytest.raises(ConfigError, match=r"^parallel\.grad_compression = 'powersgd' is invalid: "
                                          r"powersgd needs replicated data parallelism \(DDP\)"):
        parallel(*sets, "parallel.grad_compression=powersgd")


def test_half_precision_reduction_takes_any_layout() -> None:
    for sets in (["parallel.dp_shard=2"], ["parallel.tp=2", "parallel.dp_shard=1"]):
        assert parallel(*sets, "parallel.grad_compression=bf16").grad_compression == "bf16"


def test_unknown_compression_and_bad_powersgd_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"parallel\.grad_compression = 'int8' is invalid: one "
                                          r"of none, bf16, fp16, powersgd"):
        parallel("parallel.grad_compression=int8")
    with pytest.raises(ConfigError, match=r"parallel\.powersgd_rank = 0 is invalid: must be >= 1"):
        parallel("parallel.powersgd_rank=0")
    with pytest.raises(ConfigError, match=r"parallel\.invariant_reduction = True is invalid: sums "
                                          r"exact gradients in one order"):
        parallel("parallel.dp_replicate=2", "parallel.dp_shard=1",
                 "parallel.invariant_reduction=true", "parallel.grad_compression=fp16")


def test_reduction_bytes_halve_in_16_bits_and_shrink_to_the_factors_with_powersgd() -> None:
    model = nn.Sequential(nn.Linear(64, 32, bias=True), nn.LayerNorm(32))
    numel = 64 * 32 + 32 + 32 + 32
    assert reduction_bytes(model, parallel()) == (4 * numel, 4 * numel)
    assert reduction_bytes(model, parallel("parallel.grad_compression=fp16")) == (
        2 * numel, 2 * numel)
    psgd = parallel("parallel.dp_replicate=2", "parallel.dp_shard=1",
                    "parallel.grad_compression=powersgd", "parallel.powersgd_rank=2")
    # The weight [32, 64] goes as rank-2 factors, (32 + 64) x 2; the vectors go whole.
    assert reduction_bytes(model, psgd) == (4 * numel, 4 * ((32 + 64) * 2 + 3 * 32))
    assert MIN_COMPRESSION_RATE == 2


def test_frozen_parameters_are_not_reduced() -> None:
    model = nn.Linear(8, 8)
    model.bias.requires_grad_(False)
    assert reduction_bytes(model, parallel()) == (4 * 64, 4 * 64)
