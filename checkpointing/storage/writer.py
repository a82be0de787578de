"""Asynchronous storage checkpoints with torch.distributed.checkpoint (DCP) to any fsspec URL.

With the memory tier on, a storage checkpoint is written from the staged snapshot
(`save_snapshot`): one copy of the snapshot's buffer, then DCP writes from that copy on the
background thread; the model is not read a second time.

Every rank writes its own shard; training goes on while the write runs on a background
thread over a process group of its own (a second gloo group: a checkpoint's collectives
must never interleave with the training step's on the same group). When the write is
complete everywhere, rank 0 writes the manifest (the commit point) and applies `keep_last`.
Each rank hashes its files as it writes them (storage/hashing.py) and the digests reach rank 0
with DCP's write results, so the commit reads no file back: its time does not grow with the
world or the checkpoint's size.
At most one save is in flight: starting the next one waits for the previous, which bounds
the memory held by staged copies to one checkpoint.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from stalwart.checkpointing.errors import CheckpointError, describe_load_error
from stalwart.checkpointing.optional_keys import drop_keys_it_lacks
from stalwart.checkpointing.safe_load import FileTable, SafeLoadPlanner, VerifiedReader
from stalwart.checkpointing.snapshot import Shard
from stalwart.checkpointing.snapshot_planner import SnapshotSavePlanner
from stalwart.checkpointing.storage.commit_report import CommitReport
from stalwart.checkpointing.storage.hashing import FileDigest, HashingWriter
from stalwart.checkpointing.storage.layout import (
    EXPORT_PREFIX,
    FORMAT_VERSION,
    MANIFEST,
    METADATA,
    base_name,
    check_file_name,
    data_file_rank,
    filesystem,
    join,
    sha256_of,
    step_dir_name,
    write_manifest_file,
)
from stalwart.checkpointing.storage.retention import BestRule, apply_retention
from stalwart.checkpointing.storage.signing import (
    CheckpointTrust,
    SigningKey,
    sign,
)

_log = logging.getLogger(__name__)


def write_manifest(url: str, step: int, extra: dict[str, Any], *, key: SigningKey,
                   ranks: int | None = None, digests: dict[str, FileDigest] | None = None
                   ) -> list[str]:
    """Commit a fully written checkpoint directory: size and sha256 of every file, then the
    manifest, signed with `key`. Returns the names of the files hashed by reading them.

    `ranks`: how many ranks wrote the checkpoint; each must have left its data file, or the
    checkpoint is not committed (default: the ranks whose data files are there).
    `digests`: what this save's writers hashed as they wrote. Given, the manifest signs
    exactly those files: a file the directory holds that no writer wrote (planted during the
    save), or one whose size is not the size written (swapped), fails the commit, and
    nothing is read back. Without it (checkpoints made by hand, tests, bench/commit.py)
    every file found is read and hashed."""
    where = join(url, step_dir_name(step))
    fs, root = filesystem(where)
    # A stale manifest.json.tmp is left by a commit that crashed before its rename.
    found = {n: i for n, i in _listing(fs, root).items()
             if n not in (MANIFEST, f"{MANIFEST}.tmp")}
    if digests is None:
        files = {n: {"size": int(i["size"]), "sha256": sha256_of(fs, i["name"])}
                 for n, i in found.items() if i["type"] == "file"}
        read_back = sorted(files)
    else:
        files, read_back = _written_files(found, digests, where), []
    written = {r for r in map(data_file_rank, files) if r is not None}
    if ranks is None:
        ranks = max(written) + 1 if written else 1
    missing = ([METADATA] if METADATA not in files else []) + [
        f"__{r}_0.distcp" for r in range(ranks) if r not in written]
    if missing:
        raise CheckpointError(f"checkpoint {where!r} is incomplete after its write: no "
                              f"{', '.join(missing)}; not committed")
    manifest = sign({"format": FORMAT_VERSION, "step": step, "time": time.time(),
                     "files": files, **extra, "ranks": ranks}, key)
    write_manifest_file(fs, root, manifest)
    return read_back


def _written_files(found: dict[str, dict[str, Any]], digests: dict[str, FileDigest],
                   where: str) -> dict[str, dict[str, Any]]:
    """The manifest's file table: every file the writers wrote, as they wrote it, provided
    the directory holds exactly those files at those sizes."""
    extra = sorted(set(found) - set(digests))
    if extra:
        raise CheckpointError(f"checkpoint {where!r}: the step directory holds "
                              f"{', '.join(extra)}, which this save did not write (put there "
                              f"during the save); not committed, nothing signed")
    gone = sorted(set(digests) - set(found))
    changed = sorted(n for n, d in digests.items() if n in found
                     and (found[n]["type"] != "file" or int(found[n]["size"]) != d.size))
    if gone or changed:
        raise CheckpointError(f"checkpoint {where!r}: "
                              + "; ".join(f"{what} {', '.join(names)}" for what, names in
                                          (("missing after its write:", gone),
                                           ("another size than written:", changed)) if names)
                              + "; not committed, nothing signed")
    return {n: {"size": d.size, "sha256": d.sha256} for n, d in digests.items()}


def clear_step_dir(url: str, step: int) -> tuple[str, ...]:
    """Empty step's directory before a save writes into it: whatever it holds (an earlier
    attempt's files, or planted ones) must not end up signed. Returns the names removed."""
    fs, root = filesystem(join(url, step_dir_name(step)))
    if not fs.exists(root):
        return ()
    if not fs.isdir(root):  # a file where the directory goes
        fs.rm(root)
        return (base_name(root),)
    # The entries, not the directory: the other ranks create it (exist_ok) as their save
    # starts, before its first collective, and one that found it vanishing under it fails.
    listing = _listing(fs, root)
    for info in listing.values():
        fs.rm(info["name"], recursive=info.get("type") == "directory")
    return tuple(sorted(listing))


