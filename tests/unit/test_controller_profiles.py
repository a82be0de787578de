"""The controller writes the profiler traces that ranks hand back in their polls into the run
dir (beside events.jsonl) and logs each as `profile_saved`; driven by the fake worker group of
tests/unit/controller_world.py."""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path

import pytest

from stalwart.orchestrator.states import Finished
from stalwart.workers.reports import ProfileReport, WorkerStatus
from tests.fake_group import Plan
from tests.unit.controller_world import FakeWorld, statuses

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def with_trace(st: WorkerStatus, steps: tuple[int, int]) -> WorkerStatus:
    trace = f'{{"traceEvents": [], "rank": {st.rank}}}'.encode()
    return dataclasses.replace(st, profiles=[ProfileReport(
        rank=st.rank, generation=0, steps=steps, trace_zlib=zlib.compress(trace),
        export_s=0.25)])


def test_each_ranks_trace_lands_in_the_run_dir(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[
        statuses([1, 2]),
        [with_trace(st, (3, 4)) if st.rank == 1 else st for st in statuses([3, 4])],
        # rank 0's trace comes with the poll that says it is done: it is not lost
        [with_trace(st, (3, 4)) if st.rank == 0 else st for st in statuses([5, 6], done=True)],
    ])], ["run.profile_steps=[3, 4]"])
    assert w.run() == Finished(step=6)

    saved = w.all("profile_saved")
    assert [(e["rank"], e["steps"], e["generation"], e["export_s"]) for e in saved] == [
        (1, [3, 4], 0, 0.25), (0, [3, 4], 0, 0.25)]
    profile_dir = tmp_path / "profile"
    assert [Path(e["path"]) for e in saved] == [(profile_dir / "rank1-step3-4.json").resolve(),
                                                (profile_dir / "rank0-step3-4.json").resolve()]
    assert (profile_dir / "rank0-step3-4.json").read_text() == \
        '{"traceEvents": [], "rank": 0}'
    assert sorted(p.name for p in profile_dir.iterdir()) == ["rank0-step3-4.json",
                                                             "rank1-step3-4.json"]
    # the trace came between the steps: it is in the log before the run's end
    kinds = [e["kind"] for e in w.events]
    assert kinds.index("profile_saved") < kinds.index("finished")
