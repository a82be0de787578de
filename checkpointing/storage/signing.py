"""Signed manifests: whoever can write checkpoint storage cannot make stalwart load what
it did not write.

A manifest lists every file's size and sha256; its HMAC-SHA256 under a key that never
lives in checkpoint storage makes the list itself unforgeable. A checkpoint verifies when
its signature matches and every file matches the list (checked as the file is read).

The key comes from `--key-file`, else the file named by $STALWART_CHECKPOINT_KEY_FILE, else
~/.config/stalwart/checkpoint.key, created on first use with mode 0600. Never from a config
or a run directory: those travel, and whoever hands one over must not choose the key.
Previous keys (`--trusted-key-file`, $STALWART_CHECKPOINT_TRUSTED_KEY_FILES) verify, never
sign: a key is rotated without trusting unsigned checkpoints.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.checkpointing.errors import CheckpointError, CheckpointKeyError
from stalwart.core.ownership import why_not_own

KEY_FILE_ENV = "STALWART_CHECKPOINT_KEY_FILE"
TRUSTED_KEYS_ENV = "STALWART_CHECKPOINT_TRUSTED_KEY_FILES"
"""Previous keys, for verification only: paths separated by os.pathsep."""
DEFAULT_KEY_FILE = "~/.config/stalwart/checkpoint.key"
MIN_KEY_CHARS = 32
MAX_KEY_BYTES = 4096  # a key is a line of hex; anything larger is the wrong file
_DOMAIN = b"stalwart checkpoint manifest v1\n"  # a signature of nothing else verifies here
SIGNED_FIELDS_EXCLUDE = ("signature",)


@dataclass(frozen=True)
class SigningKey:
    """The secret, and a short public id of it (so an error can say which key signed)."""

    secret: bytes = field(repr=False)
    source: str
    """Where it was read from, for messages."""

    @property
    def key_id(self) -> str:
        return hashlib.sha256(b"stalwart key id\n" + self.secret).hexdigest()[:12]


@dataclass(frozen=True, kw_only=True)
class CheckpointTrust:
    """What a reader accepts: checkpoints signed with `key`, and with `accept_unsigned`
    (--trust-unsigned) also unsigned ones and those signed with another key. Files must
    match the manifest either way. `run_id`: a signed manifest must name this run (None:
    any run, for start_from and export)."""

    key: SigningKey
    accept_unsigned: bool = False
    run_id: str | None = None
    previous: tuple[SigningKey, ...] = ()
    """Keys that signed before a rotation: they verify, but nothing is signed with them."""

    def for_any_run(self) -> CheckpointTrust:
        return dataclasses.replace(self, run_id=None)

    def verifying_keys(self) -> tuple[SigningKey, ...]:
        return (self.key, *self.previous)


def key_file_path(flag: str | Path | None) -> tuple[Path, str]:
    """The key file and what named it: `--key-file`, the environment, or the default."""
    if flag:
        return Path(flag).expanduser(), "--key-file"
    if os.environ.get(KEY_FILE_ENV):
        return Path(os.environ[KEY_FILE_ENV]).expanduser(), f"${KEY_FILE_ENV}"
    return Path(DEFAULT_KEY_FILE).expanduser(), "the default key file"


def load_key(flag: str | Path | None = None) -> SigningKey:
    """Read the signing key; the default key file is created (0600) if there is none."""
    path, named_by = key_file_path(flag)
    where = f"{named_by} {str(path)!r}"
    if named_by == "the default key file" and not path.exists():
        _create_key_file(path, where)
    return read_key_file(path, where)


def load_trust_keys(flag: str | Path | None = None, trusted: tuple[str | Path, ...] = ()
                    ) -> tuple[SigningKey, tuple[SigningKey, ...]]:
    """The signing key and the previous keys trusted for verification: `trusted` (each
    `--trusted-key-file`) and those $STALWART_CHECKPOINT_TRUSTED_KEY_FILES names."""
    env = [p for p in os.environ.get(TRUSTED_KEYS_ENV, "").split(os.pathsep) if p]
    previous = [read_key_file(Path(p).expanduser(), f"--trusted-key-file {str(p)!r}")
                for p in trusted]
    previous += [read_key_file(Path(p).expanduser(), f"${TRUSTED_KEYS_ENV} entry {p!r}")
                 for p in env]
    key = load_key(flag)
    return key, tuple(k for k in previous if k.key_id != key.key_id)


def read_key_file(path: Path, where: str) -> SigningKey:
    """A key file's secret, once the file is shown to be a key: a regular file (a FIFO or
    a device would hang or never end), small, and writable by its owner alone, who is this
    user or root (anyone else who can write it can swap the key)."""
    try:
        # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointKeyError(f"{where} does not exist; create one with `python -c "
                                 f"\"import secrets; print(secrets.token_hex(32))\" > FILE` "
                                 f"and chmod 600 FILE") from None
    except OSError as exc:
        raise CheckpointKeyError(f"{where} cannot be read: {exc.strerror or exc}") from None
    try:
        check_key_file_stat(os.fstat(fd), where)
        secret = os.read(fd, MAX_KEY_BYTES + 1).strip()
    except OSError as exc:
        raise CheckpointKeyError(f"{where} cannot be read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)
    if len(secret) > MAX_KEY_BYTES:
        raise CheckpointKeyError(f"{where} is larger than {MAX_KEY_BYTES} bytes: not a key file")
    if len(secret) < MIN_KEY_CHARS:
        raise CheckpointKeyError(f"{where} holds {len(secret)} characters; a key needs at "
                                 f"least {MIN_KEY_CHARS} (e.g. secrets.token_hex(32))")
    return SigningKey(secret=secret, source=where)


def check_key_file_stat(st: os.stat_result, where: str) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointKeyError(f"{where} is not a regular file; a key file holds one line "
                                 f"of hex")
    if (why := why_not_own(st)) is not None:
        raise CheckpointKeyError(f"{where}: {why}")


def _create_key_file(path: Path, where: str) -> None:
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return  # another process created it just now: read theirs
    except OSError as exc:
        raise CheckpointKeyError(f"{where} cannot be created: {exc.strerror or exc}; pass "
                                 f"--key-file or set ${KEY_FILE_ENV}") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _signed_bytes(manifest: dict[str, Any]) -> bytes:
    body = {k: v for k, v in manifest.items() if k not in SIGNED_FIELDS_EXCLUDE}
    return _DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":"),
                                allow_nan=False).encode()


def sign(manifest: dict[str, Any], key: SigningKey) -> dict[str, Any]:
    """The manifest with its key id and signature added."""
    body = {**{k: v for k, v in manifest.items() if k not in SIGNED_FIELDS_EXCLUDE},
            "key_id": key.key_id}
    mac = hmac.new(key.secret, _signed_bytes(body), hashlib.sha256).hexdigest()
    return {**body, "signature": mac}


def check_signature(manifest: dict[str, Any], trust: CheckpointTrust, where: str
                    ) -> str | None:
    """None when `manifest` is signed with a trusted key (and names the trusted run);
    else why not, when `trust` accepts that; else raise naming the checkpoint and why.

    Refused even with --trust-unsigned: a manifest that claims a trusted key's id but does
    not verify (altered), and on a restore one that names this run but no trusted key signed
    (this run signs all it writes). Renaming the run does not pass either: a restore refuses
    a manifest naming another run, signed or not."""
    run = manifest.get("run_id")
    if trust.run_id is not None and run is not None and run != trust.run_id:
        raise CheckpointError(f"{where} belongs to run {run!r}, not to this run "
                              f"({trust.run_id}); a run loads only its own checkpoints from "
                              f"its storage")
    signature = manifest.get("signature")
    if isinstance(signature, str) and any(_verifies(manifest, signature, key)
                                          for key in trust.verifying_keys()):
        return None
    signer = manifest.get("key_id")
    if isinstance(signature, str) and signer in {k.key_id for k in trust.verifying_keys()}:
        raise CheckpointError(f"{where} is refused: its signature does not match its content "
                              f"(the manifest was altered)")
    why = ("it is not signed" if not isinstance(signature, str) else
           f"it is signed with another key (key id {signer}; this key is "
           f"{trust.key.key_id}, from {trust.key.source})")
    if trust.run_id is not None and run == trust.run_id:
        raise CheckpointError(f"{where} is refused: it names this run, but {why}; this run "
                              f"signs what it writes (after a key rotation, name the old key "
                              f"with --trusted-key-file)")
    if trust.accept_unsigned:
        return why
    raise CheckpointError(f"{where} is refused: {why}; --trust-unsigned accepts it if you "
                          f"know where it comes from, and --trusted-key-file accepts a key "
                          f"you rotated away from")


def _verifies(manifest: dict[str, Any], signature: str, key: SigningKey) -> bool:
    expected = hmac.new(key.secret, _signed_bytes(manifest), hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, signature)
