"""Signed manifests and the key they are signed with: what an attacker who can write the
checkpoint storage (but has no key) can and cannot make stalwart accept."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest

from stalwart.checkpointing.errors import CheckpointError, CheckpointKeyError
from stalwart.checkpointing.storage.catalog import newest_valid, read_checkpoint, verify
from stalwart.checkpointing.storage.layout import MANIFEST, step_dir_name
from stalwart.checkpointing.storage.signing import (
    KEY_FILE_ENV,
    TRUSTED_KEYS_ENV,
    CheckpointTrust,
    SigningKey,
    check_signature,
    load_key,
    load_trust_keys,
    sign,
)
from stalwart.checkpointing.storage.writer import write_manifest
from stalwart.core.config import load_config
from stalwart.core.errors import ConfigError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

KEY = SigningKey(secret=b"k" * 40, source="test")
OTHER = SigningKey(secret=b"o" * 40, source="other")


def _commit(storage: Path, step: int, key: SigningKey = KEY, run_id: str = "run-a") -> Path:
    d = storage / step_dir_name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(256)) * 4)
    (d / ".metadata").write_bytes(b"metadata")
    write_manifest(str(storage), step, {"world_size": 1, "run_id": run_id}, key=key, ranks=1)
    return d


def _forge(d: Path, drop_signature: bool = True) -> None:
    """What an attacker without the key can do: rewrite a shard, then recompute the
    manifest's hashes (keeping or dropping its signature)."""
    (d / "__0_0.distcp").write_bytes(b"tampered weights" * 64)
    manifest = json.loads((d / MANIFEST).read_text())
    for name, meta in manifest["files"].items():
        data = (d / name).read_bytes()
        meta.update(size=len(data), sha256=hashlib.sha256(data).hexdigest())
    if drop_signature:
        manifest.pop("signature")
        manifest.pop("key_id")
    (d / MANIFEST).write_text(json.dumps(manifest))


def test_a_signed_checkpoint_verifies(tmp_path: Path) -> None:
    _commit(tmp_path, 10)
    info = verify(read_checkpoint(str(tmp_path), 10), CheckpointTrust(key=KEY, run_id="run-a"))
    assert info.unsigned is None
    assert info.manifest["key_id"] == KEY.key_id and len(info.manifest["signature"]) == 64


@pytest.mark.parametrize("drop_signature, why", [(True, "not signed"),
                                                 (False, "manifest was altered")])
def test_a_tampered_shard_with_a_recomputed_manifest_is_refused(tmp_path: Path,
                                                                 drop_signature, why) -> None:
    _forge(_commit(tmp_path, 10), drop_signature)
    with pytest.raises(CheckpointError, match=why) as err:
        verify(read_checkpoint(str(tmp_path), 10), CheckpointTrust(key=KEY))
    assert "step_000000010" in str(err.value)


def test_an_altered_signed_manifest_is_refused_even_when_trusting_unsigned(tmp_path) -> None:
    _forge(_commit(tmp_path, 10), drop_signature=False)
    with pytest.raises(CheckpointError, match="altered"):
        verify(read_checkpoint(str(tmp_path), 10), CheckpointTrust(key=KEY, accept_unsigned=True))


def test_unsigned_or_foreign_checkpoints_need_trust_unsigned(tmp_path: Path) -> None:
    _commit(tmp_path, 10, key=OTHER)
    _forge(_commit(tmp_path, 20))
    strict = CheckpointTrust(key=KEY)
    skipped: list[str] = []
    assert newest_valid(str(tmp_path), strict, on_skip=lambda s, m: skipped.append(m)) is None
    assert "--trust-unsigned" in skipped[0] and "not signed" in skipped[0]
    assert f"another key (key id {OTHER.key_id}" in skipped[1]
    lenient = CheckpointTrust(key=KEY, accept_unsigned=True)
    newest = newest_valid(str(tmp_path), lenient)
    assert newest.step == 20 and newest.unsigned == "it is not signed"
    older = newest_valid(str(tmp_path), lenient, below=20)
    assert older.step == 10 and "another key" in older.unsigned


def test_trust_unsigned_still_checks_every_file(tmp_path: Path) -> None:
    d = _commit(tmp_path, 10, key=OTHER)
    (d / "__0_0.distcp").write_bytes(b"x" * 1024)  # same size, other bytes
    with pytest.raises(CheckpointError, match="damaged"):
        verify(read_checkpoint(str(tmp_path), 10), CheckpointTrust(key=KEY, accept_unsigned=True))


def test_a_run_loads_only_its_own_signed_checkpoints(tmp_path: Path) -> None:
    _commit(tmp_path, 10, run_id="run-b")
    info = read_checkpoint(str(tmp_path), 10)
    with pytest.raises(CheckpointError, match="belongs to run 'run-b'"):
        verify(info, CheckpointTrust(key=KEY, run_id="run-a"))
    assert verify(info, CheckpointTrust(key=KEY)).unsigned is None  # start_from, export


def test_every_signed_field_is_covered() -> None:
    manifest = sign({"format": 2, "step": 10, "files": {"a": {"size": 1, "sha256": "0"}},
                     "run_id": "r", "ranks": 1}, KEY)
    trust = CheckpointTrust(key=KEY)
    assert check_signature(manifest, trust, "x") is None
    for change in ({"step": 11}, {"run_id": "s"}, {"ranks": 2},
                   {"files": {"a": {"size": 2, "sha256": "0"}}}, {"extra": 1}):
        with pytest.raises(CheckpointError, match="altered"):
            check_signature({**manifest, **change}, trust, "x")


