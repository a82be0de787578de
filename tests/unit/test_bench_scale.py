"""bench/scale.py's simulated group (tests/fake_group.py) driven by the real controller at a
small size, so that the bench cannot rot unnoticed: a run of a few polls with one failure
finishes, its events record the failure and the recovery, and the bench's measurements come
out. No timing is asserted."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import scale
from stalwart.core.events import read_jsonl
from stalwart.orchestrator.states import Finished

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_64_ranks_on_8_nodes_train_lose_a_rank_recover_and_finish(tmp_path: Path) -> None:
    controller, group, marks = scale.build(64, tmp_path, steps=12, fail_at={6: 13})
    state = controller.run()
    assert isinstance(state, Finished) and state.step == 12
    events = read_jsonl(tmp_path / "events.jsonl")
    (failure,) = [e for e in events if e["kind"] == "failure"]
    assert failure["ranks"] == [13] and failure["failure_kind"] == "worker_died"
    assert failure["nodes"] == ["10.0.0.1"]  # rank 13 sits on node 1 (8 ranks a node)
    (recovered,) = [e for e in events if e["kind"] == "recovered"]
    assert recovered["source"] == "memory" and recovered["from_step"] == 5
    assert recovered["world_size"] == 64  # a warm spare took the dead rank's place
    started = [e for e in events if e["kind"] == "workers_started"]
    assert [len(e["workers"]) for e in started] == [64, 64]
    assert len(group.stats.failures_reported) == len(marks.recovering) == 1
    assert len(marks.launched) == 2 and group.stats.generations == 2
    assert group.own_cpu_s > 0


def test_the_bench_measures_every_figure_at_a_small_size() -> None:
    row = {**scale.steady(64, polls=6), **scale.recoveries(64, failures=2)}
    assert row["polls"] >= 6 and row["failures"] == 2 and row["generations"] == 3
    for key in ("cpu_per_train_s", "decision_wall_ms", "decision_cpu_ms", "plan_wall_ms",
                "plan_cpu_ms"):
        assert row[key] >= 0, key
