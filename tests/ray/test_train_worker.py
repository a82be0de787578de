"""TrainWorker, driven directly as one Ray actor (no group, no controller): it warms up, joins
a world of one, trains on its own thread while it answers polls, stops on request, leaves its
world with its process and memory tier intact, joins the next one, and reports an exception
in the task's code as a user error."""

from __future__ import annotations

import os
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray

from stalwart.checkpointing.storage.catalog import newest_valid
from stalwart.core.config import JobConfig, load_config
from stalwart.core.events import WorkerPlace
from stalwart.core.task import build_task
from stalwart.workers.actor import TrainWorker
from stalwart.workers.reports import CommitReport, StepReport, WorkerStatus
from tests.cli_helpers import REFERENCE_CONFIG, TINY
from tests.keys import trust

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
# Workers import the test tasks (tests.ray.*) by path, as the Trainer lets them find the user's.
# Generous: two cores are shared by every test process of the machine.
DEADLINE_S = 120.0
RUN = [*TINY, "train.steps=100000", "checkpoint.persist_every=2", "checkpoint.keep_last=0",
       "data.val_every=0"]


# ------------------------------------------------------------------ the actor's interface
# Every direct use of an RPC whose shape may change (typed replies, the fault injector) is
# here, so that a change of interface is adapted in one place.

def pid_of(description: WorkerPlace) -> int:
    return description.pid


def rank_of(description: WorkerPlace) -> int:
    return description.rank


def node_of(description: WorkerPlace) -> str:
    return description.node_id


def join_alone(actor: Any, generation: int, node: str) -> None:
    """Set the actor up as the only rank of a world, with no faults armed."""
    rdzv = ray.get(actor.rendezvous_address.remote(), timeout=DEADLINE_S)
    ray.get(actor.setup.remote(0, 1, rdzv, generation, [], [node], signing=trust()),
            timeout=DEADLINE_S)


def leave(actor: Any) -> tuple[bool, int, list[CommitReport]]:
    """(whether it left its world, its last step, commits no poll reported)."""
    reply = ray.get(actor.leave.remote(10.0), timeout=DEADLINE_S)
    return reply.left, reply.step, list(reply.commits)


# ------------------------------------------------------------------ helpers

def config_of(*overrides: str) -> JobConfig:
    config = load_config(REFERENCE_CONFIG, [*RUN, *overrides])
    # Tokenize once here, before the worker looks for the cache (a no-op when it exists).
    build_task(config.task.path, config.task.args).prepare_data(config)
    return config


@pytest.fixture
def make_actor(local_ray, tmp_path: Path):
    """Start TrainWorker actors as ElasticGroup does; each is killed when the test ends."""
    actors = []

    def make(config: JobConfig) -> tuple[Any, str]:
        storage = tmp_path / "checkpoints"
        storage.mkdir(exist_ok=True)
        actor = ray.remote(TrainWorker).options(
            num_cpus=1, max_restarts=0,
        ).remote(config.to_dict(), str(storage), len(actors) + 1, import_paths=[str(ROOT)])
        actors.append(actor)
        return actor, str(storage)

    yield make
    for actor in actors:
        ray.kill(actor, no_restart=True)


def poll_until(actor: Any, enough: Callable[[list[WorkerStatus]], bool]) -> list[WorkerStatus]:
    """Every status polled until `enough` holds for them (a poll drains what it reports)."""
    seen: list[WorkerStatus] = []
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        seen.append(ray.get(actor.poll.remote(), timeout=DEADLINE_S))
        if enough(seen):
            return seen
        time.sleep(0.1)
    raise AssertionError(f"not reached within {DEADLINE_S:.0f}s; last status: {seen[-1]}")


def steps_in(seen: list[WorkerStatus]) -> list[StepReport]:
    return [s for status in seen for s in status.steps]


