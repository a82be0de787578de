"""What the ray-tier tests share: a local Ray for the runs made in the test's own process
(tests.cli_helpers.stalwart_here), and a failure-free reference run to compare with."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from filelock import FileLock

from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart
from tests.conftest import session_root

# 80 tiny steps, a checkpoint every 10, a metrics row every step. The faults land by step 35;
# the steps after them show the run goes on as the straight one did.
STEPS = 80
RUN = [*TINY, f"train.steps={STEPS}", "checkpoint.persist_every=10", "checkpoint.keep_last=2",
       "run.log_every=1", "data.val_every=50", "scaling.spare_workers=1"]
# For runs that nothing fails: the example's warm spare would only start and wait.
NO_SPARE = "scaling.spare_workers=0"


@pytest.fixture(scope="session")
def _shared_ray_stops_at_the_end():
    yield
    import ray

    ray.shutdown()


def _all_cpus_free(wait_s: float = 10.0) -> bool:
    """Whether the Ray this process joined holds no CPU for anything (Ray frees a finished
    run's CPUs a moment after its actors exit)."""
    import ray

    deadline = time.monotonic() + wait_s
    while True:
        if ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU"):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.fixture(scope="module")
def local_ray(_shared_ray_stops_at_the_end):
    """A Ray as `stalwart run` starts its own on this machine (stalwart.cluster: its system
    config, its cores plus one for the example's warm spare), for the runs made in this
    process. One serves every module of the process that asks for it: a start costs seconds
    of CPU. Another module stops it first (tests/conftest.py), and a module that finds CPUs
    still held in it (a run that did not end) starts a fresh one."""
    import ray

    from stalwart.cluster import connect

    if ray.is_initialized() and not _all_cpus_free():
        ray.shutdown()
    connect(None, num_cpus=(os.cpu_count() or 1) + 1)
    yield


@pytest.fixture(scope="session")
def straight_run(tmp_path_factory) -> Path:
    """Run dir of an uninterrupted run of RUN (same seed as every test's run). No warm spare:
    nothing fails, and a spare never trains. Made once for all of pytest-xdist's workers:
    the first to need it runs it under a lock in their shared temp root."""
    root = session_root(tmp_path_factory)
    cwd, done = root / "straight", root / "straight.done"
    with FileLock(str(root / "straight.lock")):
        if not done.exists():
            cwd.mkdir(exist_ok=True)
            stalwart("run", str(REFERENCE_CONFIG), *sets(*RUN, NO_SPARE), "--run-dir",
                     "straight", cwd=cwd)
            done.touch()
    return cwd / "straight"
