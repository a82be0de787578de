"""ElasticGroup on a real local Ray, driven directly as the controller drives it: warm actors,
a world of two, polls of typed reports, a stop; a rank SIGKILLed, found dead by a poll,
removed; the survivor back in the idle pool, the next world formed from it and the warm
spare, restored from storage and from the memory tier; no actor left after shutdown."""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import ray

from stalwart.checkpointing.memory.catalog import MemoryChoice, newest_complete
from stalwart.checkpointing.storage.catalog import newest_valid
from stalwart.core.config import load_config
from stalwart.core.task import build_task
from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.orchestrator.worker_group import ElasticGroup, Worker
from stalwart.workers.reports import CommitReport, StepReport, WorkerStatus
from tests.cli_helpers import REFERENCE_CONFIG, TINY
from tests.keys import trust

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
# What the Trainer gives the workers (tests.* importable, one compute thread each).
# Generous: two cores are shared by every test process of the machine.
DEADLINE_S = 150.0
# A world of 2 and a warm spare; it trains until stopped, a checkpoint every 3 steps.
RUN = [*TINY, "scaling.num_workers=2", "scaling.spare_workers=1", "train.steps=100000",
       "checkpoint.persist_every=3", "checkpoint.keep_last=0", "data.val_every=0"]


# ------------------------------------------------------------------ the group's interface
# Every direct use of an interface whose shape may change (form's fault arming, the workers'
# descriptions, typed replies) is here, so that a change is adapted in one place.

def form(group: ElasticGroup, world_size: int, generation: int) -> list[int]:
    """Pick and form a world with no faults armed; returns its pids in rank order."""
    workers = group.pick(world_size, generation)
    assert [w.rank for w in workers] == list(range(world_size))
    group.form({})
    assert group.places() == workers
    return [w.pid for w in workers]


def holds_key(group: ElasticGroup) -> list[bool]:
    """Per rank, whether the worker holds the checkpoint key (read inside its actor)."""
    return ray.get([w.actor.__ray_call__.remote(lambda actor: actor.worker.trust is not None)
                    for w in group.members], timeout=60)


def pid_of(worker: Worker) -> int:
    assert worker.place is not None, "not warm yet"
    return worker.place.pid


def restore_from_memory(group: ElasticGroup, choice: MemoryChoice
                        ) -> tuple[int, list[list[int]]]:
    """(the restored step, per rank the source ranks it fetched from peers)."""
    return group.restore_memory(choice)


# ------------------------------------------------------------------ helpers

@pytest.fixture
def group(local_ray, tmp_path: Path):
    """A fresh group on the reference task; its actors are killed when the test ends."""
    config = load_config(REFERENCE_CONFIG, RUN)
    # Tokenize once here, before the workers race for the cache (a no-op when it exists).
    build_task(config.task.path, config.task.args).prepare_data(config)
    storage = tmp_path / "checkpoints"
    storage.mkdir()
    g = ElasticGroup(config, str(storage), import_paths=[str(ROOT)], trust=trust())
    yield g
    g.shutdown(graceful=False)


@dataclass
class Seen:
    """Everything polled from a world so far (a poll drains what it reports)."""

    steps: dict[int, list[StepReport]] = field(default_factory=lambda: defaultdict(list))
    commits: list[CommitReport] = field(default_factory=list)
    last: dict[int, WorkerStatus] = field(default_factory=dict)
    """Each rank's latest status."""
    dead: list[WorkerFailure] = field(default_factory=list)

    def latest(self, rank: int) -> int:
        return self.steps[rank][-1].step if self.steps[rank] else 0


def poll_until(group: ElasticGroup, enough: Callable[[Seen], bool],
               seen: Seen | None = None) -> Seen:
    seen = seen or Seen()
    deadline = time.monotonic() + DEADLINE_S
    while not enough(seen):
        assert time.monotonic() < deadline, f"not reached within {DEADLINE_S:.0f}s: {seen}"
        view = group.poll(wait_s=0.5)
        for rank, status in view.answered.items():
            assert isinstance(status, WorkerStatus) and status.rank == rank
            assert status.generation == group.generation
            assert all(isinstance(s, StepReport) and s.rank == rank for s in status.steps)
            seen.steps[rank] += status.steps
            seen.commits += status.commits
            seen.last[rank] = status
        seen.dead += view.dead
    return seen


def warm(group: ElasticGroup, count: int) -> None:
    """top_up and refresh until `count` actors are warm and idle."""
    group.top_up()
    deadline = time.monotonic() + DEADLINE_S
    while len(group.idle) < count:
        assert time.monotonic() < deadline, f"{len(group.idle)} of {count} actors warm"
        group.refresh(timeout=1.0)


def process_gone(pid: int) -> bool:
    """No such process, or only its zombie (its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def named_actors() -> set[str]:
    """The names of the actors Ray holds alive (or still starting)."""
    return {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}


def assert_all_gone(names: set[str], pids: set[int]) -> None:
    """Ray knows none of these actors by name any more, and their processes have ended."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        alive = names & named_actors()
        running = {pid for pid in pids if not process_gone(pid)}
        if not alive and not running:
            return
        assert time.monotonic() < deadline, f"still alive: actors {alive}, processes {running}"
        time.sleep(0.2)


# ------------------------------------------------------------------ the tests

