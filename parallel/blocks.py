"""The repeated blocks of a model: `model.layers`, a ModuleList (a whole model) or a
ModuleDict keyed by the block's index in the whole model (a pipeline stage, whose parameter
names must stay those of the whole model so that checkpoints move between layouts)."""

from __future__ import annotations

from torch import nn


def blocks_of(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", None)
    if layers is None:
        return []
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def replace_blocks(model: nn.Module, wrap) -> None:
    """Replace each block by wrap(block), in place, keeping its key or index."""
    layers = model.layers
    keys = list(layers.keys()) if isinstance(layers, nn.ModuleDict) else range(len(layers))
    for key in keys:
        layers[key] = wrap(layers[key])
