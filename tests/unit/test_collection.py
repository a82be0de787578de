"""The README's test command collects every test folder.

`python -m pytest` from the repository root, with the repository's own config (pyproject's
testpaths, norecursedirs, addopts), run here as a subprocess with --collect-only: each folder
under tests/ that holds test_*.py files must yield tests. A folder that yields none is never
run by CI, and nothing says so: pytest's default norecursedirs skipped tests/dist that way.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit, pytest.mark.timeout(240)]

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"


def folders_with_test_files() -> set[str]:
    """Every folder under tests/ holding test_*.py files, relative to the repository."""
    return {path.parent.relative_to(REPO).as_posix() for path in TESTS.rglob("test_*.py")
            if "__pycache__" not in path.parts}


def collected_per_folder() -> tuple[Counter[str], subprocess.CompletedProcess[str]]:
    """Tests per folder as the README's command collects them (only the repository's config:
    PYTEST_ADDOPTS and PYTEST_PLUGINS from this run are not passed on)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_CURRENT_TEST")}
    # -n 0: collected here, where -q lists every test (pytest-xdist's workers would not).
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=220)
    counts: Counter[str] = Counter()
    for line in proc.stdout.splitlines():
        if "::" in line:
            counts[Path(line.split("::", 1)[0]).parent.as_posix()] += 1
    return counts, proc


def test_every_test_folder_yields_tests_from_the_repository_root() -> None:
    folders = folders_with_test_files()
    assert "tests/dist" in folders and "tests/unit" in folders  # the walk itself works
    counts, proc = collected_per_folder()
    tail = (proc.stdout[-3000:] + proc.stderr[-2000:]).strip()
    assert proc.returncode == 0, f"collection failed (exit {proc.returncode}):\n{tail}"
    empty = sorted(folder for folder in folders if counts[folder] == 0)
    assert empty == [], f"folders whose test_*.py files yield no tests: {empty}\n{tail}"
