"""float8 training is refused, with what it needs, wherever it cannot run: CPU workers before
the run starts, a device without float8 tensor cores when the rank builds its model."""

from __future__ import annotations

import pytest
import torch

from stalwart.core.config import load_config
from stalwart.core.errors import ConfigError
from stalwart.parallel.float8 import apply_float8, float8_unsupported

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_float8_on_cpu_workers_is_refused_before_start() -> None:
    with pytest.raises(ConfigError, match=r"^train\.precision = 'float8' is invalid: float8 "
                                          r"needs GPU workers .*compute capability 8\.9"):
        load_config(None, ["train.precision=float8"])
    with pytest.raises(ConfigError, match=r"train\.precision = 'int4' is invalid: one of "
                                          r"default, float8"):
        load_config(None, ["train.precision=int4"])
    config = load_config(None, ["train.precision=float8", "scaling.gpus_per_worker=1"])
    assert config.train.precision == "float8"


def test_a_rank_without_float8_tensor_cores_refuses_to_build() -> None:
    cpu = torch.device("cpu")
    assert "needs a CUDA device with compute capability 8.9" in float8_unsupported(cpu)
    model = torch.nn.Linear(16, 16)
    with pytest.raises(ConfigError, match=r"train\.precision = 'float8' cannot run: it needs "
                                          r"a CUDA device"):
        apply_float8(model, cpu)
    assert type(model) is torch.nn.Linear  # untouched
