"""What a task's own metric may be called: it becomes a column of metrics.jsonl, a Tune
metric and a TensorBoard tag, so it must not collide with the columns every row has."""

from __future__ import annotations

import re
from typing import Any

from stalwart.core.errors import TaskError

METRIC_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*")
RESERVED = frozenset({"step", "loss", "lr", "tokens_per_s", "world_size", "samples_seen",
                      "time", "window_s", "steps_in_window"})
"""Columns every metrics.jsonl row already has."""


def check_metric_name(name: Any) -> None:
    """A plain identifier, not one of RESERVED, and not `val_...` (validation adds that prefix
    itself); else a TaskError naming what is allowed."""
    if not isinstance(name, str) or not METRIC_NAME.fullmatch(name):
        raise TaskError(f"metric name {name!r} is invalid: letters, digits and _, starting "
                        f"with a letter")
    if name in RESERVED or name.startswith("val_"):
        raise TaskError(f"metric name {name!r} is taken: not {', '.join(sorted(RESERVED))}, "
                        f"and not val_... (validation metrics get that prefix)")


def is_task_metric(name: Any) -> bool:
    """Whether `name` can be a column a task's metrics add: a metric's own name, or
    `val_<name>` for its validation mean."""
    if not isinstance(name, str):
        return False
    try:
        check_metric_name(name[4:] if name.startswith("val_") else name)
    except TaskError:
        return False
    return True