def _listing(fs: Any, root: str) -> dict[str, dict[str, Any]]:
    """A step directory's entries by name, with fsspec's details (type, size)."""
    return {base_name(info["name"]): info for info in fs.ls(root, detail=True)}


class StorageCheckpointer:
    def __init__(self, url: str, *, rank: int, keep_last: int, async_save: bool,
                 manifest_extra: dict[str, Any], trust: CheckpointTrust | None,
                 keep_best: BestRule | None = None,
                 export_files: dict[str, bytes] | None = None) -> None:
        """`trust`: on rank 0, the key commits are signed with and what retention keeps; a
        commit names `trust.run_id` as the run that wrote it. Other ranks never sign: None.
        `keep_best`: also keep the best checkpoints by a metric their manifests record (see
        storage/retention.py).
        `export_files`: what an exporter needs besides the weights (a Hugging Face
        config.json, a tokenizer), written by rank 0 into every checkpoint as
        `export.<name>` so the manifest signs them with the weights."""
        self.url = url
        self.trust = trust
        self.rank = rank
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.export_files = {f"{EXPORT_PREFIX}{check_file_name(name)}": data
                             for name, data in (export_files or {}).items()}
        self.async_save = async_save
        self.manifest_extra = manifest_extra
        # A group of its own for checkpoint collectives (see module docstring).
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-commit")
        self._pending: Future[CommitReport | None] | None = None
        self._persist_buffer: torch.Tensor | None = None
        self._verified: dict[int, float] = {}  # retention's cache: step -> manifest time

    def save(self, step: int, state: dict[str, Any], metrics: dict[str, float] | None = None
             ) -> list[CommitReport]:
        """Start writing `state` as step `step`; returns commits that completed meanwhile.
        `metrics`: the step's metrics, recorded in the manifest (what keep_best ranks)."""
        done = self.wait()
        t0 = time.perf_counter()
        cleared = self._clear(step)
        path = join(self.url, step_dir_name(step))
        writer = HashingWriter(path)
        no_dist = self.group is None
        if self.async_save:
            fut = dcp.async_save(state, storage_writer=writer, process_group=self.group,
                                 no_dist=no_dist)
            self._pending = self._finisher.submit(self._commit, step, t0, writer, fut,
                                                  metrics, cleared)
        else:
            dcp.save(state, storage_writer=writer, process_group=self.group, no_dist=no_dist)
            report = self._commit(step, t0, writer, None, metrics, cleared)
            if report is not None:
                done.append(report)
        return done

    def save_snapshot(self, shard: Shard, metrics: dict[str, float] | None = None
                      ) -> list[CommitReport]:
        """Start writing a staged snapshot; returns commits that completed meanwhile.

        The snapshot's buffer is copied first (its buffer is reused two snapshots later,
        and a write may take longer than that); the copy's buffer is reused between saves.
        """
        done = self.wait()
        t0 = time.perf_counter()
        cleared = self._clear(shard.step)
        shard.ready()
        buf = self._persist_buffer
        if buf is None or buf.numel() != shard.buffer.numel():
            buf = self._persist_buffer = torch.empty_like(shard.buffer, pin_memory=False)
        buf.copy_(shard.buffer)
        copy = Shard(step=shard.step, layout=shard.layout, buffer=buf, values=dict(shard.values))
        writer = HashingWriter(join(self.url, step_dir_name(shard.step)))

        def write() -> None:
            dcp.save({}, storage_writer=writer, planner=SnapshotSavePlanner(copy),
                     process_group=self.group, no_dist=self.group is None)

        if self.async_save:
            write_done = self._finisher.submit(write)
            self._pending = self._finisher.submit(self._commit, shard.step, t0, writer,
                                                  write_done, metrics, cleared)
        else:
            write()
            report = self._commit(shard.step, t0, writer, None, metrics, cleared)
            if report is not None:
                done.append(report)
        return done

    def _clear(self, step: int) -> tuple[str, ...]:
        """Rank 0 empties the step directory before the save. No other rank writes a file
        before rank 0 enters the save: DCP's first collective (the plan) waits for every
        rank. They may create the directory before it (see clear_step_dir)."""
        if self.rank != 0:
            return ()
        cleared = clear_step_dir(self.url, step)
        if cleared:
            _log.warning("checkpoint step %d: its directory already held %s; removed before "
                         "the save", step, ", ".join(cleared))
        return cleared

    def _commit(self, step: int, t0: float, writer: HashingWriter, fut: Future | None,
                metrics: dict[str, float] | None = None, cleared: tuple[str, ...] = ()
                ) -> CommitReport | None:
        if fut is not None:
            fut.result()  # re-raises a failed write on this rank
        if self.rank != 0:
            return None
        if self.trust is None:
            raise CheckpointError("rank 0 holds no checkpoint key, so it cannot commit")
        # DCP's coordinator (rank 0) finishes only after every rank's write result reached
        # it and .metadata is written, so all shards are on storage at this point; their
        # digests came with the results (HashingWriter), so none is read back here.
        ranks = dist.get_world_size(self.group) if self.group is not None else 1
        digests = {**writer.digests, **self._write_export_files(step)}
        extra = {**self.manifest_extra, "run_id": self.trust.run_id}
        if metrics:
            extra["metrics"] = metrics
        write_manifest(self.url, step, extra, key=self.trust.key, ranks=ranks, digests=digests)
        apply_retention(self.url, self.keep_last, newest=step, trust=self.trust,
                        verified=self._verified, best=self.keep_best)
        return CommitReport(step=step, path=join(self.url, step_dir_name(step)),
                            save_s=time.perf_counter() - t0, cleared=cleared)

    def _write_export_files(self, step: int) -> dict[str, FileDigest]:
        """The export files into step's directory, before its manifest; their digests."""
        fs, root = filesystem(join(self.url, step_dir_name(step)))
        digests = {}
        for name, data in self.export_files.items():
            with fs.open(f"{root}/{name}", "wb") as f:
                f.write(data)
            digests[name] = FileDigest(name=name, size=len(data),
                                       sha256=hashlib.sha256(data).hexdigest())
        return digests

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

    def load(self, path: str, files: FileTable, state: dict[str, Any]) -> None:
        """Load a committed checkpoint into `state` in place, resharding to this world.

        `files`: the file table of its manifest, as the driver verified it (signature and
        listing). Each file is checked against it as it is read (see safe_load), so nothing
        changed since, or never signed, is loaded; a mismatch is a CheckpointError, and
        the controller falls back to an older checkpoint."""
        reader = VerifiedReader(path, files=files)
        try:
            with contextlib.suppress(Exception):  # dcp.load reads it again and says why
                drop_keys_it_lacks(state, reader.read_metadata().state_dict_metadata)
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(),
                     process_group=self.group, no_dist=self.group is None)
        except CheckpointError:
            raise
        # DCP raises a variety of types for a mismatched model, and CheckpointException (a
        # BaseException, not an Exception) for a read that failed on any rank; a rank's
        # CheckpointError reaches the others inside it.
        except (CheckpointException, Exception) as exc:
            raise CheckpointError(f"checkpoint {path!r} failed to load (damaged, or it does "
                                  f"not fit this task's model or optimizer): "
                                  f"{describe_load_error(exc)}") from exc

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._finisher.shutdown(wait=True)
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None
