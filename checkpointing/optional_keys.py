"""Keys of the training state that a checkpoint may lack: the loader keeps its own (fresh)
values for them rather than refusing the checkpoint. DCP refuses any requested key the
checkpoint does not hold, so they are taken out of the request first."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

# (table, key): state an earlier stalwart did not save.
ADDED_LATER = (("train", "numerics"),)
# Whole tables whose keys are each optional: gradient compression's state ("comm") holds
# one rank's error feedback per key, and a checkpoint of another world (or one written
# without compression) lacks some or all of them.
OPTIONAL_TABLES = ("comm",)


def drop_keys_it_lacks(state: dict[str, Any], held: Container[str]) -> None:
    """Take out of `state` the optional keys whose flattened names `held` lacks."""
    for table, key in ADDED_LATER:
        inner = state.get(table)
        if isinstance(inner, dict) and key in inner and f"{table}.{key}" not in held:
            del inner[key]
    for table in OPTIONAL_TABLES:
        inner = state.get(table)
        if isinstance(inner, dict):
            for key in [k for k in inner if f"{table}.{k}" not in held]:
                del inner[key]
