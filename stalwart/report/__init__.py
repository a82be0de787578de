"""`stalwart report RUN_DIR`: where a run's time went, from its run directory alone.

Reads config.toml, events.jsonl and metrics.jsonl (a run that is still going may have left a
half-written last line: it is skipped), prints the summary as a table or JSON, and draws the
figure (stalwart.report.plot, needs matplotlib). What each number means: summary.py and
docs/reports.md.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from stalwart.config import read_toml
from stalwart.errors import ConfigError, RunDirError
from stalwart.events import Event, MetricsRow, read_events, read_metrics
from stalwart.report.summary import Summary, summarize
from stalwart.report.table import format_summary

__all__ = ["Summary", "load", "main", "summarize"]


def load(run_dir: Path, *, now: float | None = None
         ) -> tuple[Summary, list[Event], list[MetricsRow]]:
    """The summary of a run directory, with the events and rows it was computed from."""
    if not run_dir.is_dir():
        raise RunDirError(f"run dir {run_dir} does not exist")
    events = read_events(run_dir / "events.jsonl")
    if not events:
        raise RunDirError(f"run dir {run_dir} holds no events (events.jsonl): not a run "
                          f"directory, or its run has not started training yet")
    try:
        config = read_toml(run_dir / "config.toml")
    except ConfigError:  # the numbers come from the events; the config only adds context
        config = {}
    rows = read_metrics(run_dir / "metrics.jsonl")
    summary = summarize(
        events, rows, now=time.time() if now is None else now,
        steps_total=config.get("train", {}).get("steps"),
        async_save=config.get("checkpoint", {}).get("async_save", True))
    return summary, events, rows


def main(run_dir: str, *, out: str | None = None, as_json: bool = False) -> int:
    """Print the report of `run_dir` and write its figure (to `out`, default
    RUN_DIR/report.png). Without matplotlib the figure is skipped, and an error if `out` was
    asked for, after the table."""
    from stalwart.report.plot import MatplotlibMissing, write_png

    path = Path(run_dir)
    now = time.time()
    summary, events, rows = load(path, now=now)
    png: Path | None = Path(out) if out else path / "report.png"
    missing: MatplotlibMissing | None = None
    try:
        write_png(png, events, rows, summary, title=f"{path.name} ({summary.state})", now=now)
    except MatplotlibMissing as exc:
        png, missing = None, exc
    if as_json:
        print(json.dumps({**summary.to_dict(), "png": None if png is None else str(png)},
                         indent=2))
    else:
        print(format_summary(summary, str(path)))
        if png is not None:
            print(f"figure: {png}")
    if missing is not None:
        if out:
            raise missing
        print(f"stalwart: no figure: {missing}", file=sys.stderr)
    return 0
