"""The places a run writes: relative storage made absolute, and write probes that refuse what
cannot be written while leaving the disk as it was.

As root here, permission bits stop nothing, so "unwritable" is a path under /proc, a path
under a regular file, or a read-only HTTP server.
"""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from stalwart.checkpointing.errors import StorageURLError
from stalwart.core.config import load_config
from stalwart.core.errors import RunDirError
from stalwart.places import absolute_storage, probe_run_dir, probe_storage

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


@pytest.mark.parametrize(("storage", "expected"), [
    ("ckpt", "/work/here/ckpt"),
    ("./a/../ckpt/", "/work/here/ckpt"),
    ("file://ckpt", "file:///work/here/ckpt"),
    ("/abs/ckpt", "/abs/ckpt"),
    ("file:///abs/ckpt", "file:///abs/ckpt"),
    ("s3://bucket/ckpt", "s3://bucket/ckpt"),
    ("", ""),
])
def test_absolute_storage(storage: str, expected: str) -> None:
    assert absolute_storage(storage, cwd=Path("/work/here")) == expected


def test_absolute_storage_expands_home() -> None:
    assert absolute_storage("~/ckpt") == str(Path.home() / "ckpt")


def test_the_trainer_records_relative_storage_as_absolute(tmp_path, monkeypatch) -> None:
    from stalwart.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    config = load_config(None, ['checkpoint.storage="ckpt"'])
    trainer = Trainer(config, run_dir=tmp_path / "run")
    assert trainer.config.checkpoint.storage == str(tmp_path.resolve() / "ckpt")
    assert trainer.run_dir.storage_url(trainer.config) == str(tmp_path.resolve() / "ckpt")


def test_a_new_deep_run_dir_is_probed_and_nothing_stays(tmp_path) -> None:
    probe_run_dir(tmp_path / "runs" / "a" / "b")
    assert _tree(tmp_path) == []


def test_an_existing_run_dir_is_probed_and_left_as_it_was(tmp_path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "events.jsonl").write_text("{}\n")
    probe_run_dir(tmp_path / "run")
    assert _tree(tmp_path) == ["run", "run/events.jsonl"]


def test_a_run_dir_that_is_a_file(tmp_path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(RunDirError, match=r"^run dir .*/f is a file, not a directory"):
        probe_run_dir(tmp_path / "f")
    with pytest.raises(RunDirError, match=r"^run dir .*/f/run is under .*/f, a file, not a "):
        probe_run_dir(tmp_path / "f" / "run")
    assert _tree(tmp_path) == ["f"]


def test_a_run_dir_under_proc() -> None:
    with pytest.raises(RunDirError, match=r"^run dir /proc/x/y is not writable: cannot create "
                                          r"the directory /proc/x: "):
        probe_run_dir(Path("/proc/x/y"))
    with pytest.raises(RunDirError, match=r"^run dir /proc is not writable: cannot create a "
                                          r"file in /proc: "):
        probe_run_dir(Path("/proc"))


def test_a_run_dir_name_too_long(tmp_path) -> None:
    with pytest.raises(RunDirError, match="File name too long"):
        probe_run_dir(tmp_path / ("x" * 300))
    assert _tree(tmp_path) == []


def test_local_storage(tmp_path) -> None:
    probe_storage(str(tmp_path / "ckpt"))
    probe_storage(f"file://{tmp_path}/ckpt2")
    assert _tree(tmp_path) == []
    with pytest.raises(StorageURLError, match=r"^checkpoint.storage '/proc/ckpt' is not writable"):
        probe_storage("/proc/ckpt")


@pytest.fixture
def read_only_http(tmp_path) -> Iterator[str]:
    handler = functools.partial(_QuietHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def test_read_only_http_storage(read_only_http: str) -> None:
    url = f"{read_only_http}/ckpt"
    with pytest.raises(StorageURLError) as err:
        probe_storage(url)
    assert str(err.value).startswith(f"checkpoint.storage {url!r} is not writable: "
                                     f"ClientResponseError: 501")


def test_remote_storage_probe_leaves_nothing(tmp_path) -> None:
    import fsspec

    # memory:// as a stand-in for a remote filesystem (the trainer refuses it on its own).
    probe_storage("memory://probe-test/ckpt")
    fs = fsspec.filesystem("memory")
    assert not [p for p in fs.find("/probe-test") if ".stalwart-write-probe-" in p]
