"""`stalwart report`'s check of the data ledger (stalwart/report/ledger.py) on tables built by
hand, and the report's ledger and data-wait lines on a synthetic run directory."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stalwart.core.errors import RecordError
from stalwart.core.events import MetricsRow
from stalwart.report import main as report
from stalwart.report.ledger import Twice, check_ledger, read_ledger
from stalwart.report.summary import data_wait
from tests.unit.test_report import clean_run, write_run

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

BATCH = 4


def ledger(steps: list[int], *, batch: int = BATCH, rows_per_epoch: int = 1000,
           file: str = "a.parquet") -> dict[str, list]:
    """Columns of a ledger whose step n trained positions (n-1)*batch.. of one file."""
    out: dict[str, list] = {"step": [], "epoch": [], "file": [], "row": [], "position": []}
    for s in steps:
        for i in range(batch):
            position = (s - 1) * batch + i
            out["step"].append(s)
            out["epoch"].append(position // rows_per_epoch)
            out["file"].append(file)
            out["row"].append(position % rows_per_epoch)
            out["position"].append(position)
    return out


def table(columns: dict[str, list]) -> pa.Table:
    return pa.table({**columns, "file": pa.array(columns["file"]).dictionary_encode()})


def test_each_sample_exactly_once() -> None:
    result = check_ledger(table(ledger(list(range(1, 11)), rows_per_epoch=12)))
    assert result.ok
    assert (result.samples, result.steps, result.epochs, result.batch) == (40, 10, 4, BATCH)
    assert result.line() == "ledger: 40 samples in 10 steps (4 epochs), each exactly once"


def test_a_sample_trained_twice_names_the_first_with_both_steps() -> None:
    columns = ledger([1, 2, 3, 4])
    columns["row"][13] = columns["row"][2]  # step 4 trains step 1's third sample again
    columns["row"][6] = columns["row"][1]  # and step 2 its second: the first repeat
    result = check_ledger(table(columns))
    assert not result.ok
    assert result.twice == Twice(epoch=0, file="a.parquet", row=1, first_step=1,
                                 second_step=2)
    assert result.twice_count == 2
    assert result.line() == ("ledger: epoch 0 file 'a.parquet' row 1 trained twice (steps 1 "
                             "and 2; 2 samples in all)")


def test_the_same_row_of_another_file_or_epoch_is_another_sample() -> None:
    one = ledger([1], file="a.parquet")
    other = ledger([2], file="b.parquet")
    other["row"] = one["row"]
    columns = {k: one[k] + other[k] for k in one}
    assert check_ledger(table(columns)).ok


def test_a_missing_step() -> None:
    result = check_ledger(table(ledger([1, 2, 4, 5, 8])))
    assert (result.missing, result.missing_first) == (3, [3, 6, 7])
    assert result.line() == "ledger: 3 step(s) missing (first: 3, 6, 7)"


def test_steps_missing_before_the_first_row_when_the_run_started_earlier() -> None:
    result = check_ledger(table(ledger([3, 4])), first_step=1)
    assert result.missing_first == [1, 2]
    assert check_ledger(table(ledger([3, 4])), first_step=3).ok  # started from a checkpoint


def test_a_duplicated_step() -> None:
    columns = ledger([1, 2, 3])
    again = ledger([2])
    columns = {k: columns[k] + again[k] for k in columns}
    result = check_ledger(table(columns))
    assert (result.duplicated, result.duplicated_first) == (1, [2])
    assert result.odd_count == 0  # its count is off for that reason, said once
    assert result.line().startswith("ledger: 1 step(s) duplicated (first: 2); epoch 0 file "
                                    "'a.parquet' row 4 trained twice (steps 2 and 2")


def test_a_step_with_another_sample_count() -> None:
    columns = ledger([1, 2, 3, 4])
    for values in columns.values():
        del values[9]  # one of step 3's samples
    result = check_ledger(table(columns))
    assert result.line() == "ledger: step 3 has 3 samples, the others 4"


def test_an_empty_ledger_is_not_ok() -> None:
    result = check_ledger(table(ledger([])))
    assert not result.ok and result.line() == "ledger: empty (no step recorded)"


def test_data_wait_is_the_share_of_the_window() -> None:
    def row(step: int, wait: float | None) -> MetricsRow:
        return MetricsRow(step=step, loss=1.0, lr=1e-3, tokens_per_s=1.0, world_size=1,
                          samples_seen=step, time=float(step), window_s=2.0,
                          steps_in_window=2, data_wait_s=wait)

    assert data_wait([row(2, None)]) is None
    assert data_wait([row(2, 0.5), row(4, 0.0), row(6, None)]) == pytest.approx(0.125)


def _write_ledger(run_dir: Path, columns: dict[str, list]) -> None:
    (run_dir / "ledger.parquet").mkdir()
    pq.write_table(table(columns), run_dir / "ledger.parquet" / "part-000000001-000000040.parquet")


def test_the_report_prints_the_ledger_and_the_data_wait(tmp_path: Path, capsys) -> None:
    events, rows = clean_run()
    rows = [dataclasses.replace(r, data_wait_s=r.window_s * 0.25) for r in rows]
    run = write_run(tmp_path / "run", events, rows)
    _write_ledger(run, ledger(list(range(1, 41))))
    assert report(str(run)) == 0
    out = capsys.readouterr().out
    assert "ledger: 160 samples in 40 steps (1 epochs), each exactly once" in out
    assert "data wait: 25.0% of step time" in out

    assert report(str(run), as_json=True) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["ledger"]["ok"] is True and printed["ledger"]["steps"] == 40
    assert printed["data_wait"] == pytest.approx(0.25)


def test_the_report_names_what_is_wrong_and_leaves_out_what_is_not_there(
        tmp_path: Path, capsys) -> None:
    events, rows = clean_run()
    run = write_run(tmp_path / "run", events, rows)
    assert report(str(run)) == 0
    out = capsys.readouterr().out
    assert "ledger:" not in out and "data wait" not in out

    _write_ledger(run, ledger([s for s in range(1, 41) if s != 7]))
    assert report(str(run)) == 0
    assert "ledger: 1 step(s) missing (first: 7)" in capsys.readouterr().out


def test_a_damaged_part_is_a_record_error(tmp_path: Path) -> None:
    (tmp_path / "part-000000001-000000001.parquet").write_bytes(b"not parquet")
    with pytest.raises(RecordError, match="the data ledger cannot be read"):
        read_ledger(tmp_path)
