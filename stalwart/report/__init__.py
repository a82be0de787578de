"""`stalwart report RUN_DIR`: where a run's time went, from its run directory alone.

Reads config.toml, events.jsonl and metrics.jsonl (a run that is still going may have left a
half-written last line: it is skipped) and, when the run kept one, the data ledger
(ledger.parquet, checked by stalwart.report.ledger), prints the summary as a table or JSON,
and draws the figure (stalwart.report.plot, needs matplotlib). What each number means:
summary.py and docs/reports.md.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from stalwart.core.config import read_toml
from stalwart.core.errors import RecordError, RunDirError, StalwartError
from stalwart.core.events import Event, MetricsRow, read_events, read_metrics
from stalwart.report.summary import Summary, summarize
from stalwart.report.table import format_summary

__all__ = ["Summary", "load", "main", "summarize"]


def load(run_dir: Path, *, now: float | None = None
         ) -> tuple[Summary, list[Event], list[MetricsRow]]:
    """The summary of a run directory, with the events and rows it was computed from.

    A damaged record (a line before the last, a field of the wrong type, a config.toml of the
    wrong shape) is a RecordError naming the file and line, never a report with a hole."""
    if not run_dir.exists():
        raise RunDirError(f"run dir {run_dir} does not exist")
    if not run_dir.is_dir():
        raise RunDirError(f"run dir {run_dir} is not a directory")
    events = read_events(run_dir / "events.jsonl")
    if not events:
        raise RunDirError(f"run dir {run_dir} holds no events (events.jsonl): not a run "
                          f"directory, or its run has not started training yet")
    steps_total, async_save = _config_context(run_dir / "config.toml")
    rows = read_metrics(run_dir / "metrics.jsonl")
    summary = summarize(events, rows, now=time.time() if now is None else now,
                        steps_total=steps_total, async_save=async_save)
    return summary, events, rows


def _config_context(path: Path) -> tuple[int | None, bool]:
    """train.steps and checkpoint.async_save from the run's config.toml. The numbers come
    from the events, the config only adds context: a missing file is no error, a damaged
    one is (stalwart writes it whole, with a rename)."""
    if not path.exists():
        return None, True
    config = read_toml(path, "the run's config", RecordError)
    for section, key, kind, allowed in (("train", "steps", int, "an integer >= 0"),
                                        ("checkpoint", "async_save", bool, "true or false")):
        table = config.get(section, {})
        if not isinstance(table, dict):
            raise RecordError(f"{path}: [{section}] is {table!r}, not a table")
        value = table.get(key)
        if value is not None and not (isinstance(value, kind) and (
                kind is bool or not isinstance(value, bool) and value >= 0)):
            raise RecordError(f"{path}: {section}.{key} = {value!r} is invalid: {allowed}")
    return config.get("train", {}).get("steps"), config.get("checkpoint", {}).get(
        "async_save", True)


def main(run_dir: str, *, out: str | None = None, as_json: bool = False) -> int:
    """Print the report of `run_dir` and write its figure (to `out`, default
    RUN_DIR/report.png). Without matplotlib the figure is skipped, and an error if `out` was
    asked for, after the table. The default figure that cannot be written (a run dir that is
    not ours to write) is skipped with a note; an `out` that cannot be written is an error.
    Either is written whole and renamed into place: a symbolic link at its name is replaced,
    not written through."""
    from stalwart.report.ledger import check_run  # pyarrow: not for summarize's users
    from stalwart.report.plot import MatplotlibMissing, write_png

    if out is not None:
        check_out(Path(out))
    path = Path(run_dir)
    now = time.time()
    summary, events, rows = load(path, now=now)
    ledger = check_run(path, first_step=summary.start_step + 1)
    png: Path | None = Path(out) if out else path / "report.png"
    problem: StalwartError | None = None
    try:
        write_png(png, events, rows, summary, title=f"{path.name} ({summary.state})", now=now)
    except MatplotlibMissing as exc:
        png, problem = None, exc
    except OSError as exc:
        if out:
            raise ReportError(f"--out {out}: cannot write the figure: "
                              f"{exc.strerror or exc}") from None
        png, problem = None, ReportError(f"cannot write {png}: {exc.strerror or exc}")
    if as_json:
        print(json.dumps({**summary.to_dict(),
                          "ledger": None if ledger is None else ledger.to_dict(),
                          "png": None if png is None else str(png)}, indent=2))
    else:
        print(format_summary(summary, str(path)))
        if ledger is not None:
            print(ledger.line())
        if png is not None:
            print(f"figure: {png}")
    if problem is not None:
        if out:
            raise problem
        print(f"stalwart: no figure: {problem}", file=sys.stderr)
    return 0


class ReportError(StalwartError):
    """`stalwart report` was asked for something it cannot do (names the option)."""


def check_out(out: Path) -> None:
    """Refuse an --out the figure could not be written to, before anything is read."""
    if out.suffix.lower() != ".png":
        raise ReportError(f"--out {out}: the figure is a PNG file; give a path ending in .png")
    if out.is_dir():
        raise ReportError(f"--out {out} is a directory; give a file path ending in .png")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ReportError(f"--out {out}: {parent} is not a directory")
    if not os.access(parent, os.W_OK):
        raise ReportError(f"--out {out}: {parent} is not writable")
