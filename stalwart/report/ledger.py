"""The data ledger's check for `stalwart report`: was every sample trained exactly once?

`RUN_DIR/ledger.parquet` (written with data.ledger on, orchestrator/ledger.py) holds one row
per sample of every kept step: step, epoch, file, row, position, and whether the step's
update was dropped (`skipped`). `check_ledger` is pure: it
takes the table and finds steps missing or duplicated, a step whose sample count differs
from the others', and a sample (epoch, file, row) trained twice. `read_ledger` reads the
directory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stalwart.core.errors import RecordError

NAMED = 5
"""How many steps a problem names, at most."""

LEDGER_DIR = "ledger.parquet"
COLUMNS = ("step", "epoch", "file", "row", "position")


@dataclass(frozen=True, kw_only=True)
class Twice:
    """A sample trained twice: the first one the run trained again, with both steps."""

    epoch: int
    file: str
    row: int
    first_step: int
    second_step: int


@dataclass(frozen=True, kw_only=True)
class OddStep:
    """A step whose sample count differs from the common one."""

    step: int
    samples: int


@dataclass(frozen=True, kw_only=True)
class LedgerCheck:
    samples: int
    steps: int
    """Distinct steps the ledger holds."""
    epochs: int
    """Distinct epochs its samples come from."""
    first_step: int | None
    last_step: int | None
    batch: int | None
    """The sample count most steps have."""
    missing: int = 0
    """Steps between the first expected one and the last held that the ledger lacks."""
    missing_first: list[int] = field(default_factory=list)
    duplicated: int = 0
    """Steps whose rows are there more than once (a position repeated)."""
    duplicated_first: list[int] = field(default_factory=list)
    odd_steps: list[OddStep] = field(default_factory=list)
    """The first few steps whose sample count is not `batch`."""
    odd_count: int = 0
    twice: Twice | None = None
    twice_count: int = 0
    """Samples trained more than once."""
    skipped_steps: int = 0
    """Steps whose batch was consumed with its update dropped (a numerical fault)."""
    skipped_samples: int = 0

    @property
    def ok(self) -> bool:
        return (self.samples > 0 and not self.missing and not self.duplicated
                and not self.odd_count and self.twice is None)

    def problems(self) -> list[str]:
        out = []
        if self.samples == 0:
            out.append("empty (no step recorded)")
        if self.missing:
            out.append(f"{self.missing} step(s) missing (first: {_steps(self.missing_first)})")
        if self.duplicated:
            out.append(f"{self.duplicated} step(s) duplicated "
                       f"(first: {_steps(self.duplicated_first)})")
        if self.odd_count:
            odd = self.odd_steps[0]
            more = f" and {self.odd_count - 1} more" if self.odd_count > 1 else ""
            out.append(f"step {odd.step} has {odd.samples} samples, the others "
                       f"{self.batch}{more}")
        if self.twice is not None:
            t = self.twice
            more = f"; {self.twice_count} samples in all" if self.twice_count > 1 else ""
            out.append(f"epoch {t.epoch} file {t.file!r} row {t.row} trained twice (steps "
                       f"{t.first_step} and {t.second_step}{more})")
        return out

    def line(self) -> str:
        """The report's line: the counts when all is well, else what is wrong."""
        if self.ok:
            skipped = (f"; {self.skipped_samples} of them in {self.skipped_steps} skipped "
                       f"step(s), not trained on" if self.skipped_steps else "")
            return (f"ledger: {self.samples} samples in {self.steps} steps "
                    f"({self.epochs} epochs), each exactly once{skipped}")
        return "ledger: " + "; ".join(self.problems())

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok, "line": self.line()}


def _steps(steps: list[int]) -> str:
    return ", ".join(str(s) for s in steps)


def read_ledger(directory: Path) -> pa.Table:
    """Every part of the ledger as one table; a part that cannot be read is a RecordError."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(directory)
    except (pa.ArrowException, OSError) as exc:
        raise RecordError(f"{directory}: the data ledger cannot be read: {exc}") from None
    absent = [c for c in COLUMNS if c not in table.column_names]
    if absent:
        raise RecordError(f"{directory}: the data ledger has no column(s) {absent}")
    # `skipped` came later than the other columns: a ledger without it skipped nothing.
    return table.select([*COLUMNS, *(["skipped"] if "skipped" in table.column_names
                                     else [])])


def check_run(run_dir: Path, *, first_step: int | None = None) -> LedgerCheck | None:
    """The check of `run_dir`'s ledger; None when the run kept none."""
    directory = run_dir / LEDGER_DIR
    if not directory.is_dir():
        return None
    return check_ledger(read_ledger(directory), first_step=first_step)


