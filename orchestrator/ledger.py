"""The data ledger on the driver: which samples each kept step trained on, as parquet parts.

With data.ledger on, rank 0's step reports carry the global batch's sample ids (epoch, file,
row), and whether the step's update was dropped (a numerical fault's skipped batch).
`LedgerWriter` buffers them and writes `RUN_DIR/ledger.parquet`, a directory of part
files `part-<first step>-<last step>.parquet` that pyarrow, pandas and duckdb read as one
table. A part is written whole under a hidden name and renamed into place, so a reader never
sees half of one.

Steps a restore went back on were trained again, so the ledger follows the run's kept
timeline: a restore to step s drops the buffered rows past s and cuts the parts on disk to
steps <= s. Parts are written when a storage checkpoint commits (the rows up to it: what a
restart of the driver resumes from), every `flush_every` steps, after a restore, and when the
run ends. A resumed run continues the same directory; its first restore cuts it like any other.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stalwart.core.errors import RunDirError
from stalwart.core.safe_files import make_dir_nofollow, replacing
from stalwart.orchestrator.observers import ControllerObserver

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig
    from stalwart.core.run_logs import EventLog
    from stalwart.core.stream import SampleIds
    from stalwart.orchestrator.observers import Restored
    from stalwart.orchestrator.states import Running, State
    from stalwart.workers.reports import StepReport

LEDGER_DIR = "ledger.parquet"
FLUSH_EVERY = 200
"""Steps buffered at most before they are written, checkpoint or not."""

SCHEMA = pa.schema([("step", pa.int64()), ("epoch", pa.int64()),
                    ("file", pa.dictionary(pa.int32(), pa.string())),
                    ("row", pa.int64()), ("position", pa.int64()),
                    ("skipped", pa.bool_())])

_PART = re.compile(r"^part-(\d{9,})-(\d{9,})\.parquet$")


def part_name(first: int, last: int) -> str:
    return f"part-{first:09d}-{last:09d}.parquet"


@dataclass(frozen=True)
class Part:
    """A part file on disk and the steps its name says it holds."""

    path: Path
    first: int
    last: int


def parts(directory: Path) -> list[Part]:
    """The ledger's part files, by first step (other names are not the writer's)."""
    if not directory.is_dir():
        return []
    found = [Part(p, int(m[1]), int(m[2])) for p in directory.iterdir()
             if (m := _PART.match(p.name))]
    return sorted(found, key=lambda p: (p.first, p.last))


def ledger_observers(config: JobConfig, events: EventLog) -> list[ControllerObserver]:
    """The writer when data.ledger is on, else none: for the controller's observer list. The
    ledger goes beside the run's events.jsonl, in the run directory."""
    if not config.data.ledger:
        return []
    return [LedgerWriter(events.path.parent / LEDGER_DIR,
                         global_batch=config.train.global_batch_size)]


