"""Asynchronous storage checkpoints with torch.distributed.checkpoint (DCP) to any fsspec URL.

With the memory tier on, a storage checkpoint is written from the staged snapshot
(`save_snapshot`): one copy of the snapshot's buffer, then DCP writes from that copy on the
background thread; the model is not read a second time.

Every rank writes its own shard; training goes on while the write runs on a background
thread over a process group of its own (a second gloo group: a checkpoint's collectives
must never interleave with the training step's on the same group). When the write is
complete everywhere, rank 0 writes the manifest (the commit point) and applies `keep_last`.
At most one save is in flight: starting the next one waits for the previous, which bounds
the memory held by staged copies to one checkpoint.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.snapshot import Shard
from stalwart.checkpointing.snapshot_planner import SnapshotSavePlanner
from stalwart.checkpointing.storage.catalog import list_step_dirs
from stalwart.checkpointing.storage.layout import (
    FORMAT_VERSION,
    MANIFEST,
    filesystem,
    join,
    sha256_of,
    step_dir_name,
)


@dataclass(frozen=True)
class CommitReport:
    """A storage checkpoint is complete and visible (its manifest is written)."""

    step: int
    path: str
    save_s: float
    """Seconds from the start of the save to the manifest being written."""


def write_manifest(url: str, step: int, extra: dict[str, Any]) -> None:
    """Commit a fully written checkpoint directory: checksums of every file, then the manifest."""
    fs, root = filesystem(join(url, step_dir_name(step)))
    files = {}
    for info in fs.ls(root, detail=True):
        name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        # A stale manifest.json.tmp is left by a commit that crashed before its rename.
        if name in (MANIFEST, f"{MANIFEST}.tmp") or info["type"] != "file":
            continue
        files[name] = {"size": int(info["size"]), "sha256": sha256_of(fs, info["name"])}
    manifest = {"format": FORMAT_VERSION, "step": step, "time": time.time(), "files": files,
                **extra}
    tmp = f"{root}/{MANIFEST}.tmp"
    with fs.open(tmp, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    # A rename is atomic on local and POSIX-like filesystems; on object stores mv is a
    # copy+delete of one small object, and readers ignore the .tmp name either way.
    fs.mv(tmp, f"{root}/{MANIFEST}")


def apply_retention(url: str, keep_last: int, newest: int) -> None:
    """Keep the newest `keep_last` committed checkpoints; drop older ones and stale partial writes."""
    fs, _ = filesystem(url)
    dirs = list_step_dirs(url)
    committed = [step for step, done in dirs if done]
    keep = set(committed[-keep_last:]) if keep_last > 0 else set(committed)
    for step, done in dirs:
        # Partial directories newer than the newest commit may be a save in flight: leave them.
        if step in keep or step > newest or (keep_last == 0 and done):
            continue
        fs.rm(filesystem(join(url, step_dir_name(step)))[1], recursive=True)


class StorageCheckpointer:
    def __init__(self, url: str, *, rank: int, keep_last: int, async_save: bool,
                 manifest_extra: dict[str, Any]) -> None:
        self.url = url
        self.rank = rank
        self.keep_last = keep_last
        self.async_save = async_save
        self.manifest_extra = manifest_extra
        # A group of its own for checkpoint collectives (see module docstring).
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")
        self._pending: Future[CommitReport | None] | None = None
        self._persist_buffer: torch.Tensor | None = None

    def save(self, step: int, state: dict[str, Any]) -> list[CommitReport]:
        """Start writing `state` as step `step`; returns commits that completed meanwhile."""
        done = self.wait()
        t0 = time.perf_counter()
        path = join(self.url, step_dir_name(step))
        writer = FsspecWriter(path)
        no_dist = self.group is None
        if self.async_save:
            fut = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                 no_dist=no_dist)
            self._pending = self._finisher.submit(self._commit, step, t0, fut)
        else:
            dcp.save(state, storage_writer=writer, process_group=self.group, no_dist=no_dist)
            report = self._commit(step, t0, None)
            if report is not None:
                done.append(report)
        return done

    def save_snapshot(self, shard: Shard) -> list[CommitReport]:
        """Start writing a staged snapshot; returns commits that completed meanwhile.

        The snapshot's buffer is copied first (its buffer is reused two snapshots later,
        and a write may take longer than that); the copy's buffer is reused between saves.
        """
        done = self.wait()
        t0 = time.perf_counter()
        shard.ready()
        buf = self._persist_buffer
        if buf is None or buf.numel() != shard.buffer.numel():
            buf = self._persist_buffer = torch.empty_like(shard.buffer, pin_memory=False)
        buf.copy_(shard.buffer)
        copy = Shard(step=shard.step, layout=shard.layout, buffer=buf, values=dict(shard.values))
        path = join(self.url, step_dir_name(shard.step))

        def write() -> None:
            dcp.save({}, storage_writer=FsspecWriter(path), planner=SnapshotSavePlanner(copy),
                     process_group=self.group, no_dist=self.group is None)

        if self.async_save:
            write_done = self._finisher.submit(write)
            self._pending = self._finisher.submit(self._commit, shard.step, t0, write_done)
        else:
            write()
            report = self._commit(shard.step, t0, None)
            if report is not None:
                done.append(report)
        return done

    def _commit(self, step: int, t0: float, fut: Future | None) -> CommitReport | None:
        if fut is not None:
            fut.result()  # re-raises a failed write on this rank
        if self.rank != 0:
            return None
        # DCP's coordinator (rank 0) finishes only after every rank's write result reached
        # it and .metadata is written, so all shards are on storage at this point.
        write_manifest(self.url, step, self.manifest_extra)
        apply_retention(self.url, self.keep_last, newest=step)
        return CommitReport(step=step, path=join(self.url, step_dir_name(step)),
                            save_s=time.perf_counter() - t0)

    def poll(self) -> list[CommitReport]:
        """Commits completed since the last call, without blocking."""
        if self._pending is not None and self._pending.done():
            return self.wait()
        return []

    def wait(self) -> list[CommitReport]:
        """Block until the save in flight (if any) is committed."""
        if self._pending is None:
            return []
        pending, self._pending = self._pending, None
        report = pending.result()
        return [report] if report is not None else []

    def load(self, path: str, state: dict[str, Any]) -> None:
        """Load a committed checkpoint into `state` in place, resharding to this world."""
        try:
            dcp.load(state, storage_reader=FsspecReader(path), process_group=self.group,
                     no_dist=self.group is None)
        except Exception as exc:  # DCP raises a variety of types for a mismatched model
            raise CheckpointError(f"checkpoint {path!r} does not fit this task's model or "
                                  f"optimizer: {type(exc).__name__}: {exc}") from exc

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._finisher.shutdown(wait=True)
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None
