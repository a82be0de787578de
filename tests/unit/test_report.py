"""stalwart report: the summary of synthetic run directories, computed by hand; the figure;
the command line. Every step below takes exactly 1 s and 1,000 tokens, with a row every 5."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from stalwart.cli.main import main as cli_main
from stalwart.core import events as E
from stalwart.core.errors import RecordError
from stalwart.core.events import read_jsonl
from stalwart.report import load
from stalwart.report.summary import kept_rows, summarize

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

T0 = 1000.0
TOKENS = 1000


def _blank(hint: Any) -> Any:
    """A filler for a required field a test does not care about."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return None
    origin = typing.get_origin(hint) or hint
    return {int: 0, float: 0.0, str: "", bool: False, list: [], dict: {}, tuple: ()}[origin]


def ev(time: float, kind: str, **fields: Any) -> E.Event:
    """The typed event of `kind` with `fields` (nested records as dicts, as in events.jsonl);
    required fields the test leaves out get a blank value."""
    cls = E.EVENT_TYPES[kind]
    hints = typing.get_type_hints(cls)
    blanks = {f.name: _blank(hints[f.name]) for f in dataclasses.fields(cls)
              if f.default is dataclasses.MISSING
              and f.default_factory is dataclasses.MISSING}  # type: ignore[misc]
    return E.from_row(cls, {**blanks, **fields, "time": time})


def rows_of(steps: range, first_step_start: float, *, after_step: int) -> list[E.MetricsRow]:
    """Rows every 5 steps of a world whose first step (after_step + 1) starts at
    first_step_start; step n ends at first_step_start + (n - after_step)."""
    out, previous = [], after_step
    for step in steps:
        if step % 5:
            continue
        n = step - previous
        out.append(E.MetricsRow(step=step, loss=10.0 / step, lr=1e-3, world_size=2,
                                tokens_per_s=TOKENS * n / n, samples_seen=8 * step,
                                time=first_step_start + step - after_step,
                                window_s=float(n), steps_in_window=n))
        previous = step
    return out


def world(time: float, generation: int, size: int = 2, kept: dict | None = None
          ) -> E.Event:
    places = [{"rank": r, "pid": 100 + r, "node_ip": "127.0.0.1", "node_id": "n"}
              for r in range(size)]
    return ev(time, "workers_started", generation=generation, world_size=size,
              workers=places, kept_unlogged=kept)


def clean_run() -> tuple[list[E.Event], list[E.MetricsRow]]:
    """40 steps, no failure: steps from T0 + 1 to T0 + 41, finished at T0 + 42."""
    events = [ev(T0, "started", world_size=2, steps=40, start_step=0), world(T0, 0),
              *(ev(T0 + 1 + s + 0.1, "checkpoint_committed", step=s, save_s=0.25)
                for s in (20, 40)),
              ev(T0 + 42, "finished", step=40, loss=0.25, val_loss=None)]
    return events, rows_of(range(1, 41), T0 + 1, after_step=0)


def killed_at_25(*, memory: bool) -> tuple[list[E.Event], list[E.MetricsRow]]:
    """Rank 1 dies after step 25 (its row written at T0 + 26), found 0.5 s later.

    memory=False: restored from storage's step 20; steps 21-25 are trained again (the row of
    step 25 was lost work). memory=True: restored from step 25 (nothing lost).
    The new world's first step starts at T0 + 31.
    """
    from_step = 25 if memory else 20
    events = [ev(T0, "started", world_size=2, steps=40, start_step=0), world(T0, 0),
              ev(T0 + 21.1, "checkpoint_committed", step=20, save_s=0.25),
              ev(T0 + 26.5, "failure", failure_kind="worker_died", step=25, ranks=[1],
                 detection_s=0.5, rank=1),
              world(T0 + 30, 1),
              ev(T0 + 32.1, "recovered", from_step=from_step,
                 source="memory" if memory else "storage", lost_steps=25 - from_step,
                 recovery_s=6.0, world_size=2),
              ev(T0 + 31 + 40 - from_step + 1, "finished", step=40, loss=0.25, val_loss=None)]
    rows = [*rows_of(range(1, 26), T0 + 1, after_step=0),
            *rows_of(range(from_step + 1, 41), T0 + 31, after_step=from_step)]
    return events, rows


