"""Models built on the meta device: parameters with a shape and no memory, materialised only
after they are split, so each rank allocates only its own shards.

A task that builds its model on the meta device (a pretrained model too big for one host)
gets it back from `materialize` allocated on the rank's device, with the buffers it built
for real (rotary frequencies: computed at build time, in no checkpoint) put back, and its
`init_weights` run to fill the parameters (from the seeded RNG, or from files).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def on_meta(model: torch.nn.Module) -> bool:
    """Whether the model's parameters still wait to be allocated."""
    return any(p.is_meta for p in model.parameters())


def materialize(model: torch.nn.Module, device: torch.device,
                init: Callable[[torch.nn.Module], None]) -> None:
    """Allocate the model's (possibly sharded) parameters on `device`, then `init` them."""
    allocate(model, device)
    with torch.no_grad():
        init(model)


def allocate(model: torch.nn.Module, device: torch.device) -> None:
    """Allocate the model's (possibly sharded) parameters on `device`, uninitialised.

    `to_empty` replaces every tensor, buffers included, with uninitialised memory: the
    buffers that were real before are copied back into their new place. It also gives
    each module a parameter of its own, which unties tied ones (embeddings shared with the
    output head): they are tied again."""
    kept = {name: buffer for name, buffer in model.named_buffers() if not buffer.is_meta}
    tied = tied_groups(model)
    model.to_empty(device=device)
    for first, *others in tied:
        shared = model.get_parameter(first)
        for name in others:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, shared)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name in kept:
                buffer.copy_(kept[name])


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor, in the model's order, groups of two or more."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]
