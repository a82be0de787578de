"""Expert parallelism: each MoE layer's experts split over `ep` ranks, tokens sent to them and
back with two all-to-alls.

The ep ranks are data-parallel ranks: each reads its own samples, and its tokens go to
whichever rank holds the experts they are routed to. An ep group is `ep` consecutive ranks
of dp_shard; ranks at the same place in every ep group hold the same experts (the expert
replicas, `dp / ep` of them). A rank holds its experts whole, under their names in the whole
model (`...experts.<global id>...`), so a checkpoint moves between any ep like any other
state, and FSDP2 leaves them out of its sharding (the dense part is sharded as usual).

Gradients: the all-to-all's backward returns each token's gradient to its rank, and an
expert's gradient on its holder sums the loss of every ep rank that sent it tokens. Each
rank's loss is the mean over its own samples, so the whole batch's gradient is that sum over
the expert replicas, divided by the data-parallel degree (`ExpertGradients`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True, eq=False)
class ExpertShard:
    """This rank's place among the ep ranks of its group, and the groups it exchanges in."""

    group: dist.ProcessGroup | None
    """The ep group: the ranks whose experts together make one whole layer."""
    replicas: dist.ProcessGroup | None
    """The ranks holding the same experts (one per ep group); None when there is one."""
    rank: int
    size: int
    dp_size: int
    """Data-parallel ranks in all: an expert's gradient is divided by it."""

    def local_experts(self, n_experts: int) -> range:
        """The global ids of the experts this rank holds."""
        per = n_experts // self.size
        return range(self.rank * per, (self.rank + 1) * per)


def expert_shard(dp_rank: int, dp_size: int, ep: int, dp_ranks: list[int]) -> ExpertShard:
    """Make the ep and expert-replica groups over the data-parallel ranks `dp_ranks` (global
    ranks, by data-parallel index), collectively: every rank of the world calls it."""
    ep_group = replica_group = None
    for first in range(0, dp_size, ep):  # every rank makes every group, in one order
        group = dist.new_group([dp_ranks[i] for i in range(first, first + ep)])
        if first <= dp_rank < first + ep:
            ep_group = group
    if dp_size > ep:
        for place in range(ep):
            group = dist.new_group([dp_ranks[i] for i in range(place, dp_size, ep)])
            if dp_rank % ep == place:
                replica_group = group
    return ExpertShard(group=ep_group, replicas=replica_group, rank=dp_rank % ep, size=ep,
                       dp_size=dp_size)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; backward sends the gradients back."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, out_splits: list[int], in_splits: list[int],
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (in_splits, out_splits), group
        out = rows.new_empty((sum(out_splits), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        back_out, back_in = ctx.splits
        out = grad.new_empty((sum(back_out), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), back_out, back_in, group=ctx.group)
        return out, None, None, None


def run_experts(shard: ExpertShard, routed: torch.Tensor, counts: torch.Tensor,
                experts: list[nn.Module]) -> torch.Tensor:
    """Each row of `routed` (sorted by global expert id, `counts` rows per expert) through
    its expert, wherever that expert lives; the outputs in the same order."""
    ep, local = shard.size, len(experts)
    send = counts.view(ep, local)  # rows for each rank, by its local expert
    recv = torch.empty_like(send)  # rows from each rank, by this rank's local expert
    dist.all_to_all_single(recv, send, group=shard.group)
    send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
    received = _AllToAll.apply(routed, recv_splits, send_splits, shard.group)
    # Received by source rank, then local expert; run each expert on its rows at once.
    starts = torch.cumsum(recv.flatten(), 0) - recv.flatten()
    order = torch.cat([torch.arange(int(starts[src * local + e]),
                                    int(starts[src * local + e] + recv[src, e]))
                       for e in range(local) for src in range(ep)]) if received.shape[0] \
        else torch.zeros(0, dtype=torch.long)
    grouped = received[order.to(received.device)]
    outs = [expert(rows) for expert, rows in
            zip(experts, grouped.split(recv.sum(0).tolist()), strict=True)]
    done = torch.cat(outs) if outs else grouped
    by_source = torch.empty_like(done).index_copy(0, order.to(done.device), done)
    return _AllToAll.apply(by_source, send_splits, recv_splits, shard.group)


class ExpertGradients:
    """After backward: the expert gradients summed over the expert replicas and divided by
    the data-parallel degree, as FSDP2 averages the dense ones."""

    def __init__(self, params: list[torch.Tensor], shard: ExpertShard) -> None:
        self.params, self.shard = params, shard
        self.norm_split = (set(params), shard.group)
        """What the gradient norm adds once per ep group (parallel/grad_norm.py `split`)."""

    def reduce(self) -> None:
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return
        if self.shard.replicas is None:  # one copy of each expert: nothing to sum
            for g in grads:
                g.div_(self.shard.dp_size)
            return
        flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce for them all
        dist.all_reduce(flat, group=self.shard.replicas)
        flat /= self.shard.dp_size
        start = 0
        for g in grads:
            g.copy_(flat[start:start + g.numel()].view_as(g))
            start += g.numel()
