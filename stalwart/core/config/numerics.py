"""The [numerics] section: which numerical faults each step checks for, and how far to go.

A NaN or a loss spike is found before the step updates the weights; a replica that differs
from its twins (silent data corruption) is found by a fingerprint compared in the step's own
all-reduce. docs/failures.md says what each check finds and what it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stalwart.core.config.sections import _check_kinds, _require


@dataclass(frozen=True, kw_only=True)
class NumericsConfig:
    nan_check: bool = True
    """Check every step's loss and gradient norm on every rank before the update: a value that is not finite on any rank stops the update on all of them; the step is replayed, and its batch skipped if it fails again."""
    spike_z: float = 0.0
    """A step whose loss is this many robust standard deviations (1.4826 x MAD) above the median of the last `spike_window` accepted losses is a spike: replayed, then its batch skipped. `0` turns it off. 6 to 10 suits most runs."""
    spike_window: int = 50
    """Accepted losses the spike check compares against (its running median and MAD)."""
    spike_warmup: int = 20
    """No spike check until this many losses were accepted (the first steps fall fast)."""
    fingerprint_every: int = 0
    """Compare a fingerprint of every rank's parameters and optimizer state across its data-parallel replicas every this many steps, in the step's own all-reduce; `0` turns it off. A mismatch rolls back from the memory tier, which then keeps `fingerprint_every + 1` snapshots (2 at 1: no more than without). Needs `checkpoint.snapshot_every = 1`."""
    evict_after: int = 2
    """A rank whose fingerprint differs from its replicas' majority this many times is faulty hardware: the run replaces it and no longer places workers on its node."""
    max_skips: int = 3
    """Batches the checks may skip over the run; the next fault that would skip one stops the run with an error. `0`: never skip (a fault that replays twice stops the run)."""
    skip_steps: list[int] = field(default_factory=list)
    """Steps whose batch is skipped (trained on, its update dropped; the sample order is unchanged): to step over a batch known to be bad, or to reproduce a run that skipped it."""

    def __post_init__(self) -> None:
        _check_kinds(self, "numerics")
        _require(self.spike_z == 0 or self.spike_z >= 1, "numerics.spike_z", self.spike_z,
                 "must be >= 1 (robust standard deviations), or 0 (off)")
        _require(self.spike_window >= 5, "numerics.spike_window", self.spike_window,
                 "must be >= 5 (a median and a MAD need a few losses)")
        _require(self.spike_warmup >= 0, "numerics.spike_warmup", self.spike_warmup,
                 "must be >= 0")
        _require(self.fingerprint_every >= 0, "numerics.fingerprint_every",
                 self.fingerprint_every, "must be >= 0 (0: off)")
        _require(self.evict_after >= 1, "numerics.evict_after", self.evict_after,
                 "must be >= 1")
        _require(self.max_skips >= 0, "numerics.max_skips", self.max_skips, "must be >= 0")
        _require(all(isinstance(s, int) and s >= 1 for s in self.skip_steps),
                 "numerics.skip_steps", self.skip_steps, "must be a list of steps >= 1")

    @property
    def snapshots_kept(self) -> int:
        """Snapshots the memory tier keeps per shard: a fingerprint mismatch rolls back to the
        newest one taken before the last matching fingerprint."""
        return max(2, self.fingerprint_every + 1)
