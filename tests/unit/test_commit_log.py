"""CommitLog logs each committed checkpoint once: a world's leave hands over the commits its
polls took too (an answer may be dropped as the world ends)."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.checkpointing.storage.commit_report import CommitReport
from stalwart.core.events import read_jsonl
from stalwart.core.run_logs import EventLog
from stalwart.orchestrator.reporting import CommitLog

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_a_commit_handed_over_again_is_logged_once_and_a_recommit_again(tmp_path: Path):
    log = CommitLog(EventLog(tmp_path / "events.jsonl"), resume_from=None)
    first, second = CommitReport(3, "ck/3", 0.1), CommitReport(6, "ck/6", 0.2)
    log.reported([first])
    log.reported([first, second])  # the leave's hand-over: polled and not
    log.reported([CommitReport(6, "ck/6", 0.3)])  # step 6 saved again after a restore
    rows = read_jsonl(tmp_path / "events.jsonl")
    assert [(r["step"], r["save_s"]) for r in rows] == [(3, 0.1), (6, 0.2), (6, 0.3)]
    assert log.newest == 6
