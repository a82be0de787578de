"""Storage checkpoints on the driver: commit by manifest, validate by checksum, retain by policy.

Pure file IO on fake step directories (no process group): the same functions run on a local
path and on an fsspec `memory://` URL.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import fsspec
import pytest

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.catalog import (
    committed_checkpoints,
    find_step,
    list_step_dirs,
    newest_valid,
    read_checkpoint,
    verify,
)
from stalwart.checkpointing.storage.layout import FORMAT_VERSION, MANIFEST, join, step_dir_name
from stalwart.checkpointing.storage.retention import BestRule, apply_retention, best_steps
from stalwart.checkpointing.storage.signing import sign
from stalwart.checkpointing.storage.writer import write_manifest
from tests.keys import signing_key, trust

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


class Store:
    """A storage URL and a way to put bytes under it, for a local dir or memory://."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)

    def path(self, step: int, name: str) -> str:
        return f"{self.root}/{step_dir_name(step)}/{name}"

    def put(self, step: int, name: str, data: bytes) -> None:
        self.fs.makedirs(f"{self.root}/{step_dir_name(step)}", exist_ok=True)
        self.fs.pipe(self.path(step, name), data)

    def get(self, step: int, name: str) -> bytes:
        return self.fs.cat(self.path(step, name))

    def shard_files(self, step: int) -> None:
        """What DCP leaves: shard files and .metadata (deterministic, step-dependent bytes)."""
        for rank in range(2):
            self.put(step, f"__{rank}_0.distcp", bytes((step + rank + i) % 251 for i in range(300)))
        self.put(step, ".metadata", f"metadata of step {step}".encode())

    def commit(self, step: int, **extra) -> None:
        self.shard_files(step)
        write_manifest(self.url, step, {"world_size": 2, **extra}, key=signing_key())

    def steps_on_storage(self) -> list[int]:
        return [s for s, _ in list_step_dirs(self.url)]


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "local":
        yield Store(str(tmp_path / "checkpoints"))
        return
    url = f"memory://stalwart-test-{uuid.uuid4().hex}/checkpoints"
    s = Store(url)
    try:
        yield s
    finally:
        if s.fs.exists(s.root):
            s.fs.rm(s.root, recursive=True)


@pytest.fixture
def local(tmp_path: Path) -> Store:
    return Store(str(tmp_path / "checkpoints"))


def _skips() -> tuple[list[tuple[int, str]], Callable[[int, str], None]]:
    seen: list[tuple[int, str]] = []
    return seen, lambda step, message: seen.append((step, message))


# ---------------------------------------------------------------------------- commit


def test_empty_or_missing_storage_has_no_checkpoints(store: Store) -> None:
    assert list_step_dirs(store.url) == []
    assert committed_checkpoints(store.url) == []
    assert newest_valid(store.url, trust()) is None


def test_manifest_lists_every_file_with_size_and_sha256(store: Store) -> None:
    store.commit(10, model="gpt")
    manifest = json.loads(store.get(10, MANIFEST))
    assert manifest["format"] == FORMAT_VERSION and manifest["step"] == 10
    assert manifest["world_size"] == 2 and manifest["model"] == "gpt"
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert manifest["files"]["__0_0.distcp"]["size"] == 300
    import hashlib

    assert manifest["files"][".metadata"]["sha256"] == hashlib.sha256(
        b"metadata of step 10").hexdigest()
    assert not store.fs.exists(store.path(10, MANIFEST + ".tmp"))


def test_uncommitted_dirs_are_invisible(store: Store) -> None:
    store.commit(10)
    store.commit(20)
    store.shard_files(30)  # a save that crashed before its manifest
    assert list_step_dirs(store.url) == [(10, True), (20, True), (30, False)]
    assert [c.step for c in committed_checkpoints(store.url)] == [10, 20]
    newest = newest_valid(store.url, trust())
    assert newest is not None and newest.step == 20
    assert newest.path == join(store.url, "step_000000020")
    with pytest.raises(CheckpointError, match="checkpoint step 30 under .* is not committed"):
        read_checkpoint(store.url, 30)


def test_unrelated_entries_are_ignored(store: Store) -> None:
    store.commit(10)
    store.fs.pipe(f"{store.root}/notes.txt", b"hello")
    store.fs.makedirs(f"{store.root}/step_12", exist_ok=True)
    store.fs.pipe(f"{store.root}/step_12/x", b"not nine digits")
    store.fs.pipe(f"{store.root}/step_000000099", b"a file, not a directory")
    assert list_step_dirs(store.url) == [(10, True)]


