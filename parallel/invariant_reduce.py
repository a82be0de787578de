"""A data-parallel gradient reduction whose bits do not depend on the data-parallel degree.

Why: float addition is not associative, so the usual reduction (each rank sums its own
micro-batches in a running total, then all_reduce adds the ranks in whatever order the backend
picks) gives gradients whose last bits depend on D. An elastic run that shrinks from 4 ranks to
2 and grows back then drifts from a run that stayed at 4. Here every rank computes the same
canonical sum over the G micro-batch gradients of a global batch, whatever D is, so runs are
bit-identical across resizes (with deterministic kernels and the same micro-batch size).

The canonical sum: leaf i is the gradient of micro-batch i (of loss_i / G, the caller's
backward), and sum(leaves) is the pairwise tree over leaves 0..n-1 in index order, split at
the largest power of two below n: sum(0..n-1) = sum(0..p-1) + sum(p..n-1). For n a power of two
that is the complete binary tree, halves at n/2. Rank r holds leaves r*k .. r*k+k-1; it sums
them with a stack of complete subtrees (O(log k) memory), the ranks all-gather their partial
sums and every rank adds them in the same tree over ranks 0..D-1.

When is it invariant: the result equals the canonical tree over all G leaves, bit for bit,
whenever k = G / D is a power of two (D = 1 always qualifies; so do D = 3 and 6 for G = 12).
So two degrees D1, D2 give identical bits if both their k are powers of two, e.g. G, k and D
all powers of two. Other shapes (k = 3, say) are still deterministic for a fixed D but differ
from other D in the last bits; they are accepted, not refused.

Cost: the all-gather moves D times the gradient bytes per rank (an all-reduce moves about 2x)
and each rank then does D-1 gradient-sized additions; the stack holds at most floor(log2 k)+1
gradient copies, plus the D-sized gather buffer during the reduction. Only for replicated data
parallelism (every rank holds whole plain-tensor gradients; no FSDP or DTensor).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

# all_gather_into_tensor is deprecated in favour of all_gather_single from torch 2.13 on; the
# project still supports older torch. Gloo only takes the 1-D concatenated output form.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

Grads = list[torch.Tensor | None]  # one entry per parameter; None: no gradient in that subtree


def _split(n: int) -> int:
    """Where the canonical tree over n > 1 leaves splits: the largest power of two below n."""
    return 1 << ((n - 1).bit_length() - 1)


def _add_(left: Grads, right: Grads) -> Grads:
    """left + right per parameter, in place into left (a.add_(b) has the bits of a + b)."""
    out: Grads = []
    for a, b in zip(left, right, strict=True):
        if a is None or b is None:
            # A parameter without a gradient counts as zeros; materialise them so the IEEE
            # additions are the same ones whichever ranks saw the gradient (0 + -0 is +0).
            if a is None and b is None:
                out.append(None)
                continue
            a = torch.zeros_like(b) if a is None else a
            b = torch.zeros_like(a) if b is None else b
        out.append(a.add_(b))
    return out


def tree_sum_(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Canonical pairwise sum of tensors in list order (see module doc); overwrites some inputs."""
    if len(tensors) == 1:
        return tensors[0]
    mid = _split(len(tensors))
    return tree_sum_(tensors[:mid]).add_(tree_sum_(tensors[mid:]))


class PairwiseAccumulator:
    """Sums per-micro-batch gradients in the canonical tree, then reduces them across ranks.

    Call add() after each micro-batch's backward (of loss / G, with p.grad None before the
    first), then reduce_into_grads(group) once per optimizer step. Parameters must be plain
    tensors that are replicated on every rank of the group, in the same order.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        self.params = [p for p in params if p.requires_grad]
        # (number of leaves, their sum): sizes strictly decrease from bottom to top, each a
        # power of two, so the stack is the binary representation of the leaf count.
        self._stack: list[tuple[int, Grads]] = []

    def add(self) -> None:
        """Take every p.grad as the next leaf (setting p.grad to None) and merge it in."""
        leaf: Grads = []
        for p in self.params:
            grad = p.grad
            if grad is not None and (grad.layout != torch.strided or
                                     type(grad) is not torch.Tensor):
                raise TypeError("PairwiseAccumulator needs dense plain-tensor gradients, "
                                f"got {type(grad).__name__} ({grad.layout})")
            leaf.append(grad)
            p.grad = None  # the next backward must start from None, not accumulate into it
        size = 1
        # Two equal-size neighbours are complete subtrees over adjacent index ranges: merge
        # them, lower indices on the left. This builds exactly the canonical tree.
        while self._stack and self._stack[-1][0] == size:
            below_size, below = self._stack.pop()
            leaf, size = _add_(below, leaf), below_size + size
        self._stack.append((size, leaf))

    def local_sum(self) -> Grads:
        """The sum of this rank's leaves so far, in the canonical tree (does not reset).

        For a leaf count that is not a power of two the stack holds the subtrees of its binary
        representation; folding them right to left is the canonical split at the largest
        power of two. The fold is kept, so the count is then frozen: add() would refuse.
        """
        if not self._stack:
            raise RuntimeError("local_sum() before any add()")
        count, total = self._stack.pop()
        while self._stack:
            size, below = self._stack.pop()
            count, total = size + count, _add_(below, total)
        self._stack.append((count, total))
        return total

    def reset(self) -> None:
        self._stack.clear()

    def reduce_into_grads(self, group: dist.ProcessGroup | None) -> None:
        """Set every p.grad to the canonical sum over all ranks' leaves, then reset.

        group is the data-parallel group; None (unlike torch.distributed, where it means the
        world) or a group of size 1 means no data parallelism: the local sum is written.
        Every rank must call this with the same number of leaves, or the result is not the
        canonical tree (and with differing parameter lists the collective fails).
        A parameter with no gradient on any rank keeps p.grad None (as DDP does); one with
        gradients on some micro-batches only counts zeros for the others.
        """
        total = self.local_sum()
        self.reset()
        world = 1 if group is None else dist.get_world_size(group)
        if world > 1:
            total = self._gather_and_sum(total, group, world)
        for p, grad in zip(self.params, total, strict=True):
            p.grad = grad

    def _gather_and_sum(self, total: Grads, group: dist.ProcessGroup, world: int) -> Grads:
        # One flat buffer per (device, dtype): the gradients then one 0/1 "has a gradient" flag
        # per parameter, so ranks agree on which parameters stay None without a 2nd collective.
        buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(self.params):
            buckets.setdefault((p.device, p.dtype), []).append(i)
        out: Grads = [None] * len(self.params)
        for (device, dtype), idx in buckets.items():
            grads = [total[i] if total[i] is not None else torch.zeros_like(self.params[i])
                     for i in idx]
            flags = torch.tensor([total[i] is not None for i in idx], dtype=dtype, device=device)
            flat = torch.cat([g.reshape(-1) for g in grads] + [flags])
            gathered = torch.empty(world * flat.numel(), dtype=dtype, device=device)
            _all_gather_flat(gathered, flat, group=group)
            rows = gathered.view(world, -1)
            present = rows[:, -len(idx):].ne(0).any(0).tolist()  # read before the sum below
            # In rank order: rank r holds leaves r*k .. r*k+k-1. The sum lands in row 0; clone
            # it so the grads do not keep the D-times-larger gather buffer alive.
            summed = tree_sum_(list(rows.unbind(0))).clone()
            offset = 0
            for j, i in enumerate(idx):
                n = self.params[i].numel()
                if present[j]:
                    out[i] = summed[offset:offset + n].view_as(self.params[i])
                offset += n
        return out
