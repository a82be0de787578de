"""Finding and validating storage checkpoints from the driver (no process group needed)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.layout import (
    FORMAT_VERSION,
    MANIFEST,
    filesystem,
    join,
    parse_step_dir,
    sha256_of,
    step_dir_name,
)


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: str
    """URL of the step directory."""
    manifest: dict[str, Any]

    def files_in_commit_order(self) -> list[str]:
        """Every file of the step directory, the manifest last: a copy made in this order
        is committed only once all its data is there (the manifest is the commit)."""
        return [*sorted(self.manifest["files"]), MANIFEST]


def list_step_dirs(url: str) -> list[tuple[int, bool]]:
    """(step, committed) for every step directory under `url`, oldest first."""
    fs, root = filesystem(url)
    if not fs.exists(root):
        return []
    out = []
    for info in fs.ls(root, detail=True):
        step = parse_step_dir(info["name"])
        if step is None or info["type"] != "directory":
            continue
        out.append((step, fs.exists(f"{info['name'].rstrip('/')}/{MANIFEST}")))
    return sorted(out)


def read_checkpoint(url: str, step: int) -> CheckpointInfo:
    return read_step_dir(join(url, step_dir_name(step)), step=step)


def read_step_dir(path: str, *, step: int | None = None) -> CheckpointInfo:
    """The committed checkpoint in the step directory `path` (its step from the manifest
    unless the directory's name gives it)."""
    fs, root = filesystem(path)
    where = f"step {step} under {path.rsplit('/', 1)[0]!r}" if step is not None else repr(path)
    try:
        with fs.open(f"{root}/{MANIFEST}", "r") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {where} is not committed (no {MANIFEST})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} is damaged: {exc}") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path!r}: manifest format "
                              f"{manifest.get('format')!r}, expected {FORMAT_VERSION}")
    if step is None:
        step = manifest.get("step")
        if not isinstance(step, int):
            raise CheckpointError(f"checkpoint {path!r}: {MANIFEST} names no step")
    return CheckpointInfo(step=step, path=path, manifest=manifest)


def committed_checkpoints(url: str) -> list[CheckpointInfo]:
    return [read_checkpoint(url, step) for step, done in list_step_dirs(url) if done]


def verify(info: CheckpointInfo) -> None:
    """Check every file's size and sha256 against the manifest; raise naming the first mismatch."""
    fs, root = filesystem(info.path)
    for name, meta in info.manifest["files"].items():
        path = f"{root}/{name}"
        if not fs.exists(path):
            raise CheckpointError(f"checkpoint {info.path!r}: file {name} is missing")
        if fs.size(path) != meta["size"] or sha256_of(fs, path) != meta["sha256"]:
            raise CheckpointError(f"checkpoint {info.path!r}: file {name} is damaged "
                                  f"(size or sha256 differs from the manifest)")


def newest_valid(url: str, *, on_skip=None) -> CheckpointInfo | None:
    """The newest committed checkpoint that verifies; damaged ones are skipped and reported."""
    for step, done in reversed(list_step_dirs(url)):
        if not done:
            continue
        try:
            info = read_checkpoint(url, step)
            verify(info)
            return info
        except CheckpointError as exc:
            if on_skip is not None:
                on_skip(step, str(exc))
    return None


def find_step(url: str, step: int) -> CheckpointInfo:
    """A specific committed, verified checkpoint; the error lists the steps that exist."""
    steps = [s for s, done in list_step_dirs(url) if done]
    if step not in steps:
        raise CheckpointError(f"no committed checkpoint for step {step} under {url!r}; "
                              f"committed steps: {steps or 'none'}")
    info = read_checkpoint(url, step)
    verify(info)
    return info
