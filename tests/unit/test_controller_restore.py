"""Where a recovery restores from (memory or storage), and the accounts a restore keeps; the controller driven by the fake worker group
(tests/unit/controller_world.py, tests/fake_group.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from stalwart.orchestrator.failures import FailureKind
from stalwart.orchestrator.states import Finished, Stopped
from tests.fake_group import Plan, Poll
from tests.unit.controller_world import (
    T1,
    FakeWorld,
    _commit_checkpoint,
    ctrl_c,
    group_error,
    status,
    statuses,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


# ---------------------------------------------------------------------------- restore choice


def _kill_at_5(storage: Path, memory: list[int], extra: list[str] = (),
               raise_in: dict[str, BaseException] | None = None,
               tmp_path: Path = Path(), monkeypatch: Any = None) -> FakeWorld:
    """Rank 1 dies after step 5; the survivor (pid 1000) holds `memory` in its tier."""
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2, 3, 4, 5]), Poll([status(0)], dead=[1])]),
        Plan(polls=[statuses([6], done=True, t0=T1)], raise_in=raise_in or {}),
    ], ["failure.max_failures=1", "train.steps=6", *extra], storage=storage)
    w.group.memory[1000] = memory
    return w


def test_recovery_restores_memory_when_it_is_newest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 2)
    w = _kill_at_5(storage, [4, 5], tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    # The ranks stage the restored step as they start (launch's `restored`).
    assert [(c.name, c.state, c.args) for c in w.named("restore_memory", "restore", "launch")
            ] == [("launch", "RESTORING", ()), ("restore_memory", "RESTORING", (5,)),
                  ("launch", "RESTORING", (True,))]
    chosen = w.event("checkpoint_chosen")
    assert chosen["source"] == "memory" and chosen["step"] == 5
    assert chosen["memory_step"] == 5 and chosen["storage_step"] == 2
    rec = w.event("recovered")
    assert rec["source"] == "memory" and rec["from_step"] == 5 and rec["lost_steps"] == 0
    assert "restoring step 5 from memory (storage's newest is step 2)" in w.display.logs


def test_rows_time_their_window_and_a_restore_reports_the_unlogged_steps_it_keeps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # log_every=2: rows at 2 and 4; step 5 gets no row before rank 1 dies; memory keeps it
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 2)
    w = _kill_at_5(storage, [4, 5], tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    rows = w.rows()
    assert [(r["step"], r["steps_in_window"]) for r in rows] == [(2, 2), (4, 2), (6, 1)]
    # the first window starts at the world's first step's start (0.1 s before its end)
    assert [r["window_s"] for r in rows] == pytest.approx([1.1, 2.0, 0.1])
    first, second = w.all("workers_started")
    assert first["kept_unlogged"] is None
    assert second["kept_unlogged"] == {"first_step": 5, "last_step": 5, "window_s": 1.0}
    # every second of step time is in a row or in kept_unlogged
    assert sum(r["window_s"] for r in rows) + 1.0 == pytest.approx(w.controller.throughput.train_time_s)


def test_unlogged_steps_a_restore_rolls_back_are_not_reported_as_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 4)
    w = _kill_at_5(storage, [2, 3], tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    assert w.event("recovered")["from_step"] == 4
    assert w.all("workers_started")[1]["kept_unlogged"] is None


def test_a_stop_reports_the_unlogged_steps_it_checkpointed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        Poll(statuses([1, 2]), hook=ctrl_c),
        statuses([3], commits=[3], done=True, stopped_early=True),
    ])])
    assert w.run() == Stopped(step=3)
    assert w.event("stopped")["kept_unlogged"] == {
        "first_step": 3, "last_step": 3, "window_s": 1.0}


def test_recovery_restores_storage_when_it_is_newer_than_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 4)
    w = _kill_at_5(storage, [2, 3], tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    assert w.named("restore_memory") == []
    chosen = w.event("checkpoint_chosen")
    assert chosen["source"] == "storage" and chosen["step"] == 4
    assert "newer than memory's step 3" in chosen["reason"]
    assert w.event("recovered")["source"] == "storage"
    assert [m for m in w.display.logs if m.startswith("restoring")] == [
        "restoring step 4 from storage"]


def test_recovery_with_nothing_in_memory_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 4)
    w = _kill_at_5(storage, [], tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    chosen = w.event("checkpoint_chosen")
    assert chosen["source"] == "storage" and chosen["memory_step"] is None
    assert chosen["reason"] == "nothing complete in memory: no snapshot is held in memory"


def test_a_memory_restore_that_fails_falls_back_to_storage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 4)
    w = _kill_at_5(storage, [5], raise_in={"restore_memory": group_error(
        FailureKind.START_ERROR, rank=0, message="worker rank 0: LookupError: gone")},
        tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    assert [c.name for c in w.named("restore_memory", "restore")] == ["restore_memory",
                                                                      "restore"]
    first, fallback = w.all("checkpoint_chosen")
    assert first["source"] == "memory"
    assert fallback["source"] == "storage" and fallback["step"] == 4
    assert "restoring from memory failed: worker rank 0: LookupError: gone" in fallback["reason"]
    assert w.event("recovered")["source"] == "storage"
    assert w.event("recovered")["lost_steps"] == 1
    assert [m for m in w.display.logs if m.startswith("restoring")] == [
        "restoring step 5 from memory (storage's newest is step 4)",
        "restoring step 5 from memory failed: worker rank 0: LookupError: gone",
        "restoring step 4 from storage"]


def test_memory_tier_off_never_asks_for_an_inventory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 4)
    w = _kill_at_5(storage, [5], ["checkpoint.snapshot_every=0"], tmp_path=tmp_path,
                   monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    assert w.named("memory_inventory", "restore_memory") == []
    assert w.event("recovered")["source"] == "storage"


def test_the_memory_tier_size_is_reported_once_per_world(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    polls = [[dataclasses.replace(st, snapshot_bytes=1000 * (st.rank + 1)) for st in
              statuses([1, 2])], [dataclasses.replace(st, snapshot_bytes=5000) for st in
                                  statuses([3, 4], done=True)]]
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=polls)], ["train.steps=4"])
    assert w.run() == Finished(step=4)
    # Not after the first two steps (a peer's copy may still be on its way): after the third.
    (tier,) = w.all("memory_tier")
    assert tier["bytes_per_worker"] == 5000 and tier["bytes_total"] == 10000
    assert tier["generation"] == 0 and tier["replicas"] == 1


# ----------------------------------------------------- damaged checkpoints: the next older one loads


def _damage(storage: Path, step: int) -> None:
    shard = storage / f"step_{step:09d}" / "__0_0.distcp"
    shard.write_bytes(b"\xff" + shard.read_bytes()[1:])


@pytest.mark.parametrize("tier", ["checkpoint.snapshot_every=1", "checkpoint.snapshot_every=0"])
def test_a_storage_checkpoint_that_fails_to_load_falls_back_to_the_next_older(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tier: str) -> None:
    from stalwart.checkpointing.errors import CheckpointError

    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 2)
    _commit_checkpoint(storage, 4)
    w = _kill_at_5(storage, [], [tier], raise_in={"restore": CheckpointError(
        "checkpoint 'x/step_000000004' failed to load: rank 0: UnpicklingError: bad")},
        tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    assert [c.args[0].rsplit("/", 1)[-1] for c in w.named("restore")] == [
        "step_000000004", "step_000000002"]
    skipped = w.event("checkpoint_skipped")
    assert skipped["step"] == 4 and "failed to load" in skipped["message"]
    assert w.event("recovered")["source"] == "storage"
    assert w.event("recovered")["from_step"] == 2
    assert [m for m in w.display.logs if m.startswith("restoring")] == [
        "restoring step 4 from storage", "restoring from storage's step 2 instead"]


@pytest.mark.parametrize("tier", ["checkpoint.snapshot_every=1", "checkpoint.snapshot_every=0"])
def test_a_recovery_that_finds_committed_checkpoints_but_none_valid_fails(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tier: str) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 2)
    _commit_checkpoint(storage, 4)
    _damage(storage, 2)
    _damage(storage, 4)
    w = _kill_at_5(storage, [], [tier], tmp_path=tmp_path, monkeypatch=monkeypatch)
    final = w.run()
    assert final.name == "FAILED"
    assert "checkpoints were committed (steps [2, 4]) but none can be restored" in final.reason
    assert "refusing to restart from step 0" in final.reason
    assert "step 4: " in final.reason and "step 2: " in final.reason
    assert "file __0_0.distcp is damaged" in final.reason
    assert [e["step"] for e in w.all("checkpoint_skipped")] == [4, 2]
    # the driver checks signature, listing and sizes; the ranks find the damage as they read
    assert [c.name for c in w.named("restore", "restore_memory")] == ["restore", "restore"]
    assert all(e["source"] != "none" for e in w.all("checkpoint_chosen"))


def test_the_last_loadable_checkpoint_failing_fails_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from stalwart.checkpointing.errors import CheckpointError

    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 4)
    w = _kill_at_5(storage, [], raise_in={"restore": CheckpointError("failed to load: x")},
                   tmp_path=tmp_path, monkeypatch=monkeypatch)
    final = w.run()
    assert final.name == "FAILED" and "step 4: failed to load: x" in final.reason


def test_a_recovery_with_nothing_ever_committed_starts_over(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _kill_at_5(tmp_path / "checkpoints", [], tmp_path=tmp_path, monkeypatch=monkeypatch)
    assert w.run() == Finished(step=6)
    assert w.event("checkpoint_chosen")["source"] == "none"
    assert ("starting from step 0: nothing complete in memory (no snapshot is held in memory) "
            "or in storage") in w.display.logs
