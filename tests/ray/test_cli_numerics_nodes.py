"""A replica that differs from its majority, on a multi-node Ray cluster (ray.cluster_utils on
this machine): it is evicted as a faulty device, no new worker lands on its node, and the run
ends with the weights of a one-worker run bit for bit (with parallel.invariant_reduction)."""

from __future__ import annotations

import pytest
import torch

from stalwart.core.events import read_jsonl
from tests.cli_helpers import REFERENCE_CONFIG, exported_weights, sets, stalwart_here
from tests.ray.helpers import ELASTIC, consumed_samples, driven_cluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster():
    """A driver-only head node and three worker nodes of 2 CPUs each: three replicas and a
    spare fit, and so does a new worker off whichever node is excluded."""
    with driven_cluster(3) as c:
        yield c


def test_a_replica_that_differs_is_evicted_and_its_node_excluded(tmp_path, cluster):
    # Three data-parallel replicas: a flipped bit on rank 1 is outvoted by the other two, and
    # with numerics.evict_after = 1 that one mismatch marks its device faulty. The world
    # waits for all three (min_workers = 3).
    run = [*ELASTIC, "train.steps=40", "train.global_batch_size=12"]
    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*run, "scaling.num_workers=1"),
                  "--address", cluster.address, "--run-dir", "reference", cwd=tmp_path)
    stalwart_here("run", str(REFERENCE_CONFIG),
                  *sets(*run, "scaling.num_workers=3", "scaling.min_workers=3",
                        "scaling.spare_workers=1", "numerics.fingerprint_every=1",
                        "numerics.evict_after=1", "failure.max_failures=1"),
                  "--address", cluster.address, "--inject", "bitflip:rank=1,step=20",
                  "--run-dir", "evicted", cwd=tmp_path)
    events = read_jsonl(tmp_path / "evicted" / "events.jsonl")
    (decision,) = [e for e in events if e["kind"] == "numerical_fault"]
    assert (decision["fault"], decision["action"], decision["ranks"],
            decision["rollback_to"]) == ("mismatch", "evict", [1], 18)
    (failure,) = [e for e in events if e["kind"] == "failure"]
    assert failure["failure_kind"] == "faulty_device" and failure["ranks"] == [1]
    (recovered,) = [e for e in events if e["kind"] == "recovered"]
    # The snapshots after the last matching fingerprint were forgotten: step 18 is restored.
    assert recovered["from_step"] == 18 and recovered["source"] == "memory"
    worlds = [e["workers"] for e in events if e["kind"] == "workers_started"]
    faulty_node = worlds[0][1]["node_id"]
    first_pids = {w["pid"] for w in worlds[0]}
    for world in worlds[1:]:  # only survivors of the first world may still be on that node
        assert all(w["pid"] in first_pids for w in world if w["node_id"] == faulty_node)
        assert worlds[0][1]["pid"] not in {w["pid"] for w in world}
    assert events[-1]["kind"] == "finished"
    assert consumed_samples(tmp_path / "evicted") == consumed_samples(tmp_path / "reference")
    a = exported_weights(tmp_path / "reference", tmp_path, "reference")
    b = exported_weights(tmp_path / "evicted", tmp_path, "evicted")
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs after the eviction"
