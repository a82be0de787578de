"""What the fault-tolerance tests share: a short elastic run, waiting for events, and the
samples a run's final weights were trained on."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from stalwart.core.events import read_jsonl
from tests.cli_helpers import TINY, exported_weights

# 60 tiny steps, a checkpoint every 10, a metrics row every step, gradients summed in one
# order for any world size (so a resized run can be compared bit for bit).
ELASTIC = [*TINY, "train.steps=60", "checkpoint.persist_every=10", "checkpoint.keep_last=0",
           "run.log_every=1", "data.val_every=0", "parallel.dp_replicate=-1",
           "parallel.dp_shard=1", "parallel.invariant_reduction=true",
           "failure.hang_timeout_floor_s=3"]


def consumed_samples(run_dir: Path) -> set[int]:
    """Global sample indices the final weights were trained on: the last record of each step.

    A step trained again after a restore replaces the record of the lost one (the sample
    order is a function of the global index, so the indices name the samples exactly).
    """
    rows = read_jsonl(run_dir / "metrics.jsonl")
    last = {r["step"]: r for r in rows}
    out: set[int] = set()
    for step, row in last.items():
        batch = row["samples_seen"] // step  # the global batch is constant
        out.update(range(row["samples_seen"] - batch, row["samples_seen"]))
    assert len(out) == max(last) * (rows[-1]["samples_seen"] // rows[-1]["step"]), \
        "a sample was trained twice or skipped"
    return out


def events_of(run_dir: Path) -> list[dict[str, Any]]:
    return read_jsonl(run_dir / "events.jsonl")


def only(events: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The one event of this kind (fails if there are none or several)."""
    (found,) = [e for e in events if e["kind"] == kind]
    return found


def assert_same_weights(tmp_path: Path, reference: Path, run_dir: Path) -> None:
    """The run ended with the reference run's weights, bit for bit, trained on its samples."""
    a = exported_weights(reference, tmp_path, reference.name)
    b = exported_weights(run_dir, tmp_path, run_dir.name)
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the failure-free run"
    assert consumed_samples(run_dir) == consumed_samples(reference)


def local_cluster(worker_nodes: int, cpus: int = 2):
    """A ray.cluster_utils.Cluster on this machine: a driver-only head node (0 CPUs) and
    `worker_nodes` nodes of `cpus` CPUs; Ray notices a dead node in ~2 s, not ~15-30 s."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 4,
                           "health_check_initial_delay_ms": 0, "worker_niceness": 0}})
    for _ in range(worker_nodes):
        c.add_node(num_cpus=cpus)
    c.wait_for_nodes()
    return c


@contextlib.contextmanager
def driving(cluster):
    """This process joined to `cluster` as `stalwart run --address` joins it: the driver of
    the runs a test makes here (tests.cli_helpers.stalwart_here)."""
    import ray

    from stalwart.cluster import connect

    connect(cluster.address, num_cpus=0)
    try:
        yield cluster
    finally:
        ray.shutdown()


@contextlib.contextmanager
def driven_cluster(worker_nodes: int):
    """`local_cluster(worker_nodes)` with this process as its driver, shut down after."""
    c = local_cluster(worker_nodes)
    try:
        with driving(c):
            yield c
    finally:
        c.shutdown()
