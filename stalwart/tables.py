"""The CLI's tables (status, report, sweep results), laid out by rich and printed as plain text.

Plain, because these are read in terminals, logs and pipes alike: no colour codes, no box
characters, and no wrapping, so a path or a command stays on one line that can be copied;
trailing spaces are trimmed. Every cell is literal text (a `[` in a path is not markup).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Sequence
from typing import Any

from rich.console import Console, RenderableType
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

WIDE = 100_000
"""Columns to lay out in: wide enough that no line is ever wrapped."""


def render(renderable: RenderableType) -> str:
    """`renderable` as plain text, each line's trailing spaces trimmed."""
    out = io.StringIO()
    Console(file=out, width=WIDE, color_system=None, force_terminal=False, emoji=False,
            highlight=False, markup=False, soft_wrap=False).print(renderable)
    return "\n".join(line.rstrip() for line in out.getvalue().splitlines())


def key_values(rows: Iterable[tuple[str, str]], *, indent: int = 0, gap: int = 2,
               key_width: int | None = None) -> str:
    """Two columns, names then values, `gap` spaces apart, each line indented. `key_width`:
    the names' column at least this wide (to line up with another table's)."""
    grid = Table.grid(padding=(0, gap, 0, 0))
    grid.add_column(no_wrap=True, min_width=key_width)
    grid.add_column(no_wrap=True)
    for key, value in rows:
        grid.add_row(Text(key), Text(value))
    return render(Padding(grid, (0, 0, 0, indent)) if indent else grid)


def columns(headers: Sequence[str], rows: Iterable[Sequence[str]], *, indent: int = 0) -> str:
    """A table with a header line, columns two spaces apart."""
    table = Table(box=None, padding=(0, 2, 0, 0), pad_edge=False, show_edge=False,
                  header_style="none")
    for header in headers:
        table.add_column(Text(header), no_wrap=True)
    for row in rows:
        table.add_row(*(Text(cell) for cell in row))
    return render(Padding(table, (0, 0, 0, indent)) if indent else table)


def cell(value: Any) -> str:
    """A value as a table cell: a float in 4 significant digits, nothing (or NaN) as -."""
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.4g}"
    return "-" if value is None else str(value)