def test_a_world_forms_trains_stops_and_shuts_down(group: ElasticGroup) -> None:
    warm(group, 3)  # the largest world (2) and the spare
    assert group.starting == [] and group.members == []
    assert group.pool_view().best_world == 2
    idle = [pid_of(w) for w in group.idle]
    assert len(set(idle)) == 3 and os.getpid() not in idle
    names = {w.key for w in group.idle}

    # Generation 0: the first two idle actors, in order; the spare stays idle.
    assert form(group, 2, 0) == idle[:2]
    assert group.generation == 0 and [pid_of(w) for w in group.idle] == idle[2:]

    group.launch(restored=False)
    seen = poll_until(group, lambda seen: min(seen.latest(0), seen.latest(1)) >= 3)
    for rank in (0, 1):
        steps = [s.step for s in seen.steps[rank]]
        assert steps == list(range(1, len(steps) + 1))
    # Both ranks report the same global loss for the same step.
    assert seen.steps[0][0].loss == seen.steps[1][0].loss

    # Stop after the step in flight: every rank ends at the same step, which is checkpointed.
    group.request_stop()
    seen = poll_until(group, lambda seen: all(seen.last.get(r) and seen.last[r].done
                                              for r in (0, 1)), seen)
    assert seen.dead == []
    assert all(seen.last[r].stopped_early and seen.last[r].error is None for r in (0, 1))
    assert seen.latest(0) == seen.latest(1)
    # Rank 0 reports the commits (its save is the manifest); the stop step is the last one.
    assert seen.commits[-1].step == seen.latest(0)
    assert {c.step for c in seen.commits} >= set(range(3, seen.latest(0) + 1, 3))

    # A graceful shutdown, then no actor is left: not in Ray, not as a process.
    assert names <= named_actors()
    group.shutdown(graceful=True)
    assert group.members == group.idle == group.starting == []
    assert_all_gone(names, set(idle))


def test_a_killed_rank_is_replaced_and_the_next_world_restores(group: ElasticGroup) -> None:
    warm(group, 3)
    survivor, victim = form(group, 2, 0)
    victim_key = group.members[1].key
    spare = pid_of(group.idle[0])
    pids, names = {survivor, victim, spare}, {w.key for w in group.members + group.idle}
    group.launch(restored=False)
    # Train until the first world has written a storage checkpoint.
    seen = poll_until(group, lambda seen: bool(seen.commits) and seen.latest(0) >= 4)

    # A real SIGKILL of rank 1's process: the next polls find it dead, by rank.
    os.kill(victim, signal.SIGKILL)
    seen = poll_until(group, lambda seen: bool(seen.dead), seen)
    (failure,) = seen.dead
    assert failure.kind == FailureKind.WORKER_DIED
    assert failure.rank == 1 and failure.ranks == (1,) and "rank 1" in failure.message

    # Removed; the survivor leaves its world and goes back to the idle pool, first.
    group.remove((1,))
    assert [pid_of(w) for w in group.members] == [survivor]
    ended = group.disband(after_step=seen.latest(0))
    assert ended.silent == []
    (left_at,) = ended.survivor_steps
    assert left_at >= seen.latest(0), "the survivor's step is at least what it reported"
    # Rank 0 survived: the steps it completed after the last one polled, none twice.
    assert [r.step for r in ended.steps] == list(range(seen.latest(0) + 1, left_at + 1))
    seen.commits += ended.commits
    assert group.members == [] and [pid_of(w) for w in group.idle] == [survivor, spare]

    # A replacement for the dead actor is asked for; the next world does not wait for it.
    group.top_up()
    assert len(group.starting) == 1
    names |= {w.key for w in group.starting}

    # Generation 1: the survivor stays rank 0, the warm spare is rank 1.
    assert form(group, 2, 1) == [survivor, spare]
    assert group.generation == 1
    # Only rank 0, which signs the commits, holds the checkpoint key.
    assert holds_key(group) == [True, False]

    # Storage: the newest checkpoint the first world wrote loads at its own step.
    checkpoint = newest_valid(group.storage_url, trust())
    assert checkpoint is not None and checkpoint.step in {c.step for c in seen.commits}
    assert group.restore(checkpoint) == checkpoint.step

    # Memory: the survivor holds the first world's newest step; the spare holds nothing.
    inventories = group.memory_inventory()
    assert set(inventories) == {w.key for w in group.members}
    survivor_key, spare_key = (w.key for w in group.members)
    assert inventories[spare_key].holdings == ()
    choice, why_not = newest_complete(inventories)
    assert choice is not None, why_not
    assert choice.generation == 0 and checkpoint.step <= choice.step <= left_at
    assert all(keys == [survivor_key] for keys in choice.holders.values())
    step, fetched = restore_from_memory(group, choice)
    assert step == choice.step
    # Rank 0 holds what it restores; rank 1 fetched every source shard from its peer.
    assert fetched == [[], sorted(choice.holders)]

    # The new world stages the restored step and trains on from it.
    group.launch(restored=True)
    seen = poll_until(group, lambda seen: min(seen.latest(0), seen.latest(1)) > choice.step)
    assert seen.dead == []
    assert seen.steps[0][0].step == seen.steps[1][0].step == choice.step + 1
    # Past its first step, the members hold this world's snapshots only.
    group.settle()
    held = {h.generation for inv in group.memory_inventory().values() for h in inv.holdings}
    assert held == {1}, held

    # A stopped process (SIGSTOP) is reported by its node's agent as a hang of its own,
    # without waiting for the hang detector's limit (the agent answered in the first world).
    os.kill(spare, signal.SIGSTOP)
    try:
        seen = poll_until(group, lambda seen: bool(seen.dead), seen)
    finally:
        os.kill(spare, signal.SIGCONT)
    (stopped,) = seen.dead
    assert stopped.kind == FailureKind.HANG and stopped.ranks == (1,)
    assert "stopped" in stopped.message and stopped.pids == (spare,)

    # Shutdown kills every actor: members, and the replacement still starting.
    assert names - named_actors() == {victim_key}, "only the removed rank is gone so far"
    group.shutdown(graceful=False)
    assert_all_gone(names, pids)
