"""The restore policy: where a new world restores from (memory, storage or nothing), and why.

The memory tier's newest complete step wins when it is at least as new as storage's newest
checkpoint; else storage; else the world starts fresh. When loading from memory fails (a
holder vanished, a shard would not load), storage is the fallback, unless the failure is a
dead or silent worker, which is a failure of the world itself. Each decision carries its
reason, which the controller logs as `checkpoint_chosen`.

The policy is pure: it is given what the memory tier holds (the group's inventory, fetched
by the controller) and storage's newest valid checkpoint, and asks nothing itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stalwart.checkpointing.memory.catalog import MemoryChoice, newest_complete
from stalwart.core import events as ev
from stalwart.orchestrator.failures import FailureKind

if TYPE_CHECKING:
    from stalwart.checkpointing.memory.store import Inventory
    from stalwart.checkpointing.storage.catalog import CheckpointInfo
    from stalwart.orchestrator.failures import WorkerFailure

# A restore from memory that fails this way is not retried from storage: the world is broken.
NOT_FALLEN_BACK = (FailureKind.WORKER_DIED, FailureKind.NODE_DIED, FailureKind.HANG)


@dataclass(frozen=True, kw_only=True)
class RestoreDecision:
    source: str
    """memory, storage or none."""
    memory: MemoryChoice | None
    """The in-memory snapshot to load (source memory)."""
    memory_step: int | None
    """The memory tier's newest complete step (None: nothing complete)."""
    storage_step: int | None
    """Storage's newest valid checkpoint (None: none)."""
    reason: str

    @property
    def step(self) -> int | None:
        """The step restored from (None: a fresh start)."""
        return self.memory_step if self.source == "memory" else self.storage_step

    @property
    def message(self) -> str:
        return f"restoring from {self.source}: {self.reason}"

    def event(self, generation: int) -> ev.CheckpointChosen:
        """The `checkpoint_chosen` event: both candidates and why."""
        return ev.CheckpointChosen(source=self.source, step=self.step,
                                   memory_step=self.memory_step, storage_step=self.storage_step,
                                   reason=self.reason, generation=generation)


class RestorePolicy:
    def __init__(self, *, memory_tier: bool) -> None:
        self.memory_tier = memory_tier
        """checkpoint.snapshot_every > 0 or "auto": there is a memory tier to ask."""

    def choose(self, inventory: Mapping[str, Inventory], checkpoint: CheckpointInfo | None
               ) -> RestoreDecision | None:
        """Memory or storage for a world after the first, given what each warm worker's
        memory tier holds (None: no memory tier to weigh, so storage's checkpoint is loaded
        if there is one, without a logged choice; no inventory is needed then)."""
        if not self.memory_tier:
            return None
        choice, why_not = newest_complete(dict(inventory))
        storage_step = checkpoint.step if checkpoint else None
        memory_step = choice.step if choice else None
        if choice is not None and (storage_step is None or choice.step >= storage_step):
            source, reason = "memory", (f"memory holds step {choice.step} complete" + (
                f", storage's newest is step {storage_step}" if storage_step is not None
                else ", storage has none") + (f" ({why_not})" if why_not else ""))
        elif checkpoint is not None:
            source, choice = "storage", None
            reason = (f"storage's step {storage_step} is newer than memory's step "
                      f"{memory_step}" if memory_step is not None else
                      f"nothing complete in memory: {why_not}")
        else:
            source, reason = "none", f"nothing complete in memory ({why_not}) or in storage"
        return RestoreDecision(source=source, memory=choice, memory_step=memory_step,
                               storage_step=storage_step, reason=reason)

    @staticmethod
    def fallback(memory: MemoryChoice, checkpoint: CheckpointInfo | None,
                 failure: WorkerFailure) -> RestoreDecision | None:
        """After loading `memory` failed: storage (or nothing), or None when the failure must
        be handled as a failure of the world."""
        if failure.kind in NOT_FALLEN_BACK:
            return None
        return RestoreDecision(
            source="storage" if checkpoint else "none", memory=None, memory_step=memory.step,
            storage_step=checkpoint.step if checkpoint else None,
            reason=f"restoring from memory failed: {failure.message}")


def nothing_restorable(*, committed: list[int], newest_reported: int,
                       skipped: list[tuple[int, str]], memory_why: str | None) -> str | None:
    """Why a world that finds nothing to restore must not start from step 0, or None when
    nothing was ever committed (then a fresh start loses nothing).

    `committed`: steps whose manifest storage holds; `newest_reported`: the newest commit
    the run saw (-1: none); `skipped`: (step, why) of each checkpoint passed over."""
    if not committed and newest_reported < 0 and not skipped:
        return None
    why = "; ".join(f"step {step}: {message}" for step, message in skipped) or (
        "none is left in storage")
    steps = sorted(set(committed) | {s for s, _ in skipped}
                   | ({newest_reported} if newest_reported >= 0 else set()))
    memory = f"; memory: {memory_why}" if memory_why else ""
    return (f"checkpoints were committed (steps {steps}) but none can be restored, and "
            f"memory holds no complete step; refusing to restart from step 0. "
            f"Skipped: {why}{memory}")
