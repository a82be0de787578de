"""Context parallelism: each sequence split over `cp` ranks, attention exact across them.

Load balance: a sequence is cut into 2 x cp equal chunks and rank r holds chunks r and
2cp-1-r. Under a causal mask an early chunk attends to few keys and a late one to many; a
mirrored pair gives every rank the same work (as Llama 3 and TorchTitan do).

Attention all-gathers the keys and values of the whole sequence and attends each rank's own
queries to them under the causal mask of their global positions (Llama 3's choice), rather
than passing key/value blocks around a ring. One collective per layer that gloo and NCCL
both run, exact for any mask, and with grouped-query attention the keys and values are
smaller than the queries. Its cost: every rank holds the whole sequence's keys and values
for one layer at a time, which ring attention avoids; that matters only when they no longer
fit (hundreds of thousands of tokens per rank). In backward, torch's autograd all-gather
a reduce-scatter sums each rank's key and value gradients back to their owner, so the
parameter gradients summed over the cp ranks are the whole sequence's: FSDP2 averages them
over dp_shard x cp. Keys and values travel together: one collective per layer each way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from stalwart.core.batch import map_tensors

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True, eq=False)
class ContextShard:
    """This rank's part of every sequence: its place among the `size` context-parallel
    ranks, and their process group."""

    group: dist.ProcessGroup
    rank: int
    size: int

    @classmethod
    def of(cls, cp_mesh: DeviceMesh) -> ContextShard:
        return cls(group=cp_mesh.get_group(), rank=cp_mesh.get_local_rank(),
                   size=cp_mesh.size())

    def positions(self, local_len: int, device: torch.device | str = "cpu",
                  rank: int | None = None) -> torch.Tensor:
        """Global positions of the `local_len` tokens a rank holds (this one by default):
        its two chunks, in order."""
        return chunk_positions(local_len * self.size, self.size,
                               self.rank if rank is None else rank, device)

    def split(self, batch: Any) -> Any:
        """This rank's tokens of a batch: every tensor of two or more dimensions is cut along
        dim 1, the sequence; others (per-sample values) are kept whole."""
        return map_tensors(batch, self._mine)

    def _mine(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() < 2:
            return tensor
        return tensor.index_select(1, chunk_positions(tensor.shape[1], self.size, self.rank,
                                                      tensor.device))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries [B, H, T/cp, hd] over the whole
        sequence's keys and values, gathered from the cp ranks."""
        local = q.shape[2]
        whole = local * self.size
        # Gathered rank by rank, each rank's two chunks; put them back in sequence order.
        order = torch.argsort(torch.cat([self.positions(local, q.device, rank=r)
                                         for r in range(self.size)]))
        both = _GatherRanks.apply(torch.stack([k, v]), self.group)  # [cp, 2, B, H, T/cp, hd]
        both = both.permute(1, 2, 3, 0, 4, 5).flatten(3, 4)[:, :, :, order]
        keys, values = both[0], both[1]
        mine = self.positions(local, q.device)
        mask = mine[:, None] >= torch.arange(whole, device=q.device)[None, :]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)


class _GatherRanks(torch.autograd.Function):
    """All-gather along a new leading dimension; backward sums the gradients back to each
    rank (a reduce-scatter). torch's own autograd all-gather falls back on gloo to an
    all-to-all that names group ranks as global ones: it fails in any group without rank 0."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        # Concatenated along dim 0, as gloo wants the output; viewed with a dimension of its own.
        out = tensor.new_empty((size * tensor.shape[0], *tensor.shape[1:]))
        dist.all_gather_single(out, tensor.contiguous(), group=group)
        return out.view(size, *tensor.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        mine = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(mine, grad.contiguous().flatten(0, 1), group=ctx.group)
        return mine, None


def chunk_positions(seq_len: int, cp: int, rank: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions of the tokens rank `rank` of `cp` holds in a sequence of `seq_len`: chunks
    `rank` and `2 cp - 1 - rank` of 2 cp equal ones."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens cannot be split over cp = {cp} "
                         f"ranks: its length must be a multiple of 2 x cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])