# ---------------------------------------------------------------------------- validation


def _flip_bytes(store: Store, step: int, name: str) -> None:
    data = bytearray(store.get(step, name))
    data[100] ^= 0xFF
    store.fs.pipe(store.path(step, name), bytes(data))


def _truncate(store: Store, step: int, name: str) -> None:
    store.fs.pipe(store.path(step, name), store.get(step, name)[:-1])


def _delete(store: Store, step: int, name: str) -> None:
    store.fs.rm(store.path(step, name))


@pytest.mark.parametrize(("damage", "expected"), [
    (_flip_bytes, "file __1_0.distcp is damaged (size or sha256 differs from the manifest)"),
    (_truncate, "file __1_0.distcp is damaged (size or sha256 differs from the manifest)"),
    (_delete, "file __1_0.distcp is missing"),
])
def test_damaged_checkpoint_is_skipped_and_reported(store: Store, damage, expected: str) -> None:
    store.commit(10)
    store.commit(20)
    damage(store, 20, "__1_0.distcp")
    skipped, on_skip = _skips()
    newest = newest_valid(store.url, trust(), on_skip=on_skip)
    assert newest is not None and newest.step == 10
    assert len(skipped) == 1
    step, message = skipped[0]
    assert step == 20
    assert "step_000000020" in message and expected in message
    # still committed (its manifest exists), but it never verifies
    assert [c.step for c in committed_checkpoints(store.url)] == [10, 20]
    with pytest.raises(CheckpointError, match="is damaged|is missing"):
        verify(read_checkpoint(store.url, 20), trust())


def test_damaged_manifest_is_skipped(store: Store) -> None:
    store.commit(10)
    store.commit(20)
    store.fs.pipe(store.path(20, MANIFEST), b"{not json")
    skipped, on_skip = _skips()
    newest = newest_valid(store.url, trust(), on_skip=on_skip)
    assert newest is not None and newest.step == 10
    assert skipped[0][0] == 20 and f"{MANIFEST} is damaged" in skipped[0][1]


def test_manifest_of_another_format_is_skipped(store: Store) -> None:
    store.commit(10)
    store.commit(20)
    manifest = json.loads(store.get(20, MANIFEST))
    manifest["format"] = 99
    store.fs.pipe(store.path(20, MANIFEST), json.dumps(manifest).encode())
    skipped, on_skip = _skips()
    assert newest_valid(store.url, trust(), on_skip=on_skip).step == 10
    assert skipped[0][0] == 20
    assert f"manifest format 99, expected {FORMAT_VERSION}" in skipped[0][1]


def test_all_damaged_gives_none(store: Store) -> None:
    store.commit(10)
    _flip_bytes(store, 10, "__0_0.distcp")
    skipped, on_skip = _skips()
    assert newest_valid(store.url, trust(), on_skip=on_skip) is None
    assert [s for s, _ in skipped] == [10]


def test_find_step(store: Store) -> None:
    store.commit(10)
    store.commit(20)
    store.shard_files(30)
    assert find_step(store.url, 10, trust()).step == 10
    with pytest.raises(CheckpointError) as err:
        find_step(store.url, 30, trust())  # exists, but not committed
    assert "no committed checkpoint for step 30" in str(err.value)
    assert "committed steps: [10, 20]" in str(err.value)
    with pytest.raises(CheckpointError, match=r"committed steps: \[10, 20\]"):
        find_step(store.url, 15, trust())
    _truncate(store, 20, ".metadata")
    with pytest.raises(CheckpointError, match="file .metadata is damaged"):
        find_step(store.url, 20, trust())  # a specific step is verified too, never returned damaged


def test_find_step_on_empty_storage(store: Store) -> None:
    with pytest.raises(CheckpointError, match="committed steps: none"):
        find_step(store.url, 1, trust())


def test_recommit_after_a_crash_between_tmp_and_rename(local: Store) -> None:
    local.shard_files(10)
    local.put(10, MANIFEST + ".tmp", b'{"format": 1, "partial')  # left by the crashed commit
    write_manifest(local.url, 10, {}, key=signing_key())
    skipped, on_skip = _skips()
    newest = newest_valid(local.url, trust(), on_skip=on_skip)
    assert skipped == []
    assert newest is not None and newest.step == 10


# ---------------------------------------------------------------------------- retention


