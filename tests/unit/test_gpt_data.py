"""Unit tests for the stdlib token cache and the memory-mapped window dataset."""

from __future__ import annotations

import multiprocessing
import pickle
import sysconfig
import zlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from stalwart.examples.gpt import data
from stalwart.examples.gpt.data import TokenDataset, TokenFiles, build_token_files

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.fixture(scope="module")
def token_files(tmp_path_factory: pytest.TempPathFactory) -> TokenFiles:
    return build_token_files(tmp_path_factory.mktemp("tokens"))


def _arrow_file(path: Path, tokens: np.ndarray) -> Path:
    batch = pa.record_batch([pa.array(tokens.astype(np.uint8))], names=["tokens"])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return path


def _n_tokens(path: Path) -> int:
    return TokenDataset(path, seq_len=1).n_tokens


def test_build_creates_arrow_files(token_files: TokenFiles) -> None:
    assert token_files.train.is_file() and token_files.val.is_file()
    assert token_files.train.parent == token_files.val.parent
    assert (token_files.train.parent / "done").is_file()
    table = pa.ipc.open_file(pa.memory_map(str(token_files.val))).read_all()
    assert table.schema.names == ["tokens"] and table.schema.field("tokens").type == pa.uint8()


def test_second_call_returns_cached_files_without_reading(
    token_files: TokenFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    mtime = token_files.train.stat().st_mtime_ns

    def fail(paths: list[Path]) -> np.ndarray:
        raise AssertionError("cache hit must not re-read the stdlib")

    monkeypatch.setattr(data, "_read_tokens", fail)
    again = build_token_files(token_files.train.parent.parent)
    assert again == token_files
    assert token_files.train.stat().st_mtime_ns == mtime


def test_token_counts_cover_the_whole_stdlib(token_files: TokenFiles) -> None:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p
        for p in root.rglob("*.py")
        if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)
    ]
    n_val = sum(zlib.crc32(p.relative_to(root).as_posix().encode()) % 10_000 < 200 for p in files)
    n_train = len(files) - n_val
    n_train_tokens, n_val_tokens = _n_tokens(token_files.train), _n_tokens(token_files.val)
    assert n_train_tokens > 0 and n_val_tokens > 0
    separators = (n_train - 1) + (n_val - 1)
    assert n_train_tokens + n_val_tokens == sum(p.stat().st_size for p in files) + separators


def test_real_batches(token_files: TokenFiles) -> None:
    ds = TokenDataset(token_files.val, seq_len=64)
    x, y = ds.get_batch([0, len(ds) - 1, 3])
    assert x.shape == y.shape == (3, 64)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert 0 <= int(x.min()) and int(x.max()) <= 255


def test_windows_are_non_overlapping_and_shifted(tmp_path: Path) -> None:
    tokens = np.arange(103) % 251
    ds = TokenDataset(_arrow_file(tmp_path / "t.arrow", tokens), seq_len=10)
    assert len(ds) == (103 - 1) // 10 == 10
    x, y = ds.get_batch(np.array([0, 9]))
    torch.testing.assert_close(x[0], torch.arange(0, 10))
    torch.testing.assert_close(y[0], torch.arange(1, 11))
    torch.testing.assert_close(x[1], torch.arange(90, 100))
    torch.testing.assert_close(y[1], torch.arange(91, 101))
    with pytest.raises(IndexError):
        ds.get_batch([10])
    assert len(TokenDataset(_arrow_file(tmp_path / "u.arrow", np.arange(101)), seq_len=10)) == 10


def test_pickled_dataset_gives_same_batch(token_files: TokenFiles) -> None:
    ds = TokenDataset(token_files.train, seq_len=32)
    blob = pickle.dumps(ds)
    assert len(blob) < 1000  # only the path and seq_len travel, not the tokens
    clone = pickle.loads(blob)
    assert clone._tokens is None  # mapped lazily on first use
    idx = [5, 17, len(ds) - 1]
    for a, b in zip(ds.get_batch(idx), clone.get_batch(idx), strict=True):
        assert torch.equal(a, b)
    assert len(clone) == len(ds)


def _fake_stdlib(root: Path) -> Path:
    for i in range(40):
        (root / "pkg").mkdir(parents=True, exist_ok=True)
        (root / "pkg" / f"mod{i}.py").write_text(f"x = {i}\n")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "thirdparty.py").write_text("nope = 1\n")
    return root


def _build_in_child(cache_dir: str, queue: multiprocessing.Queue) -> None:
    queue.put(build_token_files(cache_dir, val_fraction=0.2))


def test_concurrent_builders_agree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stdlib = _fake_stdlib(tmp_path / "stdlib")
    monkeypatch.setattr(data.sysconfig, "get_paths", lambda: {"stdlib": str(stdlib)})
    cache = tmp_path / "cache"
    ctx = multiprocessing.get_context("fork")  # children inherit the monkeypatch
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in_child, args=(str(cache), queue)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert len(set(results)) == 1
    files = results[0]
    train, val = TokenDataset(files.train, seq_len=1), TokenDataset(files.val, seq_len=1)
    text = bytes(train._open()) + b"\0" + bytes(val._open())
    assert b"nope" not in text  # site-packages excluded
    expected = sum(len(f"x = {i}\n") for i in range(40)) + 38  # two splits -> 38 separators
    assert train.n_tokens + val.n_tokens == expected


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="val_fraction"):
        build_token_files(tmp_path, val_fraction=0.0)
    with pytest.raises(ValueError, match="seq_len"):
        TokenDataset(_arrow_file(tmp_path / "t.arrow", np.arange(10)), seq_len=0)
