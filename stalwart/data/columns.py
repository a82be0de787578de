"""From decoded units to a batch: gathering a batch's rows and turning columns into tensors.

A unit is decoded once, on a reading thread, into numpy views of its dense columns (numbers,
and fixed-size lists of numbers). A batch then gathers its rows from them with one numpy
index per unit and column, straight into fresh arrays that become tensors without a copy.
Other columns (strings, lists of any length) go through Arrow, only when a batch needs them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from stalwart.core.errors import DataError


@dataclass(frozen=True)
class DecodedUnit:
    table: pa.Table
    dense: dict[str, np.ndarray]
    """The dense columns as numpy arrays, rows first (a fixed-size list is 2-D)."""


def decode(table: pa.Table) -> DecodedUnit:
    return DecodedUnit(table, {name: _dense(column) for name, column in
                               zip(table.column_names, table.columns, strict=True)
                               if is_dense(column.type)})


def is_dense(kind: pa.DataType) -> bool:
    if pa.types.is_fixed_size_list(kind):
        return _is_number(kind.value_type)
    return _is_number(kind) or pa.types.is_boolean(kind)


def is_number_list(kind: pa.DataType) -> bool:
    """A list of numbers of any length: a tensor when a batch's lists have one length."""
    return (pa.types.is_list(kind) or pa.types.is_large_list(kind)) \
        and _is_number(kind.value_type)


def _is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def _dense(column: pa.ChunkedArray) -> np.ndarray:
    # One chunk (a row group's column) is viewed, not copied: combine_chunks would copy it.
    array = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    if pa.types.is_fixed_size_list(array.type):
        values = array.flatten().to_numpy(zero_copy_only=False)
        return values.reshape(len(array), array.type.list_size)
    return array.to_numpy(zero_copy_only=False)


def gather(decoded: dict[int, DecodedUnit], units: np.ndarray, rows: np.ndarray, *,
           others: list[str]) -> dict[str, Any]:
    """Columns of rows (units[i], rows[i]) in that order: every dense column, and `others`
    (numpy arrays for the dense ones, a list or 2-D array for the rest)."""
    n = len(units)
    order = np.argsort(units, kind="stable")
    sorted_rows = rows[order]
    present, starts = np.unique(units[order], return_index=True)
    spans = list(zip(present.tolist(), starts.tolist(), [*starts[1:].tolist(), n],
                     strict=True))
    template = decoded[spans[0][0]]
    out: dict[str, Any] = {}
    for name, first in template.dense.items():
        dest = np.empty((n, *first.shape[1:]), dtype=first.dtype)
        for u, lo, hi in spans:
            dest[order[lo:hi]] = decoded[u].dense[name][sorted_rows[lo:hi]]
        out[name] = dest
    if others:
        pieces = [decoded[u].table.select(others).take(pa.array(sorted_rows[lo:hi]))
                  for u, lo, hi in spans]
        inverse = np.empty(n, dtype=np.int64)
        inverse[order] = np.arange(n)
        table = pa.concat_tables(pieces).take(pa.array(inverse))
        for name, column in zip(table.column_names, table.columns, strict=True):
            out[name] = (_number_lists(column) if is_number_list(column.type)
                         else column.to_pylist())
    return {name: out[name] for name in template.table.column_names if name in out}


def _number_lists(column: pa.ChunkedArray) -> np.ndarray | list[np.ndarray]:
    """Lists of one length as a 2-D array; lists of several lengths as a list of arrays."""
    array = column.combine_chunks()
    lengths = array.value_lengths().to_numpy(zero_copy_only=False)
    values = array.flatten().to_numpy(zero_copy_only=False)
    if len(lengths) and (lengths == lengths[0]).all():
        return values.reshape(len(lengths), int(lengths[0]))
    return np.split(values, np.cumsum(lengths)[:-1])


def numeric_batch(columns: dict[str, Any], schema: pa.Schema, what: str
                  ) -> dict[str, torch.Tensor]:
    """The default batch: every numeric column, and every list of numbers of one length in the
    batch, as a tensor (the arrays are the batch's own, so no copy is made)."""
    out = {name: torch.from_numpy(np.require(value, requirements=["C", "W"]))
           for name, value in columns.items() if isinstance(value, np.ndarray)}
    if not out:
        kinds = ", ".join(f"{f.name}: {f.type}" for f in schema)
        raise DataError(f"{what}: no numeric column to batch (columns: {kinds}); pass "
                        f"transform= to turn rows into tensors (docs/data.md)")
    return out
