"""The repeated blocks of a model: `model.layers`, a ModuleList (a whole model) or a
ModuleDict keyed by the block's index in the whole model (a pipeline stage, whose parameter
names must stay those of the whole model so that checkpoints move between layouts). A
Hugging Face model keeps them one level down, in `model.model.layers`."""

from __future__ import annotations

from torch import nn


def _owner(model: nn.Module) -> nn.Module | None:
    """The module that holds the blocks as its `layers`, if any."""
    if isinstance(getattr(model, "layers", None), nn.ModuleList | nn.ModuleDict):
        return model
    inner = getattr(model, "model", None)  # transformers' *ForCausalLM wraps its base model
    if isinstance(inner, nn.Module) and isinstance(getattr(inner, "layers", None),
                                                   nn.ModuleList | nn.ModuleDict):
        return inner
    return None


def blocks_of(model: nn.Module) -> list[nn.Module]:
    owner = _owner(model)
    if owner is None:
        return []
    layers = owner.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def replace_blocks(model: nn.Module, wrap) -> None:
    """Replace each block by wrap(block), in place, keeping its key or index."""
    owner = _owner(model)
    if owner is None:
        return
    layers = owner.layers
    keys = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else range(len(layers))
    for key in keys:
        layers[key] = wrap(layers[key])


def stage_layer_ids(n_layers: int, num_stages: int) -> list[list[int]]:
    """Blocks of each stage: as even as possible, earlier stages taking the remainder."""
    base, extra = divmod(n_layers, num_stages)
    ids, start = [], 0
    for stage in range(num_stages):
        count = base + (1 if stage < extra else 0)
        ids.append(list(range(start, start + count)))
        start += count
    return ids
