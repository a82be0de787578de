"""scaling.placement_strategy = "SPREAD" on a real two-node cluster (ray.cluster_utils on this
machine): with 2 workers and a warm spare, one node must hold two of the three actors, and
the world's two ranks are still on different nodes, whichever actors warmed up first."""

from __future__ import annotations

import pytest

from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart_here
from tests.ray.helpers import driving, events_of, local_cluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster():
    """A driver-only head, a node of 2 CPUs and one of 1: three actors fill them."""
    c = local_cluster(1, cpus=2)
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    try:
        with driving(c):
            yield c
    finally:
        c.shutdown()


def test_the_ranks_spread_over_the_nodes_and_the_spare_shares_one(tmp_path, cluster):
    stalwart_here("run", str(REFERENCE_CONFIG),
                  *sets(*TINY, "train.steps=2", "train.warmup_steps=1", "data.val_every=0", "scaling.num_workers=2",
                        "scaling.spare_workers=1", "scaling.placement_strategy=SPREAD"),
                  "--address", cluster.address, "--run-dir", "spread", cwd=tmp_path)
    events = events_of(tmp_path / "spread")
    (world,) = [e["workers"] for e in events if e["kind"] == "workers_started"]
    assert len({w["node_id"] for w in world}) == 2, world
    assert events[-1]["kind"] == "finished"
