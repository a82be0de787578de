"""A failure-free reference run, shared by the ray-tier tests that compare against it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart

# 150 tiny steps, a checkpoint every 10, a metrics row every step.
RUN = [*TINY, "train.steps=150", "checkpoint.persist_every=10", "checkpoint.keep_last=2",
       "run.log_every=1", "data.val_every=50"]


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory) -> Path:
    """Run dir of an uninterrupted run of RUN (same seed as every test's run)."""
    cwd = tmp_path_factory.mktemp("straight")
    stalwart("run", str(REFERENCE_CONFIG), *sets(*RUN), "--run-dir", "straight", cwd=cwd)
    return cwd / "straight"
