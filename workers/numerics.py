"""The numerical checks of one rank's step: what it adds to the step's all-reduce, and reads back.

Each step's summary all-reduce (workers/engine.py) carries, besides the loss, how many of
this rank's values were not finite and, on fingerprint steps, this rank's fingerprint in a
slot of its own. Every rank then reads the same numbers back and reaches the same verdict
(stalwart/core/numerics.py decides), so the checks cost no collective of their own.

A fingerprint is the wrapping integer sum of the bits of every local tensor of the
parameters and the optimizer state: any single flipped bit changes it, and replicas that
are bit-identical by construction (the same reduced gradients, the same update) agree.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from stalwart.core.config import JobConfig
from stalwart.core.numerics import (
    Action,
    Decision,
    Fault,
    Finding,
    Limits,
    NumericsState,
    SpikeDetector,
    compare_replicas,
    decide,
)

# A fingerprint travels as three float32 slots of 24, 24 and 16 bits: a float32 holds an
# integer up to 2^24 exactly, and a slot is non-zero on one rank only, so the sum is exact.
SLOT_BITS = (24, 24, 16)
# The integer type whose bits each floating dtype's elements are summed as.
INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Tensors are summed in batches of about this many bytes, each one copy into one buffer and
# one sum: a kernel per tensor would cost more launch time than the sums themselves.
BATCH_BYTES = 256 << 20


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer
                  ) -> list[torch.Tensor]:
    """This rank's local parameters and optimizer state tensors, in a fixed order."""
    tensors = [_local(p.detach()) for p in model.parameters()]
    for p in model.parameters():
        for value in optimizer.state.get(p, {}).values():
            if isinstance(value, torch.Tensor):
                tensors.append(_local(value.detach()))
    return tensors


