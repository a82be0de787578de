"""float8 training (`train.precision = "float8"`): the model's linear layers compute their
matmuls in float8 with dynamic per-tensor scales, through TorchAO (`torchao.float8`), as
TorchTitan does. Only on CUDA devices with float8 tensor cores (compute capability 8.9: Ada,
Hopper and later); anywhere else the run is refused with what it needs.

Applied to the whole model before it is split, so tensor parallelism and FSDP2 see float8
linears. The output head stays in the model's precision (its logits feed the loss), and so
does a layer whose sizes are not multiples of 16 (float8 matmuls need them).
"""

from __future__ import annotations

import torch
from torch import nn

from stalwart.core.errors import ConfigError

# Ada (8.9) and Hopper (9.0) were the first with float8 tensor cores.
FLOAT8_CAPABILITY = (8, 9)


def float8_unsupported(device: torch.device) -> str | None:
    """Why float8 training cannot run on `device`, or None when it can."""
    if device.type != "cuda":
        return (f"it needs a CUDA device with compute capability "
                f"{'.'.join(map(str, FLOAT8_CAPABILITY))} or later; this worker's is {device}")
    capability = torch.cuda.get_device_capability(device)
    if capability < FLOAT8_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability "
                f"{'.'.join(map(str, capability))}; float8 tensor cores need "
                f"{'.'.join(map(str, FLOAT8_CAPABILITY))} or later (Ada, Hopper)")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "it needs TorchAO: pip install 'stalwart[float8]'"
    return None


def apply_float8(model: nn.Module, device: torch.device) -> None:
    """Swap the model's eligible linear layers for TorchAO's float8 ones, in place."""
    why = float8_unsupported(device)
    if why is not None:
        raise ConfigError(f"train.precision = 'float8' cannot run: {why}")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def eligible(module: nn.Module, name: str) -> bool:
        return (isinstance(module, nn.Linear) and name.split(".")[-1] != "output"
                and module.in_features % 16 == 0 and module.out_features % 16 == 0)

    convert_to_float8_training(model, config=Float8LinearConfig(),
                               module_filter_fn=eligible)
