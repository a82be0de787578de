"""What Ray shows for stalwart's worker actors, read from a real Ray with its dashboard.

Ray reads an actor's repr once, when its __init__ returns: the dashboard's Name and Repr
columns (the state API's `name` and `repr_name`) keep what the actor was at creation,
`stalwart-worker-<n>-<driver pid>` and `stalwart-worker-<n>`. The prefix of its log lines on
the driver follows what it is now: `stalwart-worker-r<rank>-g<generation>` in a world,
`stalwart-worker-spare-<n>` when warm and idle. A run of 2 workers and a warm spare, rank 1
killed at step 3, shows both generations.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path

import pytest
import ray
from ray.util.state import list_actors, list_tasks

from stalwart.core.config import load_config, parse_fault
from stalwart.core.events import read_jsonl
from stalwart.trainer import Trainer
from tests.cli_helpers import REFERENCE_CONFIG, TINY

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture
def ray_with_dashboard(monkeypatch: pytest.MonkeyPatch):
    """A Ray of our own with its dashboard (the state API lives there); the driver prints
    every worker line (no deduplication: two ranks print the same words)."""
    from ray._private import ray_logging

    monkeypatch.setattr(ray_logging, "RAY_DEDUP_LOGS", False)
    ctx = ray.init(address="local", num_cpus=3, include_dashboard=True, dashboard_port=0,
                   logging_level="WARNING", _system_config={"worker_niceness": 0})
    try:
        yield f"http://{ctx.dashboard_url}"
    finally:
        ray.shutdown()


def test_names_in_the_dashboard_and_the_log_prefix(tmp_path: Path, ray_with_dashboard: str,
                                                   capfd: pytest.CaptureFixture[str]) -> None:
    config = load_config(REFERENCE_CONFIG, [
        *TINY, "task.path=tests.ray.loud_task:LoudGPTTask", "train.steps=5",
        "scaling.spare_workers=1", "failure.max_failures=1", "data.val_every=0",
        "run.progress=false"])
    config = dataclasses.replace(config, faults=(parse_fault("kill:rank=1,step=3"),))
    result = Trainer(config, run_dir=tmp_path / "run", workdir=ROOT).fit()
    assert result.state == "FINISHED", result

    # Who was which rank in each generation, by pid (from the run's own event log).
    worlds = {e["generation"]: [w["pid"] for w in e["workers"]]
              for e in read_jsonl(tmp_path / "run" / "events.jsonl")
              if e["kind"] == "workers_started"}
    assert sorted(worlds) == [0, 1]
    assert worlds[1][0] == worlds[0][0], "the survivor stays rank 0"

    # The dashboard: every worker actor by its creation-time name and repr. (The actor that
    # replaced the spare after the kill may have been stopped with the run before its
    # __init__ returned: it has no repr then.)
    actors = list_actors(address=ray_with_dashboard, detail=True,
                         filters=[("class_name", "=", "TrainWorker")])
    numbers = sorted(int(a.name.split("-")[2]) for a in actors)
    assert numbers == list(range(1, len(actors) + 1)) and len(actors) >= 3
    number_of = {a.pid: int(a.name.split("-")[2]) for a in actors}
    trained = {*worlds[0], *worlds[1]}
    assert set(number_of) >= trained
    for a in actors:
        n = a.name.split("-")[2]
        assert a.name == f"stalwart-worker-{n}-{os.getpid()}"
        assert a.repr_name == f"stalwart-worker-{n}" or (a.pid not in trained
                                                          and a.repr_name == ""), a

    # The dashboard's task list: each world's setup and training calls carry rank and
    # generation, on the actor (pid) that had that rank.
    actor_of = {a.pid: a.actor_id for a in actors}
    wanted = {(f"stalwart-worker-r{rank}-g{gen}.{call}", actor_of[pid])
              for gen, pids in worlds.items() for rank, pid in enumerate(pids)
              for call in ("setup", "train")}
    deadline = time.monotonic() + 20  # task events reach the dashboard asynchronously
    while True:
        tasks = {(t.name, t.actor_id) for t in list_tasks(
            address=ray_with_dashboard, detail=True, limit=10_000,
            filters=[("type", "=", "ACTOR_TASK")])}
        if wanted <= tasks or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert wanted <= tasks, sorted(wanted - tasks)

    # The driver's console: each line under the name the worker had when it printed it.
    expected = {f"(stalwart-worker-{number_of[pid]} pid={pid}) building the model"
                for pid in trained}  # warming up, before any world
    expected |= {f"(stalwart-worker-r{rank}-g{gen} pid={pid}) building the model"
                 for gen, pids in worlds.items() for rank, pid in enumerate(pids)}
    seen: set[str] = set()
    deadline = time.monotonic() + 20  # worker lines reach the driver asynchronously
    while not expected <= seen and time.monotonic() < deadline:
        out, err = capfd.readouterr()
        seen |= {ANSI.sub("", line).strip() for line in (out + err).splitlines()}
        time.sleep(0.5)
    assert expected <= seen, sorted(expected - seen)

    # Behind the prefix: the markers each worker wrote, in order, in its own log file.
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    survivor, spare = worlds[0][0], worlds[1][1]

    def names(pid: int) -> list[str]:
        """The names a worker announced (Ray itself first writes the class name, as the
        actor's creation starts, and then the repr, when __init__ returns)."""
        (out,) = logs.glob(f"worker-*-{pid}.out")
        found = re.findall(r"^:actor_name:(.*)$", out.read_text(), flags=re.M)
        assert found[0] == "TrainWorker", found
        return found[1:]

    n = number_of[survivor]
    assert names(survivor) == [f"stalwart-worker-{n}", f"stalwart-worker-spare-{n}",
                               "stalwart-worker-r0-g0", f"stalwart-worker-spare-{n}",
                               "stalwart-worker-r0-g1"]
    n = number_of[spare]
    assert names(spare) == [f"stalwart-worker-{n}", f"stalwart-worker-spare-{n}",
                            "stalwart-worker-r1-g1"]
