"""The tests' checkpoint key (see conftest.py), for tests that write or verify checkpoints
themselves."""

from __future__ import annotations

from stalwart.checkpointing.storage.signing import CheckpointTrust, SigningKey, load_key


def signing_key() -> SigningKey:
    return load_key(None)


def trust(run_id: str | None = None, *, accept_unsigned: bool = False) -> CheckpointTrust:
    return CheckpointTrust(key=signing_key(), accept_unsigned=accept_unsigned, run_id=run_id)