def test_retention_keeps_last_n_committed(store: Store) -> None:
    for step in (10, 20, 30, 40, 50):
        store.commit(step)
    store.shard_files(25)  # stale partial write, older than the newest commit
    store.shard_files(60)  # a save in flight, newer than the newest commit
    apply_retention(store.url, keep_last=2, newest=50, trust=trust())
    assert list_step_dirs(store.url) == [(40, True), (50, True), (60, False)]
    # what is kept is untouched and still verifies
    assert newest_valid(store.url, trust()).step == 50
    verify(read_checkpoint(store.url, 40), trust())


def test_retention_one(store: Store) -> None:
    for step in (10, 20):
        store.commit(step)
    apply_retention(store.url, keep_last=1, newest=20, trust=trust())
    assert store.steps_on_storage() == [20]
    apply_retention(store.url, keep_last=1, newest=20, trust=trust())  # idempotent
    assert store.steps_on_storage() == [20]


def test_retention_never_removes_a_partial_dir_newer_than_the_newest_commit(store: Store) -> None:
    store.commit(10)
    store.shard_files(20)
    store.shard_files(30)
    apply_retention(store.url, keep_last=1, newest=10, trust=trust())
    assert list_step_dirs(store.url) == [(10, True), (20, False), (30, False)]
    assert store.get(30, "__0_0.distcp") == bytes((30 + i) % 251 for i in range(300))


def test_keep_last_zero_keeps_every_commit(store: Store) -> None:
    for step in (10, 20, 30, 40):
        store.commit(step)
    store.shard_files(60)
    apply_retention(store.url, keep_last=0, newest=40, trust=trust())
    assert list_step_dirs(store.url) == [(10, True), (20, True), (30, True), (40, True),
                                         (60, False)]


def _commit_scored(store: Store, scores: dict[int, float | None]) -> None:
    for step, val_loss in scores.items():
        metrics = {"loss": 1.0} if val_loss is None else {"loss": 1.0, "val_loss": val_loss}
        store.commit(step, metrics=metrics)


def test_keep_best_keeps_the_best_however_old_besides_the_newest(store: Store) -> None:
    _commit_scored(store, {10: 3.0, 20: 1.0, 30: None, 40: 2.5, 50: 0.5, 60: 4.0, 70: None})
    apply_retention(store.url, keep_last=2, newest=70, trust=trust(),
                    best=BestRule(2, "val_loss"))
    # the newest 2 (60, 70), and the 2 lowest val_loss (50, 20); 30 never had one
    assert store.steps_on_storage() == [20, 50, 60, 70]
    apply_retention(store.url, keep_last=2, newest=70, trust=trust(),
                    best=BestRule(1, "val_loss", "max"))
    assert store.steps_on_storage() == [60, 70]  # 60 is the highest and among the newest


def test_a_best_checkpoint_among_the_newest_counts_as_both(store: Store) -> None:
    _commit_scored(store, {10: 3.0, 20: 2.0, 30: 1.0})
    apply_retention(store.url, keep_last=2, newest=30, trust=trust(),
                    best=BestRule(1, "val_loss"))
    assert store.steps_on_storage() == [20, 30]


def test_keep_best_passes_over_a_damaged_best(store: Store) -> None:
    _commit_scored(store, {10: 0.1, 20: 0.2, 30: 5.0, 40: 6.0})
    store.put(10, "__0_0.distcp", b"bit rot")  # the best on paper no longer verifies
    apply_retention(store.url, keep_last=1, newest=40, trust=trust(),
                    best=BestRule(1, "val_loss"))
    # 20 is the best that verifies; 10 is never kept, and it is older than the newest.
    assert store.steps_on_storage() == [20, 40]


def test_keep_best_ties_go_to_the_newer_step(store: Store) -> None:
    _commit_scored(store, {10: 1.0, 20: 1.0, 30: 9.0})
    apply_retention(store.url, keep_last=1, newest=30, trust=trust(),
                    best=BestRule(1, "val_loss"))
    assert store.steps_on_storage() == [20, 30]


def test_retention_with_more_room_than_checkpoints(store: Store) -> None:
    for step in (10, 20):
        store.commit(step)
    apply_retention(store.url, keep_last=5, newest=20, trust=trust())
    assert store.steps_on_storage() == [10, 20]


