"""Files are hashed by the rank that writes them, as it writes them; the commit reads back only
what has no digest from its writer.

Pure, one process (DCP with no_dist); the same on a local path and on fsspec `memory://`.
The gloo version, with ranks that write and a rank 0 that reads nothing back, is
tests/dist/test_commit_hashing.py.
"""

from __future__ import annotations

import hashlib
import io
import json
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem as FsspecFileSystem

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.safe_load import load_metadata
from stalwart.checkpointing.storage.catalog import read_checkpoint, verify
from stalwart.checkpointing.storage.hashing import (
    DIGEST_FQN,
    FileDigest,
    HashingFileSystem,
    HashingStream,
    HashingWriter,
)
from stalwart.checkpointing.storage.layout import MANIFEST, METADATA, join, step_dir_name
from stalwart.checkpointing.storage.writer import StorageCheckpointer, write_manifest
from tests.keys import signing_key, trust

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(params=["local", "memory"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "local":
        yield str(tmp_path / "checkpoints")
        return
    root = f"memory://stalwart-hash-{uuid.uuid4().hex}/checkpoints"
    yield root
    fs, path = fsspec.core.url_to_fs(root)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def files_on_storage(step_url: str) -> dict[str, bytes]:
    fs, root = fsspec.core.url_to_fs(step_url)
    return {p.rsplit("/", 1)[-1]: fs.cat(p) for p in fs.ls(root, detail=False)}


def dcp_save(state: dict, writer: HashingWriter) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp.save(state, storage_writer=writer, no_dist=True)


# ------------------------------------------------------------------------------- HashingStream


class ShortWriter(io.BytesIO):
    """A raw stream that takes at most 3 bytes a call, as an unbuffered one may."""

    def write(self, b) -> int:  # type: ignore[override]
        return super().write(bytes(memoryview(b)[:3]))


def test_stream_hashes_and_counts_every_kind_of_buffer() -> None:
    raw = io.BytesIO()
    stream = HashingStream(raw)
    parts = [b"abc", bytearray(b"defg"), memoryview(b"hij"), torch.arange(5).numpy()]
    for part in parts:
        stream.write(part)
    stream.writelines([b"k", b"lm"])
    assert stream.size == len(raw.getvalue()) == stream.tell()
    assert stream.hexdigest() == sha(raw.getvalue())
    assert stream.sequential


def test_stream_hashes_only_what_the_stream_took() -> None:
    raw = ShortWriter()
    stream = HashingStream(raw)
    assert stream.write(b"abcdef") == 3
    assert stream.write(b"def") == 3
    assert raw.getvalue() == b"abcdef"
    assert (stream.size, stream.hexdigest()) == (6, sha(b"abcdef"))


def test_a_seek_back_makes_the_digest_unusable() -> None:
    stream = HashingStream(io.BytesIO())
    stream.write(b"header--body")
    stream.seek(0, io.SEEK_END)  # to where writing already is: harmless
    assert stream.sequential
    stream.seek(0)
    stream.write(b"HEADER")
    assert not stream.sequential


def test_stream_closes_what_it_wraps() -> None:
    raw = io.BytesIO()
    stream = HashingStream(raw)
    stream.close()
    assert raw.closed and stream.closed


# --------------------------------------------------------------------------- HashingFileSystem


def fsspec_dcp_fs(url: str) -> tuple[HashingFileSystem, str]:
    inner = FsspecFileSystem()
    path = str(inner.init_path(url))
    inner.mkdir(path)
    return HashingFileSystem(inner), path


def test_filesystem_records_a_digest_per_closed_file(url: str) -> None:
    fs, root = fsspec_dcp_fs(url)
    with fs.create_stream(f"{root}/a.bin", "wb") as f:
        f.write(b"x" * 1000)
    with fs.create_stream(f"{root}/a.bin", "rb") as f:  # reading records nothing
        assert not isinstance(f, HashingStream)
    fs.rename(f"{root}/a.bin", f"{root}/b.bin")  # the digest follows the file
    assert fs.take() == [FileDigest(name="b.bin", size=1000, sha256=sha(b"x" * 1000))]
    assert fs.take() == []


def test_a_failed_write_records_no_digest(url: str) -> None:
    fs, root = fsspec_dcp_fs(url)
    with pytest.raises(RuntimeError), fs.create_stream(f"{root}/c.bin", "wb") as f:
        f.write(b"half")
        raise RuntimeError("disk full")
    assert fs.take() == []
    assert not fs.exists(f"{root}/c.bin")  # DCP's opener removed it


# ------------------------------------------------------------------------------ HashingWriter


def test_writer_digests_are_the_files_on_storage(url: str) -> None:
    step_url = join(url, step_dir_name(1))
    writer = HashingWriter(step_url)
    dcp_save({"w": torch.randn(300, 7), "b": torch.arange(9), "step": 1}, writer)
    on_storage = files_on_storage(step_url)
    assert set(writer.digests) == set(on_storage) == {METADATA, "__0_0.distcp"}
    for name, data in on_storage.items():
        assert writer.digests[name] == FileDigest(name=name, size=len(data), sha256=sha(data))


def test_metadata_carries_no_digest(url: str) -> None:
    step_url = join(url, step_dir_name(1))
    dcp_save({"w": torch.randn(4, 4)}, HashingWriter(step_url))
    metadata = load_metadata(files_on_storage(step_url)[METADATA], "test")
    assert metadata.storage_data
    assert not any(index.fqn == DIGEST_FQN for index in metadata.storage_data)


def test_writer_forgets_an_earlier_save_when_reused(url: str) -> None:
    writer = HashingWriter(join(url, step_dir_name(1)))
    dcp_save({"w": torch.randn(4)}, writer)
    writer.reset(join(url, step_dir_name(2)))
    dcp_save({"w": torch.randn(8)}, writer)
    on_storage = files_on_storage(join(url, step_dir_name(2)))
    assert {n: d.sha256 for n, d in writer.digests.items()} == {
        n: sha(data) for n, data in on_storage.items()}


# ------------------------------------------------------------------------------- write_manifest


def manifest_files(url: str, step: int) -> dict:
    return read_checkpoint(url, step).manifest["files"]


def test_manifest_takes_the_writers_digests_unread(url: str) -> None:
    step_url = join(url, step_dir_name(3))
    writer = HashingWriter(step_url)
    dcp_save({"w": torch.randn(50)}, writer)
    # A digest the files do not have: taken as given proves the commit did not read them.
    marked = {n: FileDigest(name=n, size=d.size, sha256="f" * 64)
              for n, d in writer.digests.items()}
    assert write_manifest(url, 3, {}, key=signing_key(), ranks=1, digests=marked) == []
    assert {m["sha256"] for m in manifest_files(url, 3).values()} == {"f" * 64}


def test_manifest_from_digests_equals_one_from_reading(url: str) -> None:
    step_url = join(url, step_dir_name(4))
    writer = HashingWriter(step_url)
    dcp_save({"w": torch.randn(64, 3), "n": 7}, writer)
    assert write_manifest(url, 4, {}, key=signing_key(), ranks=1,
                          digests=writer.digests) == []
    from_writer = manifest_files(url, 4)
    assert sorted(write_manifest(url, 4, {}, key=signing_key(), ranks=1)) == sorted(
        from_writer)  # no digests: the old path, every file read
    assert manifest_files(url, 4) == from_writer
    verify(read_checkpoint(url, 4), trust())


def test_a_file_no_writer_wrote_fails_the_commit(url: str) -> None:
    """Sign what was written, nothing else: a file planted in the step directory during
    the save, or one whose size is not what its writer wrote (swapped), fails the commit
    loudly, and no manifest is written."""
    step_url = join(url, step_dir_name(5))
    writer = HashingWriter(step_url)
    dcp_save({"w": torch.randn(50)}, writer)
    fs, root = fsspec.core.url_to_fs(step_url)
    fs.pipe(f"{root}/export.modeling_evil.py", b"import os")
    with pytest.raises(CheckpointError, match="holds export.modeling_evil.py, which this "
                                              "save did not write"):
        write_manifest(url, 5, {}, key=signing_key(), digests=dict(writer.digests))
    fs.rm(f"{root}/export.modeling_evil.py")
    digests = dict(writer.digests)
    digests[METADATA] = FileDigest(name=METADATA, size=1, sha256="0" * 64)  # swapped
    with pytest.raises(CheckpointError, match="another size than written: .metadata"):
        write_manifest(url, 5, {}, key=signing_key(), digests=digests)
    assert not fs.exists(f"{root}/manifest.json")
    write_manifest(url, 5, {}, key=signing_key(), digests=dict(writer.digests))
    verify(read_checkpoint(url, 5), trust())


def test_a_save_starts_in_an_empty_step_directory(url: str) -> None:
    """Files already in the step directory (an earlier attempt's, or planted before the
    save) are removed before the save writes, and the commit reports them."""
    fs, root = fsspec.core.url_to_fs(join(url, step_dir_name(6)))
    fs.makedirs(root, exist_ok=True)
    fs.pipe(f"{root}/export.config.json", b'{"auto_map": "evil"}')
    ckpt = StorageCheckpointer(url, rank=0, keep_last=0, async_save=False,
                               manifest_extra={"world_size": 1}, trust=trust())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        (report,) = ckpt.save(6, {"model": {"w": torch.randn(4)}, "step": 6})
        ckpt.close()
    assert report.cleared == ("export.config.json",)
    assert "export.config.json" not in manifest_files(url, 6)
    assert not fs.exists(f"{root}/export.config.json")


# ------------------------------------------------------------------------- StorageCheckpointer


@pytest.mark.parametrize("async_save", [False, True])
def test_checkpointer_commits_what_it_hashed(url: str, async_save: bool) -> None:
    ckpt = StorageCheckpointer(url, rank=0, keep_last=0, async_save=async_save,
                               manifest_extra={"world_size": 1}, trust=trust())
    state = {"model": {"w": torch.randn(32, 8)}, "step": 6}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ckpt.save(6, state)
        ckpt.close()
    info = verify(read_checkpoint(url, 6), trust())
    on_storage = files_on_storage(info.path)
    assert set(info.manifest["files"]) == set(on_storage) - {MANIFEST}
    for name, meta in info.manifest["files"].items():
        assert meta == {"size": len(on_storage[name]), "sha256": sha(on_storage[name])}
    assert json.loads(on_storage[MANIFEST])["ranks"] == 1


def test_clearing_a_step_dir_keeps_the_directory_other_ranks_write_into(tmp_path):
    from stalwart.checkpointing.storage.layout import step_dir_name
    from stalwart.checkpointing.storage.writer import clear_step_dir

    step_dir = tmp_path / step_dir_name(6)
    (step_dir / "nested").mkdir(parents=True)
    (step_dir / "__0_0.distcp").write_bytes(b"old")
    (step_dir / "nested" / "x").write_bytes(b"planted")
    inode = step_dir.stat().st_ino
    assert clear_step_dir(str(tmp_path), 6) == ("__0_0.distcp", "nested")
    # Another rank's save may have made (or be making) the directory: it must not vanish.
    assert step_dir.is_dir() and step_dir.stat().st_ino == inode
    assert list(step_dir.iterdir()) == []
    step_dir.rmdir()
    step_dir.write_bytes(b"a file where the directory goes")
    assert clear_step_dir(str(tmp_path), 6) == (step_dir_name(6),)
    assert not step_dir.exists()
