"""A failure-free reference run, shared by the ray-tier tests that compare against it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart

# 80 tiny steps, a checkpoint every 10, a metrics row every step. The faults land by step 35;
# the steps after them show the run goes on as the straight one did.
STEPS = 80
RUN = [*TINY, f"train.steps={STEPS}", "checkpoint.persist_every=10", "checkpoint.keep_last=2",
       "run.log_every=1", "data.val_every=50"]
# For runs that nothing fails: the example's warm spare would only start and wait.
NO_SPARE = "scaling.spare_workers=0"


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory) -> Path:
    """Run dir of an uninterrupted run of RUN (same seed as every test's run). No warm spare:
    nothing fails, and a spare never trains."""
    cwd = tmp_path_factory.mktemp("straight")
    stalwart("run", str(REFERENCE_CONFIG), *sets(*RUN, NO_SPARE), "--run-dir", "straight",
             cwd=cwd)
    return cwd / "straight"
