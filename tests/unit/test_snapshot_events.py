"""The `snapshot_interval` events the controller writes from rank 0's schedule reports: each
change of an auto interval, and a world's reading as it ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.checkpointing.snapshot_schedule import Decision, ScheduleReport
from stalwart.core.config import load_config
from stalwart.core.events import read_events, read_jsonl
from stalwart.core.run_logs import EventLog
from stalwart.orchestrator.reporting import TierReporter
from stalwart.workers.reports import WorkerStatus

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def decision(step: int, interval: int, previous: int) -> Decision:
    return Decision(step=step, interval=interval, previous=previous, step_s=0.1,
                    cost_s=0.0012, overhead=0.3, expected=0.012)


def report(*changes: Decision, interval: int, step: int, windows: int = 0,
           overhead: float | None = None) -> ScheduleReport:
    return ScheduleReport(changes=changes, interval=interval, step=step, overhead=overhead,
                          windows=windows, expected=0.012, budget=0.02, step_s=0.1,
                          cost_s=0.0012)


def status(rank: int, generation: int, schedule: ScheduleReport | None) -> WorkerStatus:
    return WorkerStatus(rank=rank, generation=generation, steps=[], commits=[], done=False,
                        snapshot_schedule=schedule)


def test_rank_0s_changes_become_events_and_a_world_ends_with_its_reading(
        tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    reporter = TierReporter(load_config(None, ["checkpoint.snapshot_every=auto"]),
                            EventLog(path))
    reporter.after_launch(0, 2, now=0.0)
    reporter.on_status(0, status(0, 0, report(decision(6, 3, 1), decision(9, 5, 3),
                                              interval=5, step=9)), now=1.0)
    reporter.on_status(1, status(1, 0, report(decision(6, 3, 1), interval=3, step=6)),
                       now=1.0)  # the same decisions: rank 0 speaks for them
    reporter.on_status(0, status(0, 0, report(interval=5, step=29, windows=4,
                                              overhead=0.011)), now=2.0)
    reporter.intervals.world_ended()
    reporter.intervals.world_ended()  # once
    rows = [r for r in read_jsonl(path) if r["kind"] == "snapshot_interval"]
    assert [(r["step"], r["previous"], r["interval"], r["change"]) for r in rows] == [
        (6, 1, 3, "grew"), (9, 3, 5, "grew"), (29, 5, 5, "ended")]
    assert rows[-1]["overhead"] == 0.011 and rows[-1]["windows"] == 4
    assert rows[0]["overhead"] == 0.3 and rows[0]["budget"] == 0.02
    assert [e.kind for e in read_events(path)] == ["snapshot_interval"] * 3  # the schema reads


def test_a_world_without_a_measured_window_ends_without_a_reading(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    reporter = TierReporter(load_config(None, ["checkpoint.snapshot_every=auto"]),
                            EventLog(path))
    reporter.on_status(0, status(0, 1, report(decision(12, 2, 4), interval=2, step=12)),
                       now=1.0)
    reporter.intervals.world_ended()
    rows = read_jsonl(path)
    assert [(r["change"], r["generation"]) for r in rows] == [("shrank", 1)]


def test_a_new_worlds_report_ends_the_last_worlds_reading(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    reporter = TierReporter(load_config(None, ["checkpoint.snapshot_every=auto"]),
                            EventLog(path))
    reporter.on_status(0, status(0, 0, report(interval=4, step=20, windows=3,
                                              overhead=0.01)), now=1.0)
    reporter.on_status(0, status(0, 1, report(interval=1, step=0)), now=2.0)
    rows = read_jsonl(path)
    assert [(r["change"], r["generation"], r["interval"]) for r in rows] == [("ended", 0, 4)]


def test_a_fixed_interval_reports_no_schedule(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    reporter = TierReporter(load_config(None, []), EventLog(path))
    reporter.on_status(0, status(0, 0, None), now=1.0)
    reporter.intervals.world_ended()
    assert read_jsonl(path) == []
