"""Gradient compression of the data-parallel reduction (`parallel.grad_compression`).

`bf16` and `fp16` halve the bytes: a DDP communication hook casts each bucket (divided by
the world size first, as torch's own fp16 hook does, so the sum cannot overflow) before its
all-reduce and back after; FSDP2 reduce-scatters in that dtype (its reduce dtype). torch's
bf16 hook insists on NCCL; this one runs on gloo too. `powersgd`
is torch's PowerSGD DDP hook: each gradient matrix is all-reduced as two low-rank factors,
and what the approximation missed is carried to the next step (error feedback), so nothing
is lost, only delayed.

PowerSGD has state: each rank's error feedback and the factors Q, reused from step to step
(warm start). torch keeps them per DDP bucket, flat, and a bucket's contents depend on the
order gradients became ready in the process's first step; a process that restores a
checkpoint has other buckets in its own first step. The state is kept here per parameter
instead, copied in before torch's hook and out after it, so a checkpoint holds it by
parameter name and a resume is exact. The error feedback differs per rank (under
`comm.error.r<rank>.<name>`); Q is all-reduced, the same on every rank (`comm.q.<name>`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
    PowerSGDState,
    _should_compress,
    powerSGD_hook,
)

if TYPE_CHECKING:
    from torch.nn.parallel import DistributedDataParallel

    from stalwart.core.config import ParallelConfig

HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
# PowerSGD compresses a matrix only when that shrinks it at least this much (torch's default).
MIN_COMPRESSION_RATE = 2


def reduce_dtype(config: ParallelConfig) -> torch.dtype | None:
    """The dtype FSDP2 reduces gradients in, when compression sets one."""
    return HALF.get(config.grad_compression)


def register(model: DistributedDataParallel, config: ParallelConfig, *, rank: int
             ) -> PowerSGD | None:
    """Install the DDP communication hook `config` asks for; the PowerSGD state, if any."""
    name = config.grad_compression
    if name in HALF:
        model.register_comm_hook(HalfReduce(model.process_group, HALF[name]),
                                 HalfReduce.hook)
        return None
    if name == "powersgd":
        return PowerSGD(model, rank=rank, matrix_rank=config.powersgd_rank,
                        start_step=config.powersgd_start_step)
    return None


class HalfReduce:
    """DDP hook state: all-reduce each bucket in a 16-bit dtype."""

    def __init__(self, group: dist.ProcessGroup, dtype: torch.dtype) -> None:
        self.group, self.dtype = group, dtype

    @staticmethod
    def hook(self: HalfReduce, bucket):  # noqa: ANN001, ANN205 (DDP reads annotations as types)
        buffer = bucket.buffer()
        half = buffer.to(self.dtype).div_(self.group.size())
        fut = dist.all_reduce(half, group=self.group, async_op=True).get_future()

        def back(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            buffer.copy_(done.value()[0])
            return buffer

        return fut.then(back)


def _split_into(flat: torch.Tensor, names: list[str], into: dict[str, torch.Tensor]) -> None:
    """Copy consecutive slices of `flat` into the kept tensors of `names`, in order."""
    start = 0
    for name in names:
        target = into[name]
        target.copy_(flat[start:start + target.numel()])
        start += target.numel()


def _matrix(shape: torch.Size) -> tuple[int, int]:
    """How PowerSGD views a gradient: rows = the first dimension, the rest flattened."""
    rows = shape[0] if len(shape) else 1
    return rows, max(1, int(torch.Size(shape).numel()) // max(rows, 1))


def _factors(shape: torch.Size, matrix_rank: int) -> tuple[int, int, int] | None:
    """(rows, cols, rank) of the factors torch's hook sends for a gradient of `shape`, or
    None when it sends that gradient whole (its factors would not be half its size)."""
    rows, cols = _matrix(shape)
    rank = min(rows, cols, matrix_rank)
    return (rows, cols, rank) if _should_compress(rows, cols, rank, MIN_COMPRESSION_RATE)[0] \
        else None


def reduction_bytes(model: torch.nn.Module, config: ParallelConfig) -> tuple[int, int]:
    """Bytes of gradient one rank hands its data-parallel reduction each step: (before
    PowerSGD starts or without it, once it compresses). Its parameters as this rank holds
    them whole (FSDP2 reduce-scatters the whole gradient); a ring all-reduce puts about
    twice this on the wire."""
    params = [p for p in model.parameters() if p.requires_grad]
    whole = (2 if config.grad_compression in HALF else 4) * sum(p.numel() for p in params)
    if config.grad_compression != "powersgd":
        return whole, whole
    compressed = 0
    for p in params:
        factors = _factors(p.shape, config.powersgd_rank)
        compressed += 4 * ((factors[0] + factors[1]) * factors[2] if factors else p.numel())
    return whole, compressed


class PowerSGD:
    """torch's PowerSGD hook on a DDP model, with its state held per parameter."""

    def __init__(self, model: DistributedDataParallel, *, rank: int, matrix_rank: int,
                 start_step: int) -> None:
        self.rank = rank
        self.matrix_rank = matrix_rank
        params = [(n, p) for n, p in model.module.named_parameters() if p.requires_grad]
        self.names = {p: n for n, p in params}
        self.torch_state = PowerSGDState(
            process_group=model.process_group, matrix_approximation_rank=matrix_rank,
            start_powerSGD_iter=start_step, min_compression_rate=MIN_COMPRESSION_RATE,
            use_error_feedback=True, warm_start=True)
        # Made now, with every key a checkpoint may hold: a restore loads into them.
        self.errors = {n: torch.zeros(p.numel(), dtype=p.dtype, device=p.device)
                       for n, p in params}
        self.qs = {n: torch.zeros(factors[1] * factors[2], dtype=p.dtype, device=p.device)
                   for n, p in params if (factors := _factors(p.shape, matrix_rank))}
        self._in_flight: torch.futures.Future[torch.Tensor] | None = None
        self.q_ready = False
        """Whether Q holds factors (set at the first compressed step; until then torch draws
        them from its seeded generator, the same draws after a restore)."""
        model.register_comm_hook(self, PowerSGD._hook)

    def _factor_layout(self, grads: list[torch.Tensor], names: list[str]
                       ) -> tuple[list[str], int]:
        """How torch's hook lays out a bucket's factors: the parameters whose Q it keeps, in
        its order (the compressed matrices grouped by shape, each group in bucket order),
        and the length of all their P."""
        groups: dict[tuple[int, int], list[str]] = defaultdict(list)
        p_size = 0
        for grad, name in zip(grads, names, strict=True):
            if factors := _factors(grad.shape, self.matrix_rank):
                rows, cols, rank = factors
                groups[(rows, cols)].append(name)
                p_size += rows * rank
        return [n for group in groups.values() for n in group], p_size

    @staticmethod
    def _hook(self: PowerSGD, bucket):  # noqa: ANN001, ANN205 (DDP reads annotations as types)
        state, index = self.torch_state, bucket.index()
        names = [self.names[p] for p in bucket.parameters()]
        q_order, p_size = self._factor_layout(bucket.gradients(), names)
        compressing = state.iter >= state.start_powerSGD_iter
        if compressing:
            state.error_dict[index] = torch.cat([self.errors[n] for n in names])
            if self.q_ready and q_order:  # warm start from the kept factors
                state.q_memory_dict[index] = torch.cat([self.qs[n] for n in q_order])
                # P is recomputed from Q every step; torch's hook only needs its room, and
                # finding it tells the hook not to draw Q afresh.
                state.p_memory_dict[index] = bucket.buffer().new_empty(p_size)

        def keep(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            if compressing:
                _split_into(state.error_dict[index], names, self.errors)
                if q_order:
                    _split_into(state.q_memory_dict[index], q_order, self.qs)
                if bucket.is_last():
                    self.q_ready = True
            return fut.value()

        # One bucket at a time. torch's hook starts its second and third all-reduce from the
        # callbacks of the one before, on whichever thread finished it: with two buckets in
        # flight the ranks could start them in different orders, which gloo detects as a
        # size mismatch and aborts on (NCCL would hang). The wait costs only overlap.
        if self._in_flight is not None:
            self._in_flight.wait()
        self._in_flight = powerSGD_hook(state, bucket).then(keep)
        return self._in_flight

    def state_dict(self) -> dict[str, Any]:
        return {"iter": self.torch_state.iter, "q_ready": self.q_ready,
                **{f"error.r{self.rank}.{n}": t for n, t in self.errors.items()},
                **{f"q.{n}": t for n, t in self.qs.items()}}

    def scalar_state(self) -> dict[str, Any]:
        return {"iter": self.torch_state.iter, "q_ready": self.q_ready}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take what `state` holds; keys it lacks (a checkpoint of another world or without
        compression) keep their fresh values: that rank's error feedback starts at zero."""
        for key, target in ([(f"error.r{self.rank}.{n}", t) for n, t in self.errors.items()]
                            + [(f"q.{n}", t) for n, t in self.qs.items()]):
            if key in state and state[key] is not target:
                target.copy_(state[key])
        if "iter" in state:
            self.torch_state.iter = int(state["iter"])
            self.q_ready = bool(state.get("q_ready", False))
