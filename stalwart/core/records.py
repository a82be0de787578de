"""Reading a run's JSONL record files back, checked line by line.

A writer appends one JSON object per line and flushes it (stalwart.run_dir.JsonlLog), so the
only damage a crash can leave is a last line cut short, with no newline after it: that line
is left out. Anything else (a damaged line before the last, a line that is not a JSON
object, bytes that are not UTF-8 text, a record whose field is missing or of the wrong type)
is a `RecordError` naming the file and the line: numbers computed from a record with a
silent hole in it would look right and be wrong.

`record(cls, row)` checks a row against a frozen dataclass's type hints before building it:
int, float (finite unless the field may hold NaN), str, bool, `X | None`, `list[X]`,
`tuple[X, ...]`, `dict[str, X]`, `Any` and nested dataclasses.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from stalwart.core.errors import RecordError

T = TypeVar("T")


def read_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of every line of a JSONL file; [] if there is no file.

    A last line without a newline that does not parse is a write cut short: left out.
    """
    if not path.exists():
        return []
    if not path.is_file():
        raise RecordError(f"{path} is not a file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RecordError(f"{path}: cannot read it: {exc.strerror or exc}") from None
    lines = data.split(b"\n")
    partial = lines.pop()  # b"" when the file ends with a newline, as every whole line does
    rows = [(n, _parse(path, n, raw)) for n, raw in enumerate(lines, 1) if raw.strip()]
    if partial.strip():
        n = len(lines) + 1
        try:
            text = partial.decode()
            json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError):
            return rows  # the writer was stopped mid-line
        rows.append((n, _parse(path, n, partial)))
    return rows


def _parse(path: Path, n: int, raw: bytes) -> dict[str, Any]:
    where = f"{path} line {n}"
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        raise RecordError(f"{where} is not UTF-8 text (a binary file?); each line must be "
                          f"one JSON object") from None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RecordError(f"{where} is damaged: not JSON ({exc.msg} at column {exc.colno}); "
                          f"each line must be one JSON object") from None
    if not isinstance(row, dict):
        raise RecordError(f"{where} is a JSON {_json_type(row)}, not an object; each line "
                          f"must be one JSON object")
    return row


def record(cls: type[T], row: dict[str, Any], *, where: str,
           required: tuple[str, ...] = (), may_be_nan: frozenset[str] = frozenset()) -> T:
    """`cls` built from a row whose every field is checked first: present unless it has a
    default (or is `required` anyway), and of its declared type. Unknown keys are ignored
    (a newer stalwart's). `may_be_nan` names float fields that may hold NaN or infinity."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in row:
            no_default = (f.default is dataclasses.MISSING
                          and f.default_factory is dataclasses.MISSING)
            if no_default or f.name in required:
                raise RecordError(f"{where} has no field {f.name!r}")
            continue
        kwargs[f.name] = _value(hints[f.name], row[f.name], f"{where}: field {f.name}",
                                f.name in may_be_nan)
    return cls(**kwargs)


def _value(hint: Any, value: Any, where: str, nan_ok: bool) -> Any:
    """`value` as `hint` (nested dataclasses built, lists as tuples where declared), or a
    RecordError saying what was expected."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _value(inner, value, where, nan_ok)
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, dict):
            raise _wrong(where, value, "an object")
        return record(hint, value, where=where)  # type: ignore[arg-type]
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise _wrong(where, value, "a list")
        items = [_value(args[0], v, f"{where}[{i}]", nan_ok) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise _wrong(where, value, "an object")
        return {k: _value(args[1], v, f"{where}.{k}", nan_ok) for k, v in value.items()}
    if hint is bool:
        if not isinstance(value, bool):
            raise _wrong(where, value, "true or false")
    elif hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise _wrong(where, value, "an integer")
    elif hint is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise _wrong(where, value, "a number")
        if not nan_ok and not math.isfinite(value):
            raise _wrong(where, value, "a finite number")
    elif hint is str:
        if not isinstance(value, str):
            raise _wrong(where, value, "a string")
    # Any other type a field may get later is taken as it is, unchecked, never refused.
    return value


def _wrong(where: str, value: Any, expected: str) -> RecordError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return RecordError(f"{where} is {shown}, expected {expected}")


def _json_type(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    return {list: "array", str: "string", int: "number", float: "number"}.get(
        type(value), type(value).__name__)