def test_memory_url_is_really_in_memory() -> None:
    # the parametrized `store` fixture ran everything above on memory:// too; check that
    # such a URL leaves nothing on the local disk and is visible to the catalog by URL alone
    url = f"memory://stalwart-test-{uuid.uuid4().hex}/ckpt"
    s = Store(url)
    try:
        s.commit(7)
        assert not Path(s.root).exists()
        info = newest_valid(url, trust())
        assert info is not None and info.path == f"{url}/step_000000007"
    finally:
        s.fs.rm(s.root, recursive=True)


# ----------------------------------------------- damaged and reshaped checkpoints: verified first


def _rewrite_manifest(store: Store, step: int, change: Callable[[dict], object]) -> None:
    """A manifest of another shape, as its writer signed it (its shape is what is tested)."""
    manifest = json.loads(store.get(step, MANIFEST))
    new = change(manifest)  # a list replaces the manifest; anything else changed it in place
    store.fs.pipe(store.path(step, MANIFEST),
                  json.dumps(new if isinstance(new, list) else sign(manifest, signing_key())
                             ).encode())


def test_retention_counts_only_verified_checkpoints(store: Store) -> None:
    """The case: commits at 100 and 200; a shard of 200 damaged; the resumed run
    falls back to 100 and commits 150 with keep_last=1. Retention keeps 150 (just
    committed) and leaves 200 (newer than it), so a valid checkpoint is always there."""
    store.commit(100)
    store.commit(200)
    _flip_bytes(store, 200, "__1_0.distcp")
    assert newest_valid(store.url, trust()).step == 100
    store.commit(150)
    apply_retention(store.url, keep_last=1, newest=150, trust=trust())
    assert store.steps_on_storage() == [150, 200]
    assert newest_valid(store.url, trust()).step == 150


def test_retention_skips_damaged_checkpoints_when_counting(store: Store) -> None:
    for step in (100, 150):
        store.commit(step)
    store.commit(200)
    _flip_bytes(store, 200, "__0_0.distcp")
    store.commit(250)
    # keep_last=2: 250 and the newest older one that verifies (150); the damaged 200
    # between them stays and does not count, so 150 is not dropped for it.
    apply_retention(store.url, keep_last=3, newest=250, trust=trust())
    assert store.steps_on_storage() == [100, 150, 200, 250]
    apply_retention(store.url, keep_last=2, newest=250, trust=trust())
    assert store.steps_on_storage() == [150, 200, 250]
    apply_retention(store.url, keep_last=1, newest=250, trust=trust())
    assert store.steps_on_storage() == [250]


def test_retention_keeps_the_just_committed_one_when_newer_steps_are_damaged(
        store: Store) -> None:
    store.commit(100)
    store.commit(200)
    store.commit(300)
    _flip_bytes(store, 200, "__0_0.distcp")
    _delete(store, 300, "__1_0.distcp")
    store.commit(150)
    apply_retention(store.url, keep_last=2, newest=150, trust=trust())
    assert store.steps_on_storage() == [100, 150, 200, 300]


def test_retention_hashes_each_checkpoint_once_with_a_cache(store: Store,
                                                            monkeypatch) -> None:
    from stalwart.checkpointing.storage import retention

    calls: list[str] = []
    real = retention.verify
    monkeypatch.setattr(retention, "verify",
                        lambda info, trust: (calls.append(info.path), real(info, trust))[1])
    cache: dict[int, float] = {}
    for step in (10, 20, 30, 40):
        store.commit(step)
        apply_retention(store.url, keep_last=3, newest=step, trust=trust(), verified=cache)
    assert store.steps_on_storage() == [20, 30, 40]
    assert sorted(calls) == sorted(set(calls))  # never the same checkpoint twice


@pytest.mark.parametrize(("change", "expected"), [
    (lambda m: [m], "a JSON list, not an object"),
    (lambda m: m.pop("files"), "lists no files"),
    (lambda m: m.update(files=[]), "lists no files"),
    (lambda m: m["files"]["__0_0.distcp"].pop("sha256"), "has no size and sha256"),
    (lambda m: m["files"]["__0_0.distcp"].pop("size"), "has no size and sha256"),
    (lambda m: m["files"].update({"__0_0.distcp": "abc"}), "has no size and sha256"),
    (lambda m: m.update(step=30), "is for step 30, not the directory's step 20"),
    (lambda m: m.pop("step"), "names no step"),
    (lambda m: m["files"].pop("__1_0.distcp"), "incomplete: it lists no a data file of rank 1"),
    (lambda m: m["files"].pop(".metadata"), "incomplete: it lists no .metadata"),
    (lambda m: m.update(ranks="2"), "not a positive integer"),
    (lambda m: m["files"].update({"../x": {"size": 1, "sha256": "0"}}),
     "'../x' is not a plain file name"),
    (lambda m: m["files"].update({MANIFEST: {"size": 1, "sha256": "0"}}), "lists itself"),
])
def test_a_manifest_of_the_wrong_shape_is_skipped(store: Store, change, expected: str) -> None:
    store.commit(10)
    store.commit(20)
    _rewrite_manifest(store, 20, change)
    skipped, on_skip = _skips()
    assert newest_valid(store.url, trust(), on_skip=on_skip).step == 10
    assert [s for s, _ in skipped] == [20] and expected in skipped[0][1]
    with pytest.raises(CheckpointError, match="step 20|step_000000020"):
        find_step(store.url, 20, trust())


