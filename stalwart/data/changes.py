"""On resume: have a stream's files changed since the checkpoint? Its order depends on them.

The manifest's `data` entry (FileStream.identity) lists the patterns, and each file with its
size and version. The files are listed again from the same patterns and compared: a file
added, removed or rewritten refuses the resume, naming the files, unless
`data.accept_changed_files` asks to go on in the order of the new list.
"""

from __future__ import annotations

from typing import Any

from stalwart.core.errors import DataError
from stalwart.data.sources import (
    ArrowFormat,
    LinesFormat,
    ParquetFormat,
    list_files,
    stat_file,
)

_SUFFIXES = {"parquet": ParquetFormat.suffixes, "arrow": ArrowFormat.suffixes,
             "json": LinesFormat("json").suffixes, "text": LinesFormat("text").suffixes}
_SHOWN = 5


def changed_files(recorded: dict[str, Any]) -> dict[str, list[str]]:
    """{"added": [...], "removed": [...], "rewritten": [...]} against the recorded files."""
    before = {url: (size, version) for url, size, version in recorded.get("files", [])}
    suffixes = _SUFFIXES.get(recorded.get("format", ""))
    now: dict[str, tuple[int, str]] = {}
    if suffixes is not None:
        try:
            infos = list_files(recorded.get("patterns", []), suffixes, what="data")
        except DataError:
            infos = []  # every file is gone: each one is reported as removed
        now = {i.url: (i.size, i.version) for i in infos}
    else:  # files named one by one (a Ray Data source): only these can change
        for url in before:
            stat = stat_file(url)
            if stat is not None:
                now[url] = stat
    return {"added": sorted(set(now) - set(before)),
            "removed": sorted(set(before) - set(now)),
            "rewritten": sorted(u for u in set(now) & set(before)
                                if tuple(now[u]) != tuple(before[u]))}


def check_data_files(manifest: dict[str, Any], *, accept: bool) -> list[str]:
    """Refuse (DataError) a resume whose stream files changed, unless `accept`; returns the
    changes as lines for the run's log (empty when nothing changed)."""
    recorded = manifest.get("data")
    if not recorded:
        return []
    changes = changed_files(recorded)
    lines = [f"{len(files)} {kind}: {', '.join(files[:_SHOWN])}"
             + (f" and {len(files) - _SHOWN} more" if len(files) > _SHOWN else "")
             for kind, files in changes.items() if files]
    if lines and not accept:
        raise DataError(f"the data files changed since checkpoint step {manifest.get('step')} "
                        f"({'; '.join(lines)}): the sample order depends on them, so the "
                        f"resume would not continue the same order. Restore the files, or "
                        f"set data.accept_changed_files = true to go on in the new order")
    return lines
