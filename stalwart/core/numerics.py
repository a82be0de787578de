"""Numerical faults as data: what a step's checks found, and the policy's decision on it.

Every rank evaluates the same pure functions on the same agreed numbers (the step's
all-reduce), so every rank reaches the same decision without a word to the driver: a replay
or a rollback then costs a step's time, not a new world's. What the world cannot mend in
place (a faulty rank to evict, too many skipped batches) ends the world as a failure, and
the controller's failure policy takes it from there.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Fault(StrEnum):
    NAN = "nan"
    """A loss or gradient norm that is not finite, on some rank."""
    SPIKE = "spike"
    """The global loss far above its recent median."""
    MISMATCH = "mismatch"
    """Data-parallel replicas whose parameters or optimizer state differ."""


class Action(StrEnum):
    REPLAY = "replay"
    """Train the same step again, on the same batch, from the same state."""
    SKIP = "skip"
    """Drop the step's update: its batch counts as consumed, the weights do not move."""
    ROLLBACK = "rollback"
    """Restore every rank from the memory tier's snapshot before the fault, and train on."""
    EVICT = "evict"
    """Replace the ranks found faulty and keep workers off their nodes."""
    STOP = "stop"
    """End the run with an error."""


@dataclass(frozen=True)
class Finding:
    """A numerical fault found in one step, the same on every rank."""

    fault: Fault
    step: int
    ranks: tuple[int, ...] = ()
    """The ranks it was found on (not finite there; differing from their replicas)."""
    detail: str = ""
    attributed: bool = True
    """False when replicas differ with no majority: no rank can be blamed."""


@dataclass(frozen=True)
class Decision:
    action: Action
    finding: Finding
    reason: str
    rollback_to: int | None = None
    """The step whose snapshot a rollback restores; for an eviction, the newest step whose
    snapshots the next world may restore (newer ones may hold the fault)."""
    evict: tuple[int, ...] = ()
    """The ranks an eviction replaces: those named evict_after times, not every rank named."""


# The robust scale's floor, relative to the median: a flat loss has a MAD near 0, and any
# wobble above it would otherwise count as a spike.
RELATIVE_SCALE_FLOOR = 0.01
MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution is 0.6745 sigma


class SpikeDetector:
    """A robust z-score of each loss against the median and MAD of the last accepted ones."""

    def __init__(self, z: float, window: int, warmup: int) -> None:
        self.z, self.warmup = z, warmup
        self.losses: deque[float] = deque(maxlen=window)
        self.accepted = 0

    def score(self, loss: float) -> float | None:
        """How many robust standard deviations `loss` is above the window's median; None
        while the check is off (no threshold, still warming up)."""
        if self.z <= 0 or self.accepted < max(self.warmup, 5) or not math.isfinite(loss):
            return None
        median = statistics.median(self.losses)
        mad = statistics.median(abs(x - median) for x in self.losses)
        scale = max(MAD_TO_SIGMA * mad, RELATIVE_SCALE_FLOOR * abs(median), 1e-12)
        return (loss - median) / scale

    def is_spike(self, loss: float) -> bool:
        score = self.score(loss)
        return score is not None and score > self.z

    def accept(self, loss: float) -> None:
        """The step trained on: its loss joins the window."""
        if math.isfinite(loss):
            self.losses.append(loss)
            self.accepted += 1


@dataclass
class NumericsState:
    """What a bit-exact restore needs of the checks: checkpointed with the step."""

    skipped: list[int] = field(default_factory=list)
    """Steps whose batch was skipped (their update dropped)."""
    losses: list[float] = field(default_factory=list)
    """The spike window, oldest first."""
    accepted: int = 0

    def to_json(self) -> str:
        return json.dumps({"skipped": self.skipped, "losses": self.losses,
                           "accepted": self.accepted})

    @classmethod
    def from_json(cls, text: str) -> NumericsState:
        data: dict[str, Any] = json.loads(text) if text else {}
        return cls(skipped=[int(s) for s in data.get("skipped", [])],
                   losses=[float(x) for x in data.get("losses", [])],
                   accepted=int(data.get("accepted", 0)))


@dataclass(frozen=True)
class ReplicaCheck:
    odd: tuple[int, ...] = ()
    """Ranks whose fingerprint differs from their replica group's majority."""
    split: tuple[int, ...] = ()
    """Ranks of groups that differ with no majority (two replicas, or an even split)."""

    @property
    def differs(self) -> bool:
        return bool(self.odd or self.split)


def compare_replicas(fingerprints: Sequence[int], classes: Sequence[Hashable]) -> ReplicaCheck:
    """Group ranks by replica class (equal: they must hold identical state) and name the
    ranks that differ from their group's strict majority."""
    groups: dict[Hashable, list[int]] = {}
    for rank, cls in enumerate(classes):
        groups.setdefault(cls, []).append(rank)
    odd: list[int] = []
    split: list[int] = []
    for ranks in groups.values():
        values = [fingerprints[r] for r in ranks]
        if len(set(values)) == 1:
            continue
        top = max(set(values), key=values.count)
        if values.count(top) * 2 > len(values):
            odd.extend(r for r in ranks if fingerprints[r] != top)
        else:
            split.extend(ranks)
    return ReplicaCheck(odd=tuple(sorted(odd)), split=tuple(sorted(split)))


@dataclass(frozen=True)
class Limits:
    """The policy's bounds, from [numerics]."""

    max_skips: int
    evict_after: int


def decide(finding: Finding, *, attempt: int, skips: int, strikes: dict[int, int],
           verified: int | None, limits: Limits) -> Decision:
    """The policy: a NaN or a spike is replayed once, then its batch is skipped (up to
    max_skips); a mismatch rolls back to `verified` (the newest step whose snapshot is known
    good), and a rank named `evict_after` times is evicted. `attempt`: the how-many-th time
    this step failed; `strikes`: mismatches per rank so far, this one included."""
    if finding.fault is Fault.MISMATCH:
        faulty = tuple(r for r in finding.ranks if strikes.get(r, 0) >= limits.evict_after)
        if faulty:
            return Decision(Action.EVICT, finding, f"rank(s) {list(faulty)} differed from "
                            f"their replicas {limits.evict_after} time(s): faulty hardware",
                            rollback_to=verified, evict=faulty)
        if verified is None:
            return Decision(Action.STOP, finding, "no snapshot before the fault is held to "
                            "roll back to")
        return Decision(Action.ROLLBACK, finding, f"restoring step {verified}, the newest "
                        f"snapshot taken before the last matching fingerprint",
                        rollback_to=verified)
    if attempt <= 1:
        return Decision(Action.REPLAY, finding, "first failure of this step")
    if skips >= limits.max_skips:
        return Decision(Action.STOP, finding, f"the step failed again and "
                        f"numerics.max_skips = {limits.max_skips} batches were skipped")
    return Decision(Action.SKIP, finding, "the step failed again on the same batch")
