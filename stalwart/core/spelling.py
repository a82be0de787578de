""""Did you mean ...?" for a name that is not one of the allowed ones: a config key, a
command, a sweep file's key. A typo is then fixed from the error line alone."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


def closest(name: str, allowed: Iterable[str]) -> str | None:
    """The allowed name closest to `name`, if one is close enough to be the one meant."""
    matches = difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, allowed: Iterable[str], *, prefix: str = "") -> str:
    """`"did you mean PREFIX+X? "` for the closest allowed name, or "" when none is close
    (`prefix` names its section, as the error names the key): goes before the list of
    what is allowed."""
    match = closest(name, allowed)
    return f"did you mean {prefix}{match}? " if match is not None else ""
