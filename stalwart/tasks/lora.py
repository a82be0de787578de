"""LoRA adapters through peft: the task's `lora` table as a LoraConfig, adapters injected
into the model in place (the model stays a transformers model), and their initial values
drawn the same for any layout.

Only the adapters train: peft freezes every base parameter, so the optimizer holds state
for the adapters alone and checkpoints (memory and storage) carry only them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from stalwart.core.errors import TaskError

if TYPE_CHECKING:
    import torch

ALLOWED = ("r", "alpha", "dropout", "target_modules", "use_rslora")


def lora_config(table: Any, *, source: str) -> Any:
    """`task.args.lora` as peft's LoraConfig; a ValueError naming the bad key otherwise."""
    from peft import LoraConfig

    if not isinstance(table, dict):
        raise ValueError(f"task.args.lora = {table!r} is invalid: a table of {', '.join(ALLOWED)}")
    unknown = sorted(set(table) - set(ALLOWED))
    if unknown:
        raise ValueError(f"unknown key task.args.lora.{unknown[0]}; allowed: {', '.join(ALLOWED)}")
    r, alpha = table.get("r", 8), table.get("alpha", 16)
    dropout, targets = table.get("dropout", 0.0), table.get("target_modules", "all-linear")
    rslora = table.get("use_rslora", False)
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"task.args.lora.r = {r!r} is invalid: an int >= 1")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
        raise ValueError(f"task.args.lora.alpha = {alpha!r} is invalid: a number > 0")
    if not isinstance(dropout, int | float) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        raise ValueError(f"task.args.lora.dropout = {dropout!r} is invalid: a number in [0, 1)")
    if not (targets == "all-linear" or isinstance(targets, list) and targets
            and all(isinstance(t, str) and t for t in targets)):
        raise ValueError(f"task.args.lora.target_modules = {targets!r} is invalid: a list of "
                         f"module names (e.g. [\"q_proj\", \"v_proj\"]) or \"all-linear\"")
    if not isinstance(rslora, bool):
        raise ValueError(f"task.args.lora.use_rslora = {rslora!r} is invalid: true or false")
    return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=float(dropout),
                      target_modules=targets, use_rslora=rslora, bias="none",
                      task_type="CAUSAL_LM", base_model_name_or_path=source)


def check_targets(model: torch.nn.Module, config: Any) -> TaskError:
    """peft's refusal of target modules that match nothing, as one error that lists what
    the model has."""
    import torch

    leaves = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear)})
    targets = config.target_modules
    targets = sorted(targets) if isinstance(targets, set) else targets  # peft makes a set
    return TaskError(f"task.args.lora.target_modules = {targets!r} match no layer of the "
                     f"model; its linear layers are named: {', '.join(leaves)}")


def adapter_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return sorted((n, p) for n, p in model.named_parameters() if ".lora_" in n)


def init_adapters(model: torch.nn.Module) -> None:
    """Draw every adapter's first value from torch's global RNG, in name order, whole, then
    keep this rank's part: the same initial adapters for any layout. A: peft's Kaiming
    uniform; B: zeros, so training starts from the base model exactly."""
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    for name, param in adapter_parameters(model):
        full = torch.empty(param.shape, dtype=param.dtype)
        if ".lora_A." in name:
            torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5))
        else:
            full.zero_()
        with torch.no_grad():
            if isinstance(param, DTensor):
                part = distribute_tensor(full, param.device_mesh, param.placements,
                                         src_data_rank=None)
                param.to_local().copy_(part.to_local())
            else:
                param.copy_(full)


def adapter_config_json(config: Any) -> bytes:
    """peft's own adapter_config.json for `config` (what PeftModel.from_pretrained reads)."""
    import json

    data = config.to_dict()
    for key, value in list(data.items()):
        if isinstance(value, set):
            data[key] = sorted(value)
    return json.dumps(data, indent=2, sort_keys=True).encode()