def fingerprint(tensors: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The wrapping int64 sum of the tensors' bits, on `device`, with no host sync."""
    return sum_batches(int_batches(tensors), device)


def int_batches(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors as flat integer views, in batches of one device and element size (AdamW
    keeps its step counts on the CPU) of about BATCH_BYTES each. The views follow the
    tensors' in-place updates, so a batching holds as long as the tensors do."""
    groups: dict[tuple[torch.device, int], list[torch.Tensor]] = {}
    for t in tensors:
        if t.numel():
            groups.setdefault((t.device, t.element_size()), []).append(t)
    batches: list[list[torch.Tensor]] = []
    for (_, size), group in groups.items():
        batch: list[torch.Tensor] = []
        held = 0
        for t in group:
            batch.append(t.reshape(-1).view(INT_OF_SIZE[size]))
            held += t.numel() * size
            if held >= BATCH_BYTES:
                batches.append(batch)
                batch, held = [], 0
        if batch:
            batches.append(batch)
    return batches


def sum_batches(batches: list[list[torch.Tensor]], device: torch.device) -> torch.Tensor:
    sums = [torch.zeros((), dtype=torch.int64, device=device)]
    for batch in batches:
        flat = batch[0] if len(batch) == 1 else torch.cat(batch)
        sums.append(flat.sum(dtype=torch.int64).to(device))
    return torch.stack(sums).sum()


def fingerprint_slots(value: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """float32 slots for the summary: this rank's three parts from len(SLOT_BITS) x rank,
    zeros elsewhere. Every bit of the int64 travels (a float64 flip may sit in the top 16)."""
    n = len(SLOT_BITS)
    slots = torch.zeros(n * world_size, dtype=torch.float32, device=value.device)
    shift = 0
    for i, bits in enumerate(SLOT_BITS):
        slots[n * rank + i] = ((value >> shift) & ((1 << bits) - 1)).to(torch.float32)
        shift += bits
    return slots


def read_fingerprints(slots: Sequence[float]) -> list[int]:
    """Every rank's fingerprint (as an unsigned 64-bit integer), from the all-reduced slots."""
    n = len(SLOT_BITS)
    out = []
    for start in range(0, len(slots), n):
        value, shift = 0, 0
        for i, bits in enumerate(SLOT_BITS):
            value |= int(slots[start + i]) << shift
            shift += bits
        out.append(value)
    return out


# The summary's check entries before the fingerprint slots: ranks whose loss is not finite,
# the sum of (rank + 1) over them (which names the rank when it is one), and ranks whose
# gradients are not (after the gradient all-reduce, one rank's NaN is every rank's).
FLAGS = 3


def not_finite(loss: torch.Tensor, grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """1.0 when this rank's loss or local gradients hold a value that is not finite."""
    return torch.maximum(*_bad(loss, grads))


def _bad(loss: torch.Tensor, grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    loss_bad = (~torch.isfinite(loss)).to(torch.float32)
    if not grads:
        return loss_bad, torch.zeros_like(loss_bad)
    norms = torch._foreach_norm([_local(g) for g in grads])
    return loss_bad, (~torch.isfinite(torch.stack(norms).sum())).to(torch.float32)


def finite_flags(loss: torch.Tensor, grads: Sequence[torch.Tensor], rank: int
                 ) -> list[torch.Tensor]:
    """This rank's FLAGS entries."""
    loss_bad, grads_bad = _bad(loss, grads)
    return [loss_bad, loss_bad * (rank + 1), grads_bad]


def not_finite_detail(flags: Sequence[float]) -> str:
    """What the all-reduced FLAGS say, e.g. `loss not finite on rank 1; gradient norm not
    finite on 2 rank(s)`."""
    losses, rank_sum, grads = (round(x) for x in flags[:FLAGS])
    said = []
    if losses:
        said.append(f"loss not finite on rank {rank_sum - 1}" if losses == 1
                    else f"loss not finite on {losses} ranks")
    if grads:
        said.append(f"gradient norm not finite on {grads} rank(s)")
    return "; ".join(said)


@dataclass
class StepChecks:
    """What this step's summary all-reduce carries for the checks, and where."""

    values: list[torch.Tensor]
    fingerprinted: bool


@dataclass
class NumericsGuard:
    """One rank's numerical checks across a world: the spike window, the skipped steps, the
    mismatches per rank, and the decisions taken (drained by the worker's poll)."""

    config: JobConfig
    rank: int
    world_size: int
    classes: list[Any]
    """Each rank's replica class (equal: data-parallel replicas of identical state)."""
    state: NumericsState = field(default_factory=NumericsState)
    strikes: dict[int, int] = field(default_factory=dict)
    decisions: list[dict[str, Any]] = field(default_factory=list)
    verified: int | None = None
    """The newest step whose snapshot a matching fingerprint vouched for."""

    def __post_init__(self) -> None:
        self._views: tuple[Hashable, list[list[torch.Tensor]]] | None = None
        nc = self.config.numerics
        self.spikes = SpikeDetector(nc.spike_z, nc.spike_window, nc.spike_warmup)
        self.limits = Limits(max_skips=nc.max_skips, evict_after=nc.evict_after)
        self.state.skipped = sorted(set(self.state.skipped))

    @property
    def on(self) -> bool:
        nc = self.config.numerics
        return nc.nan_check or nc.spike_z > 0 or nc.fingerprint_every > 0

    def fingerprints_at(self, step: int) -> bool:
        every = self.config.numerics.fingerprint_every
        return every > 0 and step % every == 0

    def checks(self, step: int, loss: torch.Tensor, grads: Sequence[torch.Tensor],
               tensors: Callable[[], list[torch.Tensor]], version: Hashable) -> StepChecks:
        """The summary's extra entries: the FLAGS, then fingerprint slots.
        `tensors` lists the state to fingerprint; its integer views are kept while `version`
        stays the same (a DTensor's to_local per tensor per step costs more than the sums)."""
        values = (finite_flags(loss, grads, self.rank) if self.config.numerics.nan_check
                  else [torch.zeros((), device=loss.device)] * FLAGS)
        fingerprinted = self.fingerprints_at(step)
        if fingerprinted:
            if self._views is None or self._views[0] != version:
                state = tensors()
                # A view follows in-place updates; a non-contiguous tensor's is a copy.
                kept = version if all(t.is_contiguous() for t in state) else object()
                self._views = (kept, int_batches(state))
            fp = sum_batches(self._views[1], loss.device)
            values.extend(fingerprint_slots(fp, self.rank, self.world_size).unbind())
        return StepChecks(values, fingerprinted)

    def verdict(self, step: int, loss: float, reduced: Sequence[float],
                fingerprinted: bool) -> Finding | None:
        """The fault the agreed numbers show, if any: replicas first (the state before this
        step is wrong), then a value not finite, then a spike."""
        if fingerprinted:
            check = compare_replicas(read_fingerprints(reduced[FLAGS:]), self.classes)
            if check.differs:
                ranks = check.odd or check.split
                how = ("differ from their replicas" if check.odd
                       else "differ, with no majority to tell which is wrong")
                return Finding(Fault.MISMATCH, step, ranks,
                               f"rank(s) {list(ranks)} {how} (parameters and optimizer state "
                               f"after step {step - 1})", attributed=bool(check.odd))
            self.verified = step - 1
        if reduced[0] > 0 or reduced[2] > 0:
            return Finding(Fault.NAN, step, (), not_finite_detail(reduced))
        if self.spikes.is_spike(loss):
            score = self.spikes.score(loss)
            return Finding(Fault.SPIKE, step, (), f"loss {loss:.4g} is {score:.1f} robust "
                                                  f"standard deviations above the median of "
                                                  f"the last {len(self.spikes.losses)}")
        return None

    def decide(self, finding: Finding, attempt: int, started: float) -> Decision:
        """The policy's decision on `finding`, recorded for the poll; `started`: the step's
        start (time.perf_counter())."""
        if finding.fault is Fault.MISMATCH and finding.attributed:
            for r in finding.ranks:
                self.strikes[r] = self.strikes.get(r, 0) + 1
        verified = self.verified if self.verified is not None and self.verified >= 1 else None
        decision = decide(finding, attempt=attempt, skips=len(self.state.skipped),
                          strikes=self.strikes, verified=verified, limits=self.limits)
        self.decisions.append(_event_fields(decision, time.perf_counter() - started))
        return decision

    def accept(self, loss: float) -> None:
        self.spikes.accept(loss)

    def skipped(self, step: int) -> None:
        if step not in self.state.skipped:
            self.state.skipped.append(step)

    def must_skip(self, step: int) -> bool:
        return step in self.config.numerics.skip_steps or step in self.state.skipped

    def drain(self) -> list[dict[str, Any]]:
        out, self.decisions = self.decisions, []
        return out

    # ------------------------------------------------------------------ state

    def snapshot_state(self) -> str:
        self.state.losses = list(self.spikes.losses)
        self.state.accepted = self.spikes.accepted
        return self.state.to_json()

    def load_state(self, text: str) -> None:
        self.state = NumericsState.from_json(text)
        self.spikes.losses.clear()
        self.spikes.losses.extend(self.state.losses)
        self.spikes.accepted = self.state.accepted


def _event_fields(decision: Decision, decided_s: float) -> dict[str, Any]:
    """A decision as the `numerical_fault` event's fields (the controller adds the time)."""
    f = decision.finding
    return {"step": f.step, "fault": f.fault.value, "action": decision.action.value,
            "ranks": list(f.ranks), "rollback_to": decision.rollback_to,
            "detail": f.detail, "reason": decision.reason, "decided_s": round(decided_s, 4),
            "time": time.time()}


class NumericsEscalation(RuntimeError):
    """The world cannot mend the fault in place: evict faulty ranks, or stop the run."""

    def __init__(self, decision: Decision, why: str | None = None) -> None:
        self.decision = decision
        f = decision.finding
        evicting = decision.action is Action.EVICT and why is None
        self.evict = decision.evict if evicting else ()
        what = f"replacing rank(s) {list(self.evict)}" if evicting else "stopping"
        super().__init__(f"numerical fault at step {f.step} ({f.fault.value}: {f.detail}); "
                         f"{what}: {why or decision.reason}")


class NumericsRollback(Exception):
    """Every rank restores its snapshot of `decision.rollback_to` and trains on from it."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(f"rolling back to step {decision.rollback_to}")
        self.decision = decision

