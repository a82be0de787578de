"""ScalingPolicy and the resize plan on their own: the size to wait for, form / wait / give
up, and the planned resizes of a running world (drain, grow, preemption), as plain
decisions. No group, fake or real: they are given views built here as plain dataclasses."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.core.config import load_config
from stalwart.core.events import WorkerPlace, read_jsonl
from stalwart.core.run_logs import EventLog
from stalwart.orchestrator.group import PoolView
from stalwart.orchestrator.resize_plan import ResizePlan
from stalwart.orchestrator.scaling import (
    FormDecision,
    GiveUpDecision,
    NeedRoomDecision,
    NoopDecision,
    ResizeDecision,
    ScalingPolicy,
    WaitDecision,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def pool(best: int, placed: int = 0, available: int | None = None) -> PoolView:
    """What the pool holds between worlds, as the group's view says it."""
    return PoolView(best_world=best, placed_starting=placed,
                    available=best if available is None else available)


def policy(*overrides: str) -> ScalingPolicy:
    config = load_config(None, ["scaling.num_workers=4", "train.micro_batch_size=1",
                                "train.global_batch_size=840", *overrides])
    return ScalingPolicy(config.scaling, storage_url="/ckpt")


def test_waits_for_the_size_it_had_never_below_the_floor() -> None:
    p = policy("scaling.min_workers=2", "scaling.max_workers=8")
    assert p.target(0) == 4  # the first world: num_workers
    assert p.target(6) == 6  # back to the size the run had
    assert p.target(1) == 2  # never below min_workers


def test_forms_at_once_when_the_target_is_warm() -> None:
    assert policy().schedule(pool(best=4), generation=0, world_size=0, waited=0.0) == \
        FormDecision(world_size=4)


def test_the_first_world_waits_for_placed_workers_a_recovery_does_not() -> None:
    p = policy("scaling.min_workers=2", "scaling.start_timeout_s=10")
    # the first world: two more are placed and warming up, so it waits for them
    assert p.schedule(pool(best=2, placed=2), generation=0, world_size=0,
                      waited=5.0) == WaitDecision()
    # nothing placed is coming: form what there is
    assert p.schedule(pool(best=2, placed=0), generation=0, world_size=0,
                      waited=0.0) == FormDecision(world_size=2)
    # placed ones that take longer than start_timeout_s are not waited for
    assert p.schedule(pool(best=2, placed=2), generation=0, world_size=0,
                      waited=10.5) == FormDecision(world_size=2)
    # after a failure the warm survivors train on at once, smaller (it grows back later)
    assert p.schedule(pool(best=2, placed=2), generation=1, world_size=4,
                      waited=0.0) == FormDecision(world_size=2)
    # below the floor, a recovery waits like the first world
    assert p.schedule(pool(best=1, placed=2), generation=1, world_size=4,
                      waited=0.0) == WaitDecision()


@pytest.mark.parametrize(("generation", "key", "limit"), [
    (0, "start_timeout_s", 2.0), (3, "wait_for_workers_s", 5.0)])
def test_gives_up_below_the_floor_after_its_limit(generation: int, key: str,
                                                  limit: float) -> None:
    p = policy("scaling.min_workers=3", "scaling.start_timeout_s=2",
               "scaling.wait_for_workers_s=5")
    two = pool(best=2, available=2)
    assert p.schedule(two, generation=generation, world_size=4, waited=limit) == \
        WaitDecision()
    assert p.schedule(two, generation=generation, world_size=4, waited=limit + 0.5) == \
        GiveUpDecision(reason=f"only 2 workers could be started, scaling.min_workers=3 are "
                              f"needed; waited {limit + 0.5:.1f}s (scaling.{key}={limit:g}); "
                              f"checkpoints are intact under /ckpt")


def test_give_up_names_num_workers_when_there_is_no_min_workers() -> None:
    decision = policy().schedule(pool(best=0, available=1), generation=0, world_size=0,
                                 waited=1000.0)
    assert isinstance(decision, GiveUpDecision)
    assert "scaling.num_workers=4 (no scaling.min_workers set) are needed" in decision.reason


def test_resize_reason() -> None:
    grow = ResizeDecision(reason="grow")
    assert ScalingPolicy.resize_reason(0, 4, None) is None  # the first world
    assert ScalingPolicy.resize_reason(4, 4, None) is None
    assert ScalingPolicy.resize_reason(4, 2, None) == "shrink"
    assert ScalingPolicy.resize_reason(2, 4, None) == "grow"
    # a planned resize names its reason, also when the world comes back the same size
    assert ScalingPolicy.resize_reason(4, 4, ResizeDecision(reason="drain")) == "drain"
    assert ScalingPolicy.resize_reason(2, 4, grow) == "grow"


WORKERS = [WorkerPlace(rank=r, pid=100 + r, node_ip=f"10.0.0.{r}", node_id=node)
           for r, node in enumerate("abbc")]


