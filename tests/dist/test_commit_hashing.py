"""On real gloo ranks, a storage commit takes each file's sha256 from the rank that wrote it:
the manifest's digests are those of the files on disk, and rank 0 reads none of them back.

The storage is a real local directory seen through `countfile://`, an fsspec filesystem that
is the local one and also records every file a process opens for reading.
"""

from __future__ import annotations

import hashlib
import warnings
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from stalwart.checkpointing.snapshot import SnapshotStager
from stalwart.checkpointing.storage.catalog import read_checkpoint, read_step_dir, verify
from stalwart.checkpointing.storage.layout import MANIFEST, join, step_dir_name
from stalwart.checkpointing.storage.writer import StorageCheckpointer, write_manifest
from tests.dist.launcher import run_ranks
from tests.keys import signing_key, trust

pytestmark = [pytest.mark.dist, pytest.mark.timeout(240)]

PROTOCOL = "countfile"


class ReadCountingFileSystem(LocalFileSystem):
    """The local filesystem, recording the paths this process opens for reading."""

    protocol = (PROTOCOL,)
    reads: ClassVar[list[str]] = []

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = fsspec.utils.stringify_path(path)
        if path.startswith(f"{PROTOCOL}://"):
            path = path[len(PROTOCOL) + 3:]
        return super()._strip_protocol(path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if "r" in mode:
            ReadCountingFileSystem.reads.append(path.rsplit("/", 1)[-1])
        return super()._open(path, mode, **kwargs)


# Registered when a rank's process imports this module to run its function (spawn).
fsspec.register_implementation(PROTOCOL, ReadCountingFileSystem, clobber=True)


def rank_state(rank: int, scale: float = 1.0) -> dict[str, Any]:
    """Each rank its own tensors (distinct names: every rank writes a data file)."""
    gen = torch.Generator().manual_seed(rank)
    return {"model": {f"rank{rank}.w": torch.randn(128, 64, generator=gen) * scale,
                      f"rank{rank}.b": torch.randn(64, generator=gen) * scale},
            "step": 1}


def save_and_commit(rank: int, world: int, url: str) -> dict[str, Any]:
    ckpt = StorageCheckpointer(url, rank=rank, keep_last=0, async_save=True,
                               manifest_extra={"world_size": world}, trust=trust())
    state = rank_state(rank)
    stager = SnapshotStager(state_dict=lambda: rank_state(rank, 2.0),
                            scalar_state=lambda: {"step": 2}, signature=lambda: 0,
                            device=torch.device("cpu"))
    ReadCountingFileSystem.reads.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ckpt.save(1, state)  # the path with the memory tier off
        ckpt.save_snapshot(stager.stage(2))  # and with it on
        ckpt.wait()
    reads_while_committing = list(ReadCountingFileSystem.reads)
    loaded = {}
    for step, source in ((1, rank_state(rank)), (2, rank_state(rank, 2.0))):
        target = {"model": {k: torch.zeros_like(v) for k, v in source["model"].items()},
                  "step": 0}
        path = join(url, step_dir_name(step))
        ckpt.load(path, read_step_dir(path).manifest["files"], target)
        loaded[step] = all(torch.equal(target["model"][k], v)
                           for k, v in source["model"].items()) and target["step"] == step
    ckpt.close()
    out: dict[str, Any] = {"reads": reads_while_committing, "loaded": loaded}
    if rank == 0:
        # The old path on the same files, for contrast: the instrument sees its reads.
        new = read_checkpoint(url, 1).manifest["files"]
        ReadCountingFileSystem.reads.clear()
        write_manifest(url, 1, {"world_size": world}, key=signing_key(), ranks=world)
        out["old_path_reads"] = sorted(ReadCountingFileSystem.reads)
        out["same_files"] = read_checkpoint(url, 1).manifest["files"] == new
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_commit_takes_digests_from_the_writers(tmp_path: Path, world: int) -> None:
    storage = tmp_path / "ckpt"
    results = run_ranks(save_and_commit, world, f"{PROTOCOL}://{storage}")
    # Rank 0 committed two checkpoints of `world` data files each without reading a file.
    assert results[0]["reads"] == []
    # The instrument works: the old commit reads every file back.
    shards = [f"__{r}_0.distcp" for r in range(world)]
    assert results[0]["old_path_reads"] == sorted([".metadata", *shards])
    assert results[0]["same_files"]
    for step in (1, 2):
        step_dir = storage / step_dir_name(step)
        info = verify(read_checkpoint(str(storage), step), trust())
        on_disk = {p.name: p.read_bytes() for p in step_dir.iterdir() if p.name != MANIFEST}
        assert set(info.manifest["files"]) == set(on_disk) == {".metadata", *shards}
        for name, data in on_disk.items():
            assert info.manifest["files"][name] == {
                "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    # And every rank loaded both back (the loads verify against the manifest).
    assert all(r["loaded"] == {1: True, 2: True} for r in results)
