"""The data ledger's writer (orchestrator/ledger.py): rank 0's step reports in, parquet parts
out. Fed StepReports and restores directly, then through the controller driven by the fake
worker group; the parts on disk are read back with pyarrow and pandas."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stalwart.core.config import load_config
from stalwart.core.errors import RunDirError
from stalwart.core.run_logs import EventLog
from stalwart.core.stream import SampleIds
from stalwart.orchestrator import ledger as ledger_module
from stalwart.orchestrator.ledger import LedgerWriter, ledger_observers
from stalwart.orchestrator.observers import Restored
from stalwart.orchestrator.states import Finished
from stalwart.report.ledger import check_ledger
from stalwart.workers.reports import StepReport
from tests.fake_group import Plan, Poll
from tests.unit.controller_world import T1, FakeWorld, _commit_checkpoint, status

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

BATCH = 4
FILES = ("a.parquet", "b.parquet")


def ids(step: int, batch: int = BATCH) -> SampleIds:
    """Step n's samples: rows (n-1)*batch.. of the epoch, dealt alternately to two files."""
    first = (step - 1) * batch
    return SampleIds(epoch=np.zeros(batch, np.int64), file=np.arange(batch) % 2,
                     row=np.arange(first, first + batch) // 2, files=FILES)


def report(step: int, *, ledger: bool = True) -> StepReport:
    return StepReport(rank=0, step=step, loss=1.0, lr=1e-3, tokens=100, step_time_s=0.1,
                      time=1000.0 + step, ledger=ids(step) if ledger else None)


def restored(start_step: int, generation: int = 1) -> Restored:
    return Restored(generation=generation, world_size=2, start_step=start_step,
                    source="storage", peer_fetches=0, last_step=start_step)


def feed(writer: LedgerWriter, steps: range) -> None:
    for s in steps:
        writer.on_step(report(s))


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def steps_on_disk(directory: Path) -> list[int]:
    return sorted(pq.read_table(directory)["step"].to_pylist())


@pytest.fixture
def ledger_dir(tmp_path: Path) -> Path:
    return tmp_path / "ledger.parquet"


def test_a_commit_writes_the_steps_up_to_it_the_end_the_rest(ledger_dir: Path) -> None:
    w = LedgerWriter(ledger_dir, global_batch=BATCH)
    feed(w, range(1, 8))
    w.on_commit(5)
    assert names(ledger_dir) == ["part-000000001-000000005.parquet"]
    w.on_end(Finished(step=7))
    assert names(ledger_dir) == ["part-000000001-000000005.parquet",
                                 "part-000000006-000000007.parquet"]

    table = pq.read_table(ledger_dir)
    assert table.num_rows == 7 * BATCH
    assert table.schema.field("file").type == pa.dictionary(pa.int32(), pa.string())
    for column in ("step", "epoch", "row", "position"):
        assert table.schema.field(column).type == pa.int64()
    assert table["position"].to_pylist() == list(range(7 * BATCH))
    assert table["step"].to_pylist()[:BATCH + 1] == [1, 1, 1, 1, 2]
    assert table["file"].to_pylist()[:3] == ["a.parquet", "b.parquet", "a.parquet"]
    assert table["row"].to_pylist()[:4] == [0, 0, 1, 1]
    part = pq.read_table(ledger_dir / "part-000000001-000000005.parquet")
    assert part.schema.metadata[b"global_batch"] == str(BATCH).encode()
    # pandas reads the directory as one table too
    frame = pd.read_parquet(ledger_dir)
    assert len(frame) == 7 * BATCH and frame["step"].max() == 7
    assert check_ledger(table).ok


def test_a_commit_before_its_steps_report_is_written_after_the_poll(ledger_dir: Path) -> None:
    # In a poll, rank 0's commits are taken in before that poll's steps.
    w = LedgerWriter(ledger_dir, global_batch=BATCH)
    feed(w, range(1, 4))
    w.on_commit(4)
    assert not ledger_dir.exists()  # step 4's rows are still on the way
    feed(w, range(4, 6))
    w.after_poll(None, 5, 0.0)  # type: ignore[arg-type]
    assert names(ledger_dir) == ["part-000000001-000000004.parquet"]
    assert steps_on_disk(ledger_dir) == sorted([1, 2, 3, 4] * BATCH)


def test_every_flush_every_steps_a_part_without_a_commit(ledger_dir: Path) -> None:
    w = LedgerWriter(ledger_dir, global_batch=BATCH, flush_every=3)
    feed(w, range(1, 8))
    assert names(ledger_dir) == ["part-000000001-000000003.parquet",
                                 "part-000000004-000000006.parquet"]


def test_reports_without_a_ledger_are_ignored(ledger_dir: Path) -> None:
    w = LedgerWriter(ledger_dir, global_batch=BATCH)
    w.on_step(report(1, ledger=False))
    w.on_end(Finished(step=1))
    assert not ledger_dir.exists()


def test_a_map_style_dataset_has_an_empty_file_name(ledger_dir: Path) -> None:
    w = LedgerWriter(ledger_dir, global_batch=2)
    w.on_step(dataclasses.replace(report(1), ledger=SampleIds(
        epoch=np.zeros(2, np.int64), file=np.zeros(2, np.int64), row=np.array([7, 3]),
        files=("",))))
    w.on_end(Finished(step=1))
    assert pq.read_table(ledger_dir)["file"].to_pylist() == ["", ""]


def test_a_restore_drops_later_buffered_rows_and_cuts_the_parts(ledger_dir: Path) -> None:
    w = LedgerWriter(ledger_dir, global_batch=BATCH)
    feed(w, range(1, 6))
    w.on_commit(5)
    feed(w, range(6, 11))
    w.on_commit(10)
    feed(w, range(11, 13))  # buffered, never committed
    assert names(ledger_dir) == ["part-000000001-000000005.parquet",
                                 "part-000000006-000000010.parquet"]
    w.after_restore(restored(7), 0.0)
    # the straddling part keeps its rows up to step 7, under its new name
    assert names(ledger_dir) == ["part-000000001-000000005.parquet",
                                 "part-000000006-000000007.parquet"]
    cut = pq.read_table(ledger_dir / "part-000000006-000000007.parquet")
    assert sorted(set(cut["step"].to_pylist())) == [6, 7]
    assert cut.schema.metadata[b"global_batch"] == str(BATCH).encode()
    assert cut.schema.field("file").type == pa.dictionary(pa.int32(), pa.string())
    # steps 8 to 12 are trained again
    feed(w, range(8, 13))
    w.on_end(Finished(step=12))
    assert steps_on_disk(ledger_dir) == sorted(list(range(1, 13)) * BATCH)
    assert check_ledger(pq.read_table(ledger_dir)).ok


def test_a_restore_to_a_parts_last_step_keeps_it_and_deletes_the_next(
        ledger_dir: Path) -> None:
    w = LedgerWriter(ledger_dir, global_batch=BATCH, flush_every=5)
    feed(w, range(1, 11))
    w.after_restore(restored(5), 0.0)
    assert names(ledger_dir) == ["part-000000001-000000005.parquet"]
    w.after_restore(restored(0), 0.0)  # no checkpoint: the run starts again
    assert names(ledger_dir) == []


def test_a_restore_writes_the_buffered_rows_it_restored(ledger_dir: Path) -> None:
    w = LedgerWriter(ledger_dir, global_batch=BATCH)
    feed(w, range(1, 7))
    w.after_restore(restored(4), 0.0)  # a memory restore, say: no commit of step 4 seen
    assert names(ledger_dir) == ["part-000000001-000000004.parquet"]


def test_a_resumed_run_continues_the_ledger_cut_at_its_first_restore(
        ledger_dir: Path) -> None:
    first = LedgerWriter(ledger_dir, global_batch=BATCH)
    feed(first, range(1, 6))
    first.on_commit(4)
    first.on_end(Finished(step=5))  # failed after step 5, say; its checkpoint is step 4
    assert names(ledger_dir) == ["part-000000001-000000004.parquet",
                                 "part-000000005-000000005.parquet"]

    resumed = LedgerWriter(ledger_dir, global_batch=BATCH)
    resumed.after_restore(restored(4, generation=0), 0.0)
    assert names(ledger_dir) == ["part-000000001-000000004.parquet"]
    feed(resumed, range(5, 9))
    resumed.on_end(Finished(step=8))
    assert names(ledger_dir) == ["part-000000001-000000004.parquet",
                                 "part-000000005-000000008.parquet"]
    result = check_ledger(pq.read_table(ledger_dir), first_step=1)
    assert result.ok and result.steps == 8


def test_parts_are_written_whole_or_not_at_all(ledger_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    w = LedgerWriter(ledger_dir, global_batch=BATCH)
    feed(w, range(1, 4))
    real = ledger_module.pq.write_table

    def disk_full(table: pa.Table, where: object) -> None:
        where.write(b"PAR1 half a file")  # type: ignore[attr-defined]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ledger_module.pq, "write_table", disk_full)
    with pytest.raises(OSError, match="No space"):
        w.on_end(Finished(step=3))
    assert names(ledger_dir) == []  # neither the part nor its temporary file
    monkeypatch.setattr(ledger_module.pq, "write_table", real)
    w.on_end(Finished(step=3))  # the rows were kept for the next try
    assert names(ledger_dir) == ["part-000000001-000000003.parquet"]


def test_a_killed_drivers_temporary_file_is_removed_and_never_read(ledger_dir: Path) -> None:
    w = LedgerWriter(ledger_dir, global_batch=BATCH)
    feed(w, range(1, 3))
    w.on_end(Finished(step=2))
    (ledger_dir / ".part-000000003-000000003.parquet.x1y2.tmp").write_bytes(b"PAR1 cut")
    assert steps_on_disk(ledger_dir) == sorted([1, 2] * BATCH)  # hidden: readers skip it
    LedgerWriter(ledger_dir, global_batch=BATCH).after_restore(restored(2, 0), 0.0)
    assert names(ledger_dir) == ["part-000000001-000000002.parquet"]


def test_a_symbolic_link_at_the_ledger_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "ledger.parquet").symlink_to(elsewhere)
    with pytest.raises(RunDirError, match="symbolic link"):
        LedgerWriter(tmp_path / "ledger.parquet", global_batch=BATCH)


def test_the_controller_writes_it_only_with_data_ledger_on(tmp_path: Path) -> None:
    events = EventLog(tmp_path / "events.jsonl")
    assert ledger_observers(load_config(None, []), events) == []
    (writer,) = ledger_observers(load_config(None, ["data.ledger=true",
                                                    "train.global_batch_size=64"]), events)
    assert isinstance(writer, LedgerWriter)
    assert writer.directory == tmp_path / "ledger.parquet" and writer.global_batch == 64


def _ledger_status(steps: range | list[int], *, t0: float, commits: list[int] = (),
                   dead: bool = False, done: bool = False) -> list:
    """Rank 0's status with its steps' sample ids, and rank 1's."""
    zero = status(0, steps, t0=t0, commits=commits, done=done)
    zero = dataclasses.replace(zero, steps=[dataclasses.replace(r, ledger=ids(r.step))
                                            for r in zero.steps])
    return [zero] if dead else [zero, status(1, steps, t0=t0, done=done)]


def test_through_the_controller_a_recovery_keeps_each_step_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = tmp_path / "checkpoints"
    _commit_checkpoint(storage, 2)
    _commit_checkpoint(storage, 4)
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[_ledger_status([1, 2, 3, 4, 5], t0=0.0, commits=[2, 4]),
                    Poll(_ledger_status([], t0=0.0, dead=True), dead=[1])]),
        Plan(polls=[_ledger_status([5, 6], t0=T1, done=True)]),
    ], ["failure.max_failures=1", "data.ledger=true",
        f"train.global_batch_size={BATCH}", "train.micro_batch_size=1"], storage=storage)
    assert w.run() == Finished(step=6)

    directory = tmp_path / "ledger.parquet"
    assert names(directory) == ["part-000000001-000000004.parquet",
                                "part-000000005-000000006.parquet"]
    result = check_ledger(pq.read_table(directory), first_step=1)
    assert result.ok, result.line()
    assert result.steps == 6 and result.samples == 6 * BATCH


def test_a_skipped_step_is_marked_and_the_check_counts_it(ledger_dir: Path) -> None:
    from dataclasses import replace

    from stalwart.report.ledger import check_ledger, read_ledger

    w = LedgerWriter(ledger_dir, global_batch=BATCH)
    feed(w, range(1, 3))
    w.on_step(replace(report(3), skipped=True))  # a numerical fault's batch: consumed
    feed(w, range(4, 6))
    w.on_end(Finished(step=5))
    table = pq.read_table(ledger_dir)
    assert sorted(set(table.filter(table["skipped"])["step"].to_pylist())) == [3]
    check = check_ledger(read_ledger(ledger_dir), first_step=1)
    assert check.ok and (check.skipped_steps, check.skipped_samples) == (1, BATCH)
    assert check.line().endswith(f"each exactly once; {BATCH} of them in 1 skipped step(s), "
                                 f"not trained on")