def test_a_clean_run() -> None:
    events, rows = clean_run()
    s = summarize(events, rows, now=T0 + 999, steps_total=40)
    assert s.state == "finished" and s.steps_done == 40 and s.steps_total == 40
    assert s.wall_s == 42.0 and s.productive_s == 40.0  # the first step started at T0 + 1
    assert s.goodput == pytest.approx(40 / 42)
    assert s.failures == [] and s.failures_by_kind == {} and s.recoveries_by_source == {}
    assert s.detection_s_median is None and s.recovery_s_median is None
    assert s.lost_steps == 0 and s.resizes == [] and s.untimed_steps == 0 and s.notes == []
    assert s.tokens_per_step == TOKENS and s.tokens == 40 * TOKENS
    assert s.checkpoints == 2 and s.checkpoint_save_s == 0.5


def test_a_kill_at_step_25_recovered_from_step_20() -> None:
    events, rows = killed_at_25(memory=False)
    # the first world's row of step 25 is a lost attempt; the second world's is kept
    assert [(r.step, k) for r, k in zip(rows, kept_rows(events, rows), strict=True)] == [
        (5, True), (10, True), (15, True), (20, True), (25, False),
        (25, True), (30, True), (35, True), (40, True)]
    s = summarize(events, rows, now=T0 + 999, steps_total=40)
    assert s.lost_steps == 5 and s.failures_by_kind == {"worker_died": 1}
    assert [(f["kind"], f["step"]) for f in s.failures] == [("worker_died", 25)]
    assert s.recoveries_by_source == {"storage": 1}
    assert s.detection_s_median == 0.5 and s.recovery_s_median == 6.0
    # wall: T0 to the end at T0 + 31 + 20 + 1; productive: steps 1-20 (20 s), 21-40 again
    # (20 s); the lost attempt at 21-25 (5 s), detection and recovery are not productive
    assert s.wall_s == 52.0 and s.productive_s == 40.0 and s.untimed_steps == 0
    assert s.goodput == pytest.approx(40 / 52) and 0 < s.goodput < 1
    assert s.steps_done == 40 and s.tokens == 40 * TOKENS  # each step counted once


def test_unlogged_steps_a_recovery_keeps_are_productive() -> None:
    # Rank 1 dies as step 25 starts; the memory tier restores step 24. Steps 21-24 had no
    # row (one every 5 steps): the second world's workers_started says they were kept.
    events = [ev(T0, "started", world_size=2, steps=40, start_step=0), world(T0, 0),
              ev(T0 + 25.5, "failure", failure_kind="worker_died", step=24, ranks=[1],
                 detection_s=0.5, rank=1),
              world(T0 + 30, 1, kept={"first_step": 21, "last_step": 24, "window_s": 4.0}),
              ev(T0 + 32.1, "recovered", from_step=24, source="memory", lost_steps=0,
                 recovery_s=6.5, world_size=2),
              ev(T0 + 48, "finished", step=40, loss=0.25, val_loss=None)]
    rows = [*rows_of(range(1, 25), T0 + 1, after_step=0),
            *rows_of(range(25, 41), T0 + 31, after_step=24)]
    s = summarize(events, rows, now=T0 + 999)
    assert s.lost_steps == 0 and s.untimed_steps == 0 and s.recoveries_by_source == {
        "memory": 1}
    assert s.productive_s == 20 + 4 + 16  # rows to 20, kept unlogged 21-24, rows 25-40
    assert s.goodput == pytest.approx(40 / 48)


