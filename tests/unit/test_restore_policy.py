"""RestorePolicy on its own: memory or storage (or nothing), the reason logged for it, and
the fallback to storage when loading from memory fails. No group, fake or real: the policy
is given the memory inventory as plain data."""

from __future__ import annotations

import pytest

from stalwart.checkpointing.memory.catalog import MemoryChoice
from stalwart.checkpointing.memory.store import Inventory
from stalwart.checkpointing.storage.catalog import CheckpointInfo
from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.orchestrator.restore import RestoreDecision, RestorePolicy
from tests.fake_group import held_in_memory

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

POLICY = RestorePolicy(memory_tier=True)


def storage(step: int) -> CheckpointInfo:
    return CheckpointInfo(step=step, path=f"/ckpt/step_{step}", manifest={})


def memory(*steps: int) -> dict[str, Inventory]:
    return {"pid-1": held_in_memory(list(steps))}


def test_no_memory_tier_weighs_nothing_and_logs_no_choice() -> None:
    # (the controller asks for no inventory then: test_controller_restore.py)
    assert RestorePolicy(memory_tier=False).choose(memory(5), storage(4)) is None
    assert RestorePolicy(memory_tier=False).choose({}, None) is None


@pytest.mark.parametrize(("held", "checkpoint", "reason"), [
    ((4, 5), storage(4), "memory holds step 5 complete, storage's newest is step 4"),
    ((4,), storage(4), "memory holds step 4 complete, storage's newest is step 4"),  # a tie
    ((3,), None, "memory holds step 3 complete, storage has none"),
])
def test_memory_when_it_is_at_least_as_new(held: tuple[int, ...],
                                           checkpoint: CheckpointInfo | None,
                                           reason: str) -> None:
    decision = POLICY.choose(memory(*held), checkpoint)
    assert decision is not None and decision.source == "memory"
    assert decision.memory is not None and decision.memory.step == max(held)
    assert decision.step == decision.memory_step == max(held)
    assert decision.reason == reason
    assert decision.message == f"restoring from memory: {reason}"


def test_storage_when_it_is_newer() -> None:
    decision = POLICY.choose(memory(2, 3), storage(4))
    assert decision == RestoreDecision(source="storage", memory=None, memory_step=3,
                                       storage_step=4,
                                       reason="storage's step 4 is newer than memory's step 3")
    assert decision.step == 4


def test_storage_or_nothing_when_memory_holds_nothing() -> None:
    decision = POLICY.choose(memory(), storage(4))
    assert (decision.source, decision.step, decision.reason) == (
        "storage", 4, "nothing complete in memory: no snapshot is held in memory")
    fresh = POLICY.choose(memory(), None)
    assert (fresh.source, fresh.step, fresh.reason) == (
        "none", None, "nothing complete in memory (no snapshot is held in memory) or in storage")


def test_the_event_names_both_candidates() -> None:
    event = POLICY.choose(memory(5), storage(4)).event(generation=2)
    assert (event.source, event.step, event.memory_step, event.storage_step,
            event.generation) == ("memory", 5, 5, 4, 2)


def failure(kind: FailureKind) -> WorkerFailure:
    return WorkerFailure(kind=kind, rank=None, message="a shard would not load",
                         detected_at=0.0)


CHOICE = MemoryChoice(generation=1, step=5, layouts={}, holders={})


@pytest.mark.parametrize("kind", [FailureKind.START_ERROR, FailureKind.USER_ERROR,
                                  FailureKind.COLLECTIVE_ERROR])
def test_a_failed_memory_restore_falls_back_to_storage(kind: FailureKind) -> None:
    assert RestorePolicy.fallback(CHOICE, storage(4), failure(kind)) == RestoreDecision(
        source="storage", memory=None, memory_step=5, storage_step=4,
        reason="restoring from memory failed: a shard would not load")
    assert RestorePolicy.fallback(CHOICE, None, failure(kind)).source == "none"


@pytest.mark.parametrize("kind", [FailureKind.WORKER_DIED, FailureKind.NODE_DIED,
                                  FailureKind.HANG])
def test_a_dead_or_silent_worker_is_not_fallen_back_from(kind: FailureKind) -> None:
    assert RestorePolicy.fallback(CHOICE, storage(4), failure(kind)) is None
