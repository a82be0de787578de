"""Gradient-norm clipping that works for every layout: plain tensors, DTensors on several
meshes (FSDP, TP) and layers spread over pipeline ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication


def clip_grad_norm(parameters, max_norm: float, *,
                   pp_group: dist.ProcessGroup | None = None,
                   split: tuple[set[torch.Tensor], dist.ProcessGroup | None] | None = None
                   ) -> torch.Tensor:
    """Clip the global gradient norm, for plain tensors and DTensors (FSDP / TP) alike.

    Gradients may live on different meshes (e.g. TP-split matrices on (dp, tp), norms left
    whole on (dp,)): each mesh's norm is reduced on its own (one collective per mesh), then
    the per-mesh norms combine into the global one. With a pipeline, each pp rank holds other
    layers: their squared norms add up over the pp group. `split`: plain parameters each rank
    of a group holds its own of (experts under expert parallelism), whose squared norms add
    up over that group.
    """
    params = [p for p in parameters if p.grad is not None]
    groups: dict[object, list[torch.Tensor]] = {}
    own, own_group = split if split is not None else (set(), None)
    for p in params:
        if p in own:
            continue
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None,
                          []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=False)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if split is not None:
        grads = [p.grad for p in params if p in own]
        squared = (torch.nn.utils.get_total_norm(grads, foreach=False) ** 2 if grads
                   else torch.zeros((), device=total.device))
        if own_group is not None:
            dist.all_reduce(squared, group=own_group)
        total = (total ** 2 + squared.to(total.device)).sqrt()
    if pp_group is not None:
        squared = total ** 2
        dist.all_reduce(squared, group=pp_group)
        total = squared.sqrt()
    with implicit_replication():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=False)
    return total