def test_steps_with_no_time_on_record_make_goodput_a_lower_bound() -> None:
    events, rows = killed_at_25(memory=True)  # 21-25 in one kept row...
    rows = [r for r in rows if not (r.step == 25 and r.time < T0 + 30)]  # ...now lost
    s = summarize(events, rows, now=T0 + 999)
    assert s.untimed_steps == 5 and s.productive_s == 35.0
    assert "lower bound" in s.notes[0]


def test_a_run_still_going_ends_now() -> None:
    events, rows = clean_run()
    events = events[:3]  # to the checkpoint of step 20; no finished event yet
    rows = rows[:4]  # steps to 20, the last at T0 + 21
    s = summarize(events, rows, now=T0 + 22.5, steps_total=40)
    assert s.state == "running" and s.steps_done == 20
    assert s.wall_s == 22.5 and s.goodput == pytest.approx(20 / 22.5)


def test_a_resume_starts_a_new_invocation_and_may_go_back() -> None:
    events, rows = clean_run()
    # interrupted after step 27 (rows 5..25 written); resumed a day later from step 20
    rows = rows[:5]
    events = [*events[:3], ev(T0 + 28.5, "interrupted", step=27, reason="KeyboardInterrupt")]
    later = T0 + 86_400
    events += [ev(later, "resumed", from_step=20, path="x", config_changes={}),
               ev(later + 5, "started", world_size=2, steps=40, start_step=20),
               world(later + 5, 0), ev(later + 26, "finished", step=40, loss=0.2,
                                       val_loss=None)]
    rows += rows_of(range(21, 41), later + 6, after_step=20)
    s = summarize(events, rows, now=later + 999)
    assert s.state == "finished" and s.start_step == 0 and s.steps_done == 40
    assert [k for k in kept_rows(events, rows)] == [True] * 4 + [False] + [True] * 4
    assert s.wall_s == 28.5 + 26  # the day between the two invocations is not the run's
    assert s.productive_s == 40.0


def test_resizes_are_listed() -> None:
    events, rows = clean_run()
    events.insert(3, ev(T0 + 16, "resized", old_world_size=2, new_world_size=1,
                        reason="drain", step=15, old_layout={}, new_layout={}))
    s = summarize(events, rows, now=T0 + 999)
    assert [(r["step"], r["old_world_size"], r["new_world_size"], r["reason"])
            for r in s.resizes] == [(15, 2, 1, "drain")]


def write_run(path: Path, events: list[E.Event], rows: list[E.MetricsRow], *,
              tail: str = "") -> Path:
    path.mkdir(parents=True)
    (path / "config.toml").write_text("[train]\nsteps = 40\n\n[checkpoint]\n"
                                      "async_save = true\n")
    (path / "events.jsonl").write_text("".join(E.dumps(e) + "\n" for e in events) + tail)
    (path / "metrics.jsonl").write_text("".join(E.dumps(r) + "\n" for r in rows) + tail)
    return path


def test_a_half_written_last_line_is_skipped_a_damaged_whole_line_is_not(
        tmp_path: Path) -> None:
    events, rows = clean_run()
    run = write_run(tmp_path / "run", events[:-1], rows, tail='{"time": 1042.0, "ki')
    s, read_events, read_rows = load(run, now=T0 + 50)
    assert s.state == "running" and len(read_events) == len(events) - 1
    assert len(read_rows) == len(rows) and s.steps_total == 40

    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text('{"a": 1}\n{"a": \n')  # a whole line, newline and all: not partial
    with pytest.raises(RecordError, match=r"damaged.jsonl line 2 is damaged: not JSON"):
        read_jsonl(damaged)


def test_every_event_class_is_registered_for_reading_back() -> None:
    """An event stalwart emits but cannot read back would make its run dir unreadable."""
    def subclasses(cls: type) -> set[type]:
        return {c for sub in cls.__subclasses__() for c in (sub, *subclasses(sub))}

    emitted = {c for c in subclasses(E.Event) if "kind" in vars(c)}
    assert emitted == set(E.EVENT_TYPES.values()), emitted ^ set(E.EVENT_TYPES.values())


