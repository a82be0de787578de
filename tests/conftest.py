"""Every test signs and verifies checkpoints with one key of its own, never the user's:
$STALWART_CHECKPOINT_KEY_FILE names it, for this process and every process it starts. The
key is one for the whole session, shared by pytest-xdist's workers: a run one worker made
(the shared reference run) verifies in another."""

from __future__ import annotations

import os
import secrets
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from stalwart.checkpointing.storage.signing import KEY_FILE_ENV


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: a worker per core, at most 4. Every Ray-tier module starts a Ray of its own
    and its runs' workers; more at once would only queue for the same cores and memory."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` (addopts), with a worker's death reported once instead of hanging
    the session: tests/xdist_scheduling.py."""
    if config.getvalue("dist") != "loadfile":
        return None
    from tests.xdist_scheduling import CrashSafeLoadFileScheduling

    return CrashSafeLoadFileScheduling(config, log)


def session_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This session's temp root, the same for all of pytest-xdist's workers (each has its own
    base temp below it)."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


@pytest.fixture(autouse=True)
def same_import_path_and_cwd():
    """Each test starts with the worker's sys.path and working directory. A test that runs
    the CLI's main() in-process changes sys.path (a command adds the working directory, or
    drops it); a later test's spawned processes inherit sys.path and would miss the
    repository's own packages (bench, tests)."""
    path, cwd = list(sys.path), os.getcwd()
    yield
    sys.path[:] = path
    if os.getcwd() != cwd:
        os.chdir(cwd)


@pytest.fixture(scope="module", autouse=True)
def no_ray_of_another_module(request: pytest.FixtureRequest):
    """A module that does not share tests/ray's local Ray starts without it: it joins a
    cluster of its own, or checks that a command leaves Ray down."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized() and "local_ray" not in request.fixturenames:
        ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def checkpoint_key_file(tmp_path_factory: pytest.TempPathFactory):
    root = session_root(tmp_path_factory)
    path = root / "checkpoint.key"
    with FileLock(str(root / "checkpoint.key.lock")):
        if not path.exists():
            path.write_text(secrets.token_hex(32) + "\n")
            path.chmod(0o600)
    before = os.environ.get(KEY_FILE_ENV)
    os.environ[KEY_FILE_ENV] = str(path)
    yield path
    if before is None:
        os.environ.pop(KEY_FILE_ENV, None)
    else:
        os.environ[KEY_FILE_ENV] = before
