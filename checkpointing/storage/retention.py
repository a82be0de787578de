"""Which committed checkpoints a run keeps: the newest `keep_last` that verify, and with
`keep_best` the best N by a metric recorded in their manifests. Rank 0 applies it after
each commit; everything else in the storage is deleted.

Never drops the checkpoint just committed or any step above it (a newer step there is from a
timeline the run left, e.g. a damaged checkpoint it resumed past: not this commit's to
judge), and a damaged checkpoint never counts as kept, so retention cannot leave only damaged
ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.catalog import list_step_dirs, read_checkpoint, verify
from stalwart.checkpointing.storage.layout import filesystem, join, step_dir_name
from stalwart.checkpointing.storage.signing import CheckpointTrust


@dataclass(frozen=True)
class BestRule:
    """checkpoint.keep_best, best_metric and best_mode: keep the `count` checkpoints whose
    manifest's `metrics[metric]` is lowest (mode "min") or highest ("max")."""

    count: int
    metric: str
    mode: str = "min"


def apply_retention(url: str, keep_last: int, newest: int, trust: CheckpointTrust,
                    verified: dict[int, float] | None = None,
                    best: BestRule | None = None) -> None:
    """Keep the newest `keep_last` checkpoints that verify, counting from `newest` (the one
    just committed) down, and the `best` ones; drop the rest below `newest`, and stale
    partial writes. `verified`: step -> manifest time of checkpoints already verified (a
    cache the caller keeps, so each checkpoint's files are hashed once, not at every
    commit). A checkpoint counts as kept only if `trust` accepts it."""
    cache = {} if verified is None else verified
    if keep_last <= 0:  # keep every commit; only stale partial writes go
        doomed = [s for s, done in list_step_dirs(url) if not done and s < newest]
    else:
        kept_best = best_steps(url, newest, best, trust, cache) if best else set()
        doomed = _older_than_kept(url, keep_last, newest, trust, cache, kept_best)
    fs, _ = filesystem(url)
    for step in doomed:
        fs.rm(filesystem(join(url, step_dir_name(step)))[1], recursive=True)


def best_steps(url: str, newest: int, best: BestRule, trust: CheckpointTrust,
               verified: dict[int, float]) -> set[int]:
    """The steps of the `best.count` best checkpoints at or below `newest` that verify and
    recorded a finite value of the metric; a tie goes to the newer step."""
    scored = []
    for step, done in list_step_dirs(url):
        if not done or step > newest:
            continue
        try:
            metrics = read_checkpoint(url, step).manifest.get("metrics")
        except CheckpointError:
            continue
        # Storage writes the manifest: anything but a table of numbers ranks as unmeasured.
        value = metrics.get(best.metric) if isinstance(metrics, dict) else None
        if isinstance(value, int | float) and math.isfinite(value):
            scored.append((value if best.mode == "min" else -value, -step))
    kept: set[int] = set()
    for _, negative_step in sorted(scored):
        if len(kept) == best.count:
            break
        if _verifies(url, -negative_step, trust, verified):
            kept.add(-negative_step)
    return kept


def _older_than_kept(url: str, keep_last: int, newest: int, trust: CheckpointTrust,
                     verified: dict[int, float], best: set[int]) -> list[int]:
    dirs = [(s, done) for s, done in list_step_dirs(url) if s < newest]
    kept = 1  # `newest` itself: committed just now, from the files as they are
    doomed = []
    for step, done in reversed(dirs):
        if done and step in best:  # kept as one of the best, whatever its age
            kept += kept < keep_last  # and one of the newest too, while those last
            continue
        if kept >= keep_last or not done:
            doomed.append(step)  # older than every kept checkpoint, or a stale partial write
        elif _verifies(url, step, trust, verified):
            kept += 1
        # A damaged checkpoint between kept ones stays until it falls behind them.
    return doomed


def _verifies(url: str, step: int, trust: CheckpointTrust, verified: dict[int, float]
              ) -> bool:
    try:
        info = read_checkpoint(url, step)
        if verified.get(step) != info.manifest.get("time"):
            verify(info, trust)
            verified[step] = info.manifest.get("time")
        return True
    except CheckpointError:
        verified.pop(step, None)
        return False