# ---------------------------------------------------------------------------- the key

def test_the_default_key_is_created_once_with_mode_0600(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    key = load_key(None)
    path = tmp_path / ".config" / "stalwart" / "checkpoint.key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_key(None).secret == key.secret and len(key.secret) >= 32
    assert "secret" not in repr(key) and key.secret.decode() not in repr(key)


def test_the_flag_then_the_environment_name_the_key(tmp_path, monkeypatch) -> None:
    a, b = tmp_path / "a.key", tmp_path / "b.key"
    a.write_text("a" * 40)
    b.write_text("b" * 40 + "\n")
    monkeypatch.setenv(KEY_FILE_ENV, str(b))
    assert load_key(None).secret == b"b" * 40
    assert load_key(str(a)).secret == b"a" * 40


def test_a_config_never_names_the_key() -> None:
    with pytest.raises(ConfigError, match="checkpoint.key_file = '/etc/os-release' is no "
                                          "longer read.*--key-file"):
        load_config(None, ["checkpoint.key_file=/etc/os-release"])
    load_config(None, ["checkpoint.key_file="])  # what older config.toml files hold


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "key"
    os.mkfifo(fifo)
    with pytest.raises(CheckpointKeyError, match="not a regular file"):
        load_key(str(fifo))


@pytest.mark.parametrize("mode", [0o620, 0o602, 0o666])
def test_a_key_others_can_write_is_refused(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "x.key"
    path.write_text("k" * 40)
    path.chmod(mode)
    with pytest.raises(CheckpointKeyError, match=f"writable by its group or by others "
                                                 f"\\(mode {mode:o}\\); chmod go-w"):
        load_key(str(path))
    path.chmod(0o644)  # readable is this user's business; writable is not
    assert load_key(str(path)).secret == b"k" * 40


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a file away")
def test_a_key_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.key"
    path.write_text("k" * 40)
    os.chown(path, 4321, -1)
    with pytest.raises(CheckpointKeyError, match="owned by uid 4321"):
        load_key(str(path))


# ------------------------------------------------------------------------ rotation

def test_a_previous_key_verifies_but_never_signs(tmp_path: Path) -> None:
    """Rotation: checkpoints signed with the old key still load, with no --trust-unsigned
    (which would accept any forgery in storage at that moment)."""
    _commit(tmp_path, 10, key=OTHER)
    rotated = CheckpointTrust(key=KEY, previous=(OTHER,), run_id="run-a")
    assert verify(read_checkpoint(str(tmp_path), 10), rotated).unsigned is None
    assert sign({"step": 1}, rotated.key)["key_id"] == KEY.key_id
    with pytest.raises(CheckpointError, match="--trusted-key-file"):
        verify(read_checkpoint(str(tmp_path), 10), CheckpointTrust(key=KEY, run_id="run-a"))


def test_previous_keys_come_from_flags_and_the_environment(tmp_path, monkeypatch) -> None:
    keys = {n: tmp_path / f"{n}.key" for n in ("now", "old1", "old2")}
    for name, path in keys.items():
        path.write_text(name * 20)
        path.chmod(0o600)
    monkeypatch.setenv(TRUSTED_KEYS_ENV, f"{keys['old2']}{os.pathsep}{keys['now']}")
    key, previous = load_trust_keys(str(keys["now"]), (str(keys["old1"]),))
    assert key.secret == b"now" * 20
    assert [k.secret for k in previous] == [b"old1" * 20, b"old2" * 20]  # not the key itself


def test_rewriting_the_key_id_does_not_pass_an_altered_checkpoint(tmp_path: Path) -> None:
    """An altered manifest of this run is refused even with --trust-unsigned, whatever
    key id it claims, and renaming its run does not help on a restore."""
    d = _commit(tmp_path, 10)
    _forge(d, drop_signature=False)
    manifest = json.loads((d / MANIFEST).read_text())
    lenient = CheckpointTrust(key=KEY, accept_unsigned=True, run_id="run-a")
    for change in ({"key_id": "0" * 12}, {"key_id": "0" * 12, "signature": None},
                   {"key_id": "0" * 12, "run_id": "run-z"}):
        (d / MANIFEST).write_text(json.dumps({**manifest, **change}))
        with pytest.raises(CheckpointError, match="names this run|belongs to run 'run-z'"):
            verify(read_checkpoint(str(tmp_path), 10), lenient)


@pytest.mark.parametrize("content, message", [(None, "does not exist"),
                                              ("short", "at least 32")])
def test_a_named_key_file_that_is_missing_or_short_is_an_error(tmp_path, content, message
                                                               ) -> None:
    path = tmp_path / "x.key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(CheckpointKeyError, match=message) as err:
        load_key(str(path))
    assert "--key-file" in str(err.value)
    assert not path.exists() or path.read_text() == content  # never created or replaced


def test_a_home_where_no_key_can_be_created_is_a_clear_error(tmp_path, monkeypatch) -> None:
    home = tmp_path / "home"
    home.write_text("a file, not a directory")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    with pytest.raises(CheckpointKeyError, match="cannot be created.*--key-file"):
        load_key(None)