def test_manifest_records_the_writing_ranks_and_refuses_to_commit_without_them(
        store: Store) -> None:
    store.commit(10)
    assert json.loads(store.get(10, MANIFEST))["ranks"] == 2
    store.shard_files(20)
    with pytest.raises(CheckpointError, match=r"no __2_0.distcp, __3_0.distcp; not committed"):
        write_manifest(store.url, 20, {}, ranks=4, key=signing_key())
    assert list_step_dirs(store.url) == [(10, True), (20, False)]


def test_a_manifest_without_ranks_from_before_still_verifies(store: Store) -> None:
    store.commit(10)
    _rewrite_manifest(store, 10, lambda m: m.pop("ranks"))
    assert newest_valid(store.url, trust()).step == 10


@pytest.mark.parametrize("step", [999_999_999, 1_000_000_000, 12_345_678_901])
def test_steps_of_a_billion_and_more_are_visible(store: Store, step: int) -> None:
    store.commit(5)
    store.commit(step)
    assert list_step_dirs(store.url) == [(5, True), (step, True)]
    assert newest_valid(store.url, trust()).step == step
    assert find_step(store.url, step, trust()).path.endswith(f"step_{step:09d}")
    apply_retention(store.url, keep_last=1, newest=step, trust=trust())
    assert store.steps_on_storage() == [step]


def test_only_a_steps_canonical_name_is_a_step_dir() -> None:
    from stalwart.checkpointing.storage.layout import parse_step_dir

    assert step_dir_name(999_999_999) == "step_999999999"
    assert step_dir_name(1_000_000_000) == "step_1000000000"
    assert parse_step_dir("step_000000100") == 100
    assert parse_step_dir("/x/step_1000000000/") == 1_000_000_000
    assert parse_step_dir("step_0000000100") is None  # a second name for step 100
    assert parse_step_dir("step_00000010") is None
    assert parse_step_dir("step_1e9") is None


def test_manifest_is_written_with_fsync_before_the_rename(local: Store, monkeypatch) -> None:
    import os

    order: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (order.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append(f"replace {Path(b).name}"),
                                                     real_replace(a, b))[1])
    local.commit(10)
    assert order == ["fsync", f"replace {MANIFEST}", "fsync"]  # file, rename, directory


# ------------------------------------------------------------ what storage can write

def test_metrics_that_are_not_a_table_rank_as_unmeasured(local: Store) -> None:
    """Storage writes the manifest: a `metrics` that is a list must not break every later
    commit that ranks checkpoints (keep_best)."""
    local.commit(10, metrics={"loss": 1.0})
    local.commit(20)
    manifest = local.root + "/" + step_dir_name(20) + "/manifest.json"
    data = json.loads(local.fs.cat(manifest))
    data["metrics"] = []
    local.fs.pipe(manifest, json.dumps(data).encode())
    local.commit(30, metrics={"loss": 2.0})
    best = BestRule(count=1, metric="loss")
    assert best_steps(local.url, 30, best, trust(), {}) == {10}
    apply_retention(local.url, keep_last=1, newest=30, trust=trust(), best=best)
    assert local.steps_on_storage() == [10, 30]


def test_a_manifest_that_is_a_directory_is_skipped_not_a_crash(local: Store) -> None:
    local.commit(10)
    local.shard_files(20)
    local.fs.makedirs(f"{local.root}/{step_dir_name(20)}/manifest.json")
    seen, on_skip = _skips()
    assert newest_valid(local.url, trust(), on_skip=on_skip).step == 10
    assert seen[0][0] == 20 and "manifest.json cannot be read" in seen[0][1]