def test_checks_only_every_resize_check_s_or_after_a_commit() -> None:
    p = policy("scaling.max_workers=8", "scaling.resize_check_s=10")
    none: frozenset[str] = frozenset()
    p.world_started(100.0)
    assert not p.resize_due(105.0)  # too early: neither the cluster nor its drains are asked
    assert p.make_decision(105.0, world_size=4, workers=WORKERS, draining=none) == \
        NoopDecision()
    assert p.resize_due(110.0)
    # below the ceiling: ask the cluster for room; the pool it makes decides
    assert p.make_decision(110.0, world_size=4, workers=WORKERS, draining=none) == \
        NeedRoomDecision(world_size=4)
    assert p.grow(pool(best=4), world_size=4) == NoopDecision()
    assert not p.resize_due(111.0)
    assert p.make_decision(111.0, world_size=4, workers=WORKERS, draining=none) == \
        NoopDecision()
    p.checkpoint_committed()  # a checkpoint boundary: look now
    assert p.resize_due(112.0)
    assert p.make_decision(112.0, world_size=4, workers=WORKERS, draining=none) == \
        NeedRoomDecision(world_size=4)
    assert p.grow(pool(best=6), world_size=4) == ResizeDecision(reason="grow")


def test_no_growing_at_the_ceiling() -> None:
    p = policy()  # max_workers unset: num_workers is the ceiling: no room is asked for
    assert p.make_decision(0.0, world_size=4, workers=WORKERS,
                           draining=frozenset()) == NoopDecision()


def test_ranks_on_a_draining_node_leave_before_any_growing() -> None:
    p = policy("scaling.max_workers=8")
    decision = p.make_decision(0.0, world_size=4, workers=WORKERS, draining=frozenset({"b"}))
    assert decision == ResizeDecision(reason="drain", leaving=(1, 2))
    assert decision.message == ("planned resize (drain, rank(s) [1, 2] leaving): "
                                "checkpointing the next step")
    assert ResizeDecision(reason="grow").message == \
        "planned resize (grow, room for more workers): checkpointing the next step"


def test_every_preempted_rank_leaves() -> None:
    first = ScalingPolicy.preempted(None, 2)
    assert first == ResizeDecision(reason="preempted", leaving=(2,))
    assert ScalingPolicy.preempted(first, 2) is first
    assert ScalingPolicy.preempted(first, 0) == ResizeDecision(reason="preempted",
                                                               leaving=(2, 0))
    # preempted during a planned drain: the drain's ranks leave too, as a preemption
    drain = ResizeDecision(reason="drain", leaving=(1,))
    assert ScalingPolicy.preempted(drain, 3) == ResizeDecision(reason="preempted",
                                                               leaving=(1, 3))


# ---------------------------------------------------------------------------- the resize plan


class _Display:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, message: str) -> None:
        self.lines.append(message)


def plan(tmp_path: Path, *overrides: str) -> ResizePlan:
    return ResizePlan(policy(*overrides), EventLog(tmp_path / "events.jsonl"), _Display())


def test_the_resize_plan_asks_for_room_and_grows_on_the_pool_it_is_given(
        tmp_path: Path) -> None:
    """ResizePlan returns what the controller must do (look for room, stop the ranks); it is
    given views and never touches a group."""
    p = plan(tmp_path, "scaling.max_workers=8", "scaling.resize_check_s=10")
    p.scaling.world_started(0.0)
    assert not p.due(5.0)
    assert p.due(10.0)
    assert p.consider(10.0, world_size=4, workers=WORKERS, draining=frozenset()) == \
        NeedRoomDecision(world_size=4)
    assert p.room(pool(best=4), world_size=4) == NoopDecision() and p.decision is None
    p.scaling.checkpoint_committed()
    p.consider(11.0, world_size=4, workers=WORKERS, draining=frozenset())
    grow = p.room(pool(best=6), world_size=4)
    assert grow == ResizeDecision(reason="grow") and p.decision == grow
    assert p.display.lines == [grow.message]
    assert not p.due(100.0)  # planned: nothing more is asked until the world stops


def test_a_drain_starts_at_once_and_a_preemption_joins_a_plan_under_way(
        tmp_path: Path) -> None:
    p = plan(tmp_path)
    drain = p.consider(0.0, world_size=4, workers=WORKERS, draining=frozenset({"c"}))
    assert drain == ResizeDecision(reason="drain", leaving=(3,)) and p.decision == drain
    # a preemption during it: no new plan starts (the ranks were asked to stop already)
    assert p.preempted(1) is None
    assert p.decision == ResizeDecision(reason="preempted", leaving=(3, 1))
    p.cancel()  # a failure replaces the plan
    assert p.preempted(2) == ResizeDecision(reason="preempted", leaving=(2,))  # starts now


def test_a_new_world_logs_the_resize_with_its_reason(tmp_path: Path) -> None:
    p = plan(tmp_path)
    p.preempted(1)
    p.formed(old_world=4, old_layout={"dp_shard": 4}, new_world=3,
             new_layout={"dp_shard": 3}, step=8, generation=2)
    (resized,) = read_jsonl(tmp_path / "events.jsonl")
    assert (resized["reason"], resized["old_world_size"], resized["new_world_size"],
            resized["step"]) == ("preempted", 4, 3, 8)
    assert p.decision is None and p.display.lines[-1] == "world resized 4 -> 3 (preempted)"
