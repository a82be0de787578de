"""Every test signs and verifies checkpoints with one key of its own, never the user's:
$STALWART_CHECKPOINT_KEY_FILE names it, for this process and every process it starts."""

from __future__ import annotations

import os
import secrets

import pytest

from stalwart.checkpointing.storage.signing import KEY_FILE_ENV


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker per core, at most 4. Every Ray-tier module starts a Ray of its own
    and its runs' workers; more at once would only queue for the same cores and memory."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


@pytest.fixture(scope="session", autouse=True)
def checkpoint_key_file(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("key") / "checkpoint.key"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    before = os.environ.get(KEY_FILE_ENV)
    os.environ[KEY_FILE_ENV] = str(path)
    yield path
    if before is None:
        os.environ.pop(KEY_FILE_ENV, None)
    else:
        os.environ[KEY_FILE_ENV] = before
