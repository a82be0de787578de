"""Signed manifests: whoever can write checkpoint storage cannot make stalwart load what
it did not write.

A manifest lists every file's size and sha256; its HMAC-SHA256 under a key that never
lives in checkpoint storage makes the list itself unforgeable. A checkpoint verifies when
its signature matches and every file matches the list (checked before anything of it is
deserialised).

The key comes from `checkpoint.key_file`, else the file named by
$STALWART_CHECKPOINT_KEY_FILE, else ~/.config/stalwart/checkpoint.key, created on first
use with mode 0600. The driver reads it; workers get it from the driver.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.checkpointing.errors import CheckpointError, CheckpointKeyError

KEY_FILE_ENV = "STALWART_CHECKPOINT_KEY_FILE"
DEFAULT_KEY_FILE = "~/.config/stalwart/checkpoint.key"
MIN_KEY_CHARS = 32
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

    def for_any_run(self) -> CheckpointTrust:
        return CheckpointTrust(key=self.key, accept_unsigned=self.accept_unsigned)


def key_file_path(configured: str | None) -> tuple[Path, str]:
    """The key file and what named it: the config, the environment, or the default."""
    if configured:
        return Path(configured).expanduser(), "checkpoint.key_file"
    if os.environ.get(KEY_FILE_ENV):
        return Path(os.environ[KEY_FILE_ENV]).expanduser(), f"${KEY_FILE_ENV}"
    return Path(DEFAULT_KEY_FILE).expanduser(), "the default key file"


def load_key(configured: str | None) -> SigningKey:
    """Read the signing key; the default key file is created (0600) if there is none."""
    path, named_by = key_file_path(configured)
    where = f"{named_by} {str(path)!r}"
    if named_by == "the default key file" and not path.exists():
        _create_key_file(path, where)
    try:
        secret = path.read_bytes().strip()
    except FileNotFoundError:
        raise CheckpointKeyError(f"{where} does not exist; create one with `python -c "
                                 f"\"import secrets; print(secrets.token_hex(32))\" > FILE` "
                                 f"and chmod 600 FILE") from None
    except OSError as exc:
        raise CheckpointKeyError(f"{where} cannot be read: {exc.strerror or exc}") from None
    if len(secret) < MIN_KEY_CHARS:
        raise CheckpointKeyError(f"{where} holds {len(secret)} characters; a key needs at "
                                 f"least {MIN_KEY_CHARS} (e.g. secrets.token_hex(32))")
    return SigningKey(secret=secret, source=where)


def _create_key_file(path: Path, where: str) -> None:
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return  # another process created it just now: read theirs
    except OSError as exc:
        raise CheckpointKeyError(f"{where} cannot be created: {exc.strerror or exc}; set "
                                 f"checkpoint.key_file or ${KEY_FILE_ENV}") from None
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
    """None when `manifest` is signed with the trusted key (and names the trusted run);
    else why not, when `trust` accepts that; else raise naming the checkpoint and why."""
    signature = manifest.get("signature")
    altered = False
    if not isinstance(signature, str):
        why = "it is not signed"
    else:
        expected = hmac.new(trust.key.secret, _signed_bytes(manifest), hashlib.sha256)
        if hmac.compare_digest(expected.hexdigest(), signature):
            run = manifest.get("run_id")
            if trust.run_id is not None and run != trust.run_id:
                raise CheckpointError(f"{where} belongs to run {run!r}, not to this run "
                                      f"({trust.run_id}); a run loads only its own "
                                      f"checkpoints from its storage")
            return None
        signer = manifest.get("key_id")
        # Signed with this key's id but not matching: altered after signing. Refused even
        # with --trust-unsigned, which is for checkpoints made elsewhere.
        altered = signer == trust.key.key_id
        why = ("its signature does not match its content (the manifest was altered)"
               if altered else f"it is signed with another key (key id {signer}; this "
                               f"key is {trust.key.key_id}, from {trust.key.source})")
    if trust.accept_unsigned and not altered:
        return why
    hint = "" if altered else "; --trust-unsigned accepts it if you know where it comes from"
    raise CheckpointError(f"{where} is refused: {why}{hint}")