def process_gone(pid: int) -> bool:
    """No such process, or only its zombie (its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not process_gone(pid):
        assert time.monotonic() < deadline, f"worker process {pid} is still alive"
        time.sleep(0.1)


# ------------------------------------------------------------------ the tests

def test_a_worker_trains_stops_leaves_and_joins_again(make_actor) -> None:
    actor, storage = make_actor(config_of())

    # Warm: the task is loaded, the worker has no rank yet, and says where it runs.
    desc = ray.get(actor.warm_up.remote(), timeout=DEADLINE_S)
    pid, node = pid_of(desc), node_of(desc)
    assert rank_of(desc) == -1 and pid != os.getpid()
    assert node == ray.get_runtime_context().get_node_id()
    assert pid_of(ray.get(actor.describe.remote(), timeout=DEADLINE_S)) == pid

    # A world of one: nothing happens until start.
    join_alone(actor, generation=0, node=node)
    assert rank_of(ray.get(actor.describe.remote(), timeout=DEADLINE_S)) == 0
    (idle,) = poll_until(actor, lambda seen: True)
    assert (idle.rank, idle.generation, idle.steps, idle.done, idle.error) == (0, 0, [], False,
                                                                                None)

    # Training runs on the actor's thread; polls drain the steps as they come.
    ray.get(actor.start.remote(), timeout=DEADLINE_S)
    seen = poll_until(actor, lambda seen: len(steps_in(seen)) >= 3)
    assert all(isinstance(s, StepReport) and s.rank == 0 for s in steps_in(seen))
    assert all(status.generation == 0 and status.error is None for status in seen)

    # Stop after the step in flight: it is checkpointed, and the thread ends normally.
    ray.get(actor.request_stop.remote(), timeout=DEADLINE_S)
    seen += poll_until(actor, lambda more: more[-1].done)
    steps = [s.step for s in steps_in(seen)]
    last = steps[-1]
    assert steps == list(range(1, last + 1)), "every step reported once, in order"
    assert seen[-1].stopped_early and seen[-1].error is None
    commits = [c for status in seen for c in status.commits]
    assert all(isinstance(c, CommitReport) for c in commits)

    # Leaving keeps the process; late commits come with the reply; the rank is gone.
    left, step, late = leave(actor)
    assert left and step == last
    commits += late
    assert commits and commits[-1].step == last, "the stop step is on storage"
    assert {c.step for c in commits} >= set(range(2, last + 1, 2))
    desc = ray.get(actor.describe.remote(), timeout=DEADLINE_S)
    assert (rank_of(desc), pid_of(desc)) == (-1, pid)

    # Its memory tier outlives the world: it holds its own snapshot of the last step.
    inventory = ray.get(actor.memory_inventory.remote(), timeout=DEADLINE_S)
    held = {(h.generation, h.source, h.step) for h in inventory.holdings}
    assert (0, 0, last) in held and inventory.nbytes > 0
    buffer, values, crc = ray.get(actor.export_snapshot.remote(0, 0, last),
                                  timeout=DEADLINE_S)
    assert buffer.nbytes > 0 and values["train.step"] == last
    assert crc == zlib.crc32(buffer)  # its owner's CRC32 comes with it

    # The same process joins the next world and restores the stop step from storage.
    join_alone(actor, generation=1, node=node)
    checkpoint = newest_valid(storage, trust())
    assert checkpoint is not None and checkpoint.step == last
    assert ray.get(actor.restore.remote(checkpoint.path, checkpoint.manifest["files"]), timeout=DEADLINE_S) == last
    ray.get(actor.start.remote(restored=True), timeout=DEADLINE_S)
    seen = poll_until(actor, lambda seen: len(steps_in(seen)) >= 1)
    assert steps_in(seen)[0].step == last + 1 and seen[-1].generation == 1
    ray.get(actor.request_stop.remote(), timeout=DEADLINE_S)
    poll_until(actor, lambda more: more[-1].done)

    # Shutdown leaves the world cleanly; then the process can go.
    ray.get(actor.shutdown.remote(), timeout=DEADLINE_S)
    ray.kill(actor, no_restart=True)
    wait_gone(pid)


def test_an_exception_in_the_task_is_a_user_error(make_actor) -> None:
    actor, _ = make_actor(config_of("task.path=tests.ray.exploding_task:ExplodingGPTTask",
                                    "task.args.explode_at=3"))
    desc = ray.get(actor.warm_up.remote(), timeout=DEADLINE_S)
    join_alone(actor, generation=0, node=node_of(desc))
    ray.get(actor.start.remote(), timeout=DEADLINE_S)

    seen = poll_until(actor, lambda seen: seen[-1].error is not None)
    status = seen[-1]
    assert status.error_kind == "user" and not status.done
    assert "ValueError: user bug at step 3" in status.error
    assert "exploding_task.py" in status.error, "the task's own frame is in the traceback"
    assert [s.step for s in steps_in(seen)] == [1, 2]

    # The thread has ended: the worker leaves its world and stays usable.
    left, step, _ = leave(actor)
    assert left and step == 2
    assert rank_of(ray.get(actor.describe.remote(), timeout=DEADLINE_S)) == -1