class LedgerWriter(ControllerObserver):
    """Writes the ledger of one run directory (see the module's docstring)."""

    def __init__(self, directory: Path, *, global_batch: int,
                 flush_every: int = FLUSH_EVERY) -> None:
        if directory.is_symlink():  # its parts would land wherever it points
            raise RunDirError(f"{directory} is a symbolic link; stalwart never writes through "
                              f"one: remove it, or choose another --run-dir")
        self.directory = directory
        self.global_batch = global_batch
        self.flush_every = flush_every
        self._rows: dict[int, SampleIds] = {}  # step -> its samples, not yet on disk
        self._skipped: set[int] = set()  # buffered steps whose update was dropped
        self._committed = 0  # the newest committed step whose rows may still be buffered

    # ------------------------------------------------------------------ hooks

    def on_step(self, report: StepReport) -> None:
        if report.ledger is None:
            return
        self._rows[report.step] = report.ledger
        if report.skipped:  # consumed, not trained on (a numerical fault's batch)
            self._skipped.add(report.step)
        else:
            self._skipped.discard(report.step)
        if len(self._rows) >= self.flush_every:
            self.flush()

    def on_commit(self, step: int) -> None:
        # In a poll the commit comes before that poll's steps: its own step's rows may
        # still be on the way, and after_poll writes them. As a world ends they are here.
        self._committed = max(self._committed, step)
        if self._rows and max(self._rows) >= step:
            self.flush(upto=step)

    def after_poll(self, state: Running, last_step: int, now: float) -> None:
        if self._rows and min(self._rows) <= self._committed:
            self.flush(upto=self._committed)

    def after_restore(self, restored: Restored, now: float) -> None:
        start = restored.start_step
        self._rows = {s: ids for s, ids in self._rows.items() if s <= start}
        self._skipped = {s for s in self._skipped if s <= start}
        self._committed = min(self._committed, start)
        self.truncate(start)
        self.flush()  # what the world restored is the run's from now on

    def on_end(self, state: State) -> None:
        self.flush()

    # ------------------------------------------------------------------ the files

    def flush(self, upto: int | None = None) -> Path | None:
        """Write the buffered rows of steps <= `upto` (all when None) as one new part."""
        steps = sorted(s for s in self._rows if upto is None or s <= upto)
        if not steps:
            return None
        table = self._table(steps)
        path = self._write(table, part_name(steps[0], steps[-1]))
        for s in steps:
            del self._rows[s]
            self._skipped.discard(s)
        return path

    def truncate(self, start_step: int) -> None:
        """Cut the parts on disk to steps <= `start_step`: a part wholly past it is deleted,
        one straddling it rewritten with its rows up to it. Half-written parts a killed
        driver left are removed."""
        if not self.directory.is_dir():
            return
        for stale in self.directory.glob(".part-*.tmp"):
            with contextlib.suppress(FileNotFoundError):
                stale.unlink()
        for part in parts(self.directory):
            if part.first > start_step:
                part.path.unlink()
            elif part.last > start_step:
                self._cut(part, start_step)

    def _cut(self, part: Part, start_step: int) -> None:
        table = pq.read_table(part.path)
        kept = table.filter(pc.less_equal(table["step"], start_step))
        if kept.num_rows == 0:
            part.path.unlink()
            return
        steps = kept["step"].to_numpy()
        # The new contents replace the old under the old name, then the name follows: at
        # every moment the directory holds each kept row once, and no dropped one.
        self._write(kept, part.path.name)  # its schema and global_batch, as written
        os.replace(part.path, self.directory / part_name(int(steps.min()), int(steps.max())))

    def _schema(self) -> pa.Schema:
        return SCHEMA.with_metadata({"global_batch": str(self.global_batch)})

    def _table(self, steps: list[int]) -> pa.Table:
        batches = [self._rows[s] for s in steps]
        counts = [len(ids.row) for ids in batches]
        step = np.repeat(np.asarray(steps, dtype=np.int64), counts)
        position = np.concatenate([(s - 1) * self.global_batch + np.arange(n, dtype=np.int64)
                                   for s, n in zip(steps, counts, strict=True)])
        files = np.concatenate([np.asarray(ids.files, dtype=object)[np.asarray(ids.file)]
                                for ids in batches])
        return pa.table({
            "step": step,
            "epoch": np.concatenate([np.asarray(ids.epoch, dtype=np.int64) for ids in batches]),
            "file": pa.array(files, pa.string()).dictionary_encode(),
            "row": np.concatenate([np.asarray(ids.row, dtype=np.int64) for ids in batches]),
            "position": position,
            "skipped": np.repeat([s in self._skipped for s in steps], counts),
        }, schema=self._schema())

    def _write(self, table: pa.Table, name: str) -> Path:
        make_dir_nofollow(self.directory)
        path = self.directory / name
        with replacing(path) as f:
            pq.write_table(table, f)
        return path