def test_every_event_kind_reads_back_through_the_checks(tmp_path: Path) -> None:
    """What stalwart writes, the checked reader takes: every kind, blank and optional fields."""
    written = [ev(T0 + i, kind) for i, kind in enumerate(E.EVENT_TYPES)]
    written.append(world(T0 + 99, 3, kept={"first_step": 1, "last_step": 2, "window_s": 1.5}))
    path = tmp_path / "events.jsonl"
    path.write_text("".join(E.dumps(e) + "\n" for e in written))
    assert E.read_events(path) == written
    rows = [*rows_of(range(1, 11), T0, after_step=0)]
    rows[0] = dataclasses.replace(rows[0], loss=float("nan"), val_loss=float("inf"))
    (tmp_path / "metrics.jsonl").write_text("".join(E.dumps(r) + "\n" for r in rows))
    back = E.read_metrics(tmp_path / "metrics.jsonl")
    assert back[1:] == rows[1:] and back[0].loss != back[0].loss  # NaN: a diverged run


@pytest.mark.parametrize(("text", "fragment"), [
    ('{"time": 1.0, "kind": "finished", "step": 1}\n[]\n', "line 2 is a JSON array"),
    ('{"time": 1.0, "kind": "finished", "step": 1.5}\n', "field step is 1.5, expected an "
                                                          "integer"),
    ('{"time": NaN, "kind": "finished", "step": 1}\n', "field time is nan, expected a finite"),
    ('{"kind": "finished", "step": 1}\n', "finished event has no field 'time'"),
    ('{"time": 1.0, "step": 1}\n', "line 1 has no field 'kind'"),
    ('{"time": 1.0, "kind": "workers_started", "generation": 0, "world_size": 1, '
     '"workers": [{"rank": 0}]}\n', "field workers[0] has no field 'pid'"),
])
def test_a_damaged_record_names_its_file_and_line(tmp_path: Path, text: str,
                                                  fragment: str) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text(text)
    with pytest.raises(RecordError, match=re.escape(fragment)):
        E.read_events(path)


def test_the_figure_is_a_png(tmp_path: Path) -> None:
    image = pytest.importorskip("matplotlib.image")
    from stalwart.report.plot import write_png

    events, rows = killed_at_25(memory=False)
    rows[2] = dataclasses.replace(rows[2], val_loss=2.0)
    s = summarize(events, rows, now=T0 + 999)
    out = write_png(tmp_path / "fig" / "r.png", events, rows, s, title="t", now=T0 + 999)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    height, width, _ = image.imread(out).shape
    assert width >= 600 and height >= 600


def test_the_command_prints_json_and_writes_the_figure(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    run = write_run(tmp_path / "run", *killed_at_25(memory=False))
    assert cli_main(["report", str(run), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["goodput"] == pytest.approx(40 / 52) and out["steps_total"] == 40
    assert out["png"] == str(run / "report.png") and (run / "report.png").stat().st_size > 0

    assert cli_main(["report", str(run), "--out", str(tmp_path / "x.png")]) == 0
    table = capsys.readouterr().out
    assert "goodput        0.769" in table and "worker_died 1" in table
    assert "lost steps     5" in table and "storage 1" in table


def test_without_matplotlib_the_table_still_prints(tmp_path: Path, capsys,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    run = write_run(tmp_path / "run", *clean_run())
    assert cli_main(["report", str(run)]) == 0
    captured = capsys.readouterr()
    assert "goodput" in captured.out and "pip install 'stalwart[report]'" in captured.err
    assert not (run / "report.png").exists()

    assert cli_main(["report", str(run), "--out", str(tmp_path / "x.png")]) == 2
    captured = capsys.readouterr()
    assert "goodput" in captured.out
    assert captured.err.count("\n") == 1 and "stalwart: error: matplotlib" in captured.err


def test_not_a_run_directory(tmp_path: Path, capsys) -> None:
    assert cli_main(["report", str(tmp_path / "nothing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli_main(["report", str(tmp_path / "empty")]) == 2
    assert "holds no events" in capsys.readouterr().err