def check_ledger(table: pa.Table, *, first_step: int | None = None) -> LedgerCheck:
    """Check `table` (the ledger's columns); `first_step`, when given, is the step the ledger
    should start at (the run's first), so steps missing before its first row count too."""
    if table.num_rows == 0:
        return LedgerCheck(samples=0, steps=0, epochs=0, first_step=None, last_step=None,
                           batch=None)
    step = _ints(table, "step")
    held, counts = np.unique(step, return_counts=True)
    start = int(held[0]) if first_step is None else min(first_step, int(held[0]))
    missing = np.setdiff1d(np.arange(start, int(held[-1]) + 1), held)
    duplicated = _duplicated_steps(step, _ints(table, "position"))
    batch = _common(counts)
    doubled = set(duplicated.tolist())  # their count is off for that reason, named already
    odd = [(int(s), int(n)) for s, n in zip(held, counts, strict=True)
           if n != batch and int(s) not in doubled]
    twice, twice_count = _trained_twice(table, step)
    skipped = (step[table["skipped"].fill_null(False).to_numpy(zero_copy_only=False)]
               if "skipped" in table.column_names else step[:0])
    return LedgerCheck(
        samples=table.num_rows, steps=len(held),
        epochs=len(np.unique(_ints(table, "epoch"))),
        first_step=int(held[0]), last_step=int(held[-1]), batch=batch,
        missing=len(missing), missing_first=[int(s) for s in missing[:NAMED]],
        duplicated=len(duplicated), duplicated_first=[int(s) for s in duplicated[:NAMED]],
        odd_steps=[OddStep(step=s, samples=n) for s, n in odd[:NAMED]], odd_count=len(odd),
        twice=twice, twice_count=twice_count, skipped_samples=len(skipped),
        skipped_steps=len(np.unique(skipped)))


def _ints(table: pa.Table, name: str) -> np.ndarray:
    return table[name].to_numpy().astype(np.int64, copy=False)


def _common(counts: np.ndarray) -> int:
    """The sample count most steps have (the larger one on a tie)."""
    values, freq = np.unique(counts, return_counts=True)
    return int(values[freq == freq.max()][-1])


def _duplicated_steps(step: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Steps with a (step, position) row more than once: the same step's rows written twice."""
    order = np.lexsort((position, step))
    s, p = step[order], position[order]
    again = (s[1:] == s[:-1]) & (p[1:] == p[:-1])
    return np.unique(s[1:][again])


def _trained_twice(table: pa.Table, step: np.ndarray) -> tuple[Twice | None, int]:
    """The sample trained a second time earliest in the run (by step, then position), with
    the step of its first training, and how many samples were trained more than once. Rows
    of a duplicated step count as trained twice too."""
    names = pc.cast(table["file"], pa.string()).combine_chunks().dictionary_encode()
    file_id = names.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    epoch, row, position = _ints(table, "epoch"), _ints(table, "row"), _ints(table, "position")
    # By sample, then in training order: a sample's repeats follow its first training.
    order = np.lexsort((position, step, row, file_id, epoch))
    e, f, r = epoch[order], file_id[order], row[order]
    repeat = np.r_[False, (e[1:] == e[:-1]) & (f[1:] == f[:-1]) & (r[1:] == r[:-1])]
    again = np.flatnonzero(repeat)
    if len(again) == 0:
        return None, 0
    count = int(np.sum(repeat[1:] & ~repeat[:-1]))  # a sample trained 3 times counts once
    # The earliest repeat of all is a second training: its first is the row before it.
    k = again[np.lexsort((position[order][again], step[order][again]))[0]]
    first, second = order[k - 1], order[k]
    return Twice(epoch=int(epoch[second]), file=str(names.dictionary[file_id[second]]),
                 row=int(row[second]), first_step=int(step[first]),
                 second_step=int(step[second])), count
