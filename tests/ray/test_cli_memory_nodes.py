"""The in-memory tier across nodes of a Ray cluster (ray.cluster_utils on this machine), with a
sharded layout (FSDP2): losing a node restores its workers' shards from their replicas on
other nodes, resharded to the smaller world, without losing a step; losing two adjacent
nodes of the replica ring at once (replicas=1) loses a shard and its only copy, and the run
falls back to storage and says why."""

from __future__ import annotations

import os
import signal

import pytest

from stalwart.checkpointing.memory.replication import holders_for
from stalwart.core.events import read_jsonl
from stalwart.workers.faults import children_of
from tests.cli_helpers import (
    REFERENCE_CONFIG,
    TINY,
    sets,
    stalwart_here,
    wait_for_commit,
    wait_for_step,
)
from tests.ray.helpers import driving, events_of, local_cluster, only

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

# 4 workers, one CPU each, spread over the nodes; FSDP2 over all of them (distinct shards).
SHARDED4 = [*TINY, "train.steps=50", "checkpoint.persist_every=10", "checkpoint.keep_last=0",
            "run.log_every=1", "data.val_every=0", "parallel.dp_replicate=1",
            "parallel.dp_shard=-1", "scaling.num_workers=4", "scaling.min_workers=1",
            "scaling.placement_strategy=SPREAD",
            "failure.max_failures=3"]


@pytest.fixture(scope="module")
def cluster():
    """A driver-only head node and three worker nodes of 2 CPUs each."""
    c = local_cluster(3)
    try:
        with driving(c):
            yield c
    finally:
        c.shutdown()


def test_a_lost_node_is_restored_from_replicas_resharded(tmp_path, cluster):
    run_dir = tmp_path / "node-lost"
    run = stalwart_here("run", str(REFERENCE_CONFIG), *sets(*SHARDED4), "--address",
                        cluster.address, "--inject", "kill-node:node=2,step=15", "--run-dir",
                        "node-lost", cwd=tmp_path)
    events = events_of(run_dir)
    print(*[{k: v for k, v in e.items() if k not in ("workers", "message")} for e in events],
          sep="\n")  # shown when the test fails
    failure = only(events, "failure")
    assert failure["failure_kind"] == "node_died" and failure["step"] == 14
    # One line of stalwart's names the node and its ranks; Ray's paragraph is in ray.log.
    (node_ip,) = failure["nodes"]
    console = " ".join((run.stdout + run.stderr).split())  # as typed, however it wrapped
    ranks = failure["ranks"]
    held = f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}"
    assert (f"recovering from: node {node_ip} (" in console and
            f"lost, with {held}" in console), console
    assert "(raylet)" not in console
    recovered = only(events, "recovered")
    # Every shard of step 14 survived (the lost node's as replicas): nothing is trained twice.
    assert recovered["source"] == "memory"
    assert recovered["from_step"] == 14 and recovered["lost_steps"] == 0
    # It shrank; it may grow back later, once a new actor is warm on the nodes left.
    resized, *grown = [e for e in events if e["kind"] == "resized"]
    assert resized["old_world_size"] == 4 and resized["new_world_size"] < 4
    assert resized["new_layout"]["dp_shard"] == resized["new_world_size"]  # resharded
    assert all(e["reason"] == "grow" for e in grown)
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, 51))
    assert events[-1]["kind"] == "finished"


def _raylet(node):
    from ray._private import ray_constants

    return node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process


def _forget_dead_nodes(cluster) -> None:
    """Nodes whose raylet a fault killed: cleaned up, so wait_for_nodes counts the rest."""
    for node in list(cluster.worker_nodes):
        if _raylet(node).poll() is not None:
            cluster.remove_node(node, allow_graceful=False)


def _kill_nodes_at_once(cluster, node_ids: set[str]) -> None:
    """SIGKILL the raylets of these nodes and every process they started, all at once."""
    nodes = [n for n in cluster.worker_nodes if n.node_id in node_ids]
    assert len(nodes) == len(node_ids)
    raylets = [_raylet(n).pid for n in nodes]
    doomed = [pid for raylet in raylets for pid in [raylet, *children_of(raylet)]]
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for n in nodes:
        cluster.remove_node(n, allow_graceful=False)


def _three_live_nodes(cluster) -> None:
    """Nodes a fault killed are cleaned up; new ones make three live worker nodes again."""
    _forget_dead_nodes(cluster)
    while len(cluster.worker_nodes) < 3:
        cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()


def test_two_adjacent_nodes_lost_falls_back_to_storage(tmp_path, cluster):
    _three_live_nodes(cluster)  # whatever an earlier test left
    run_dir = tmp_path / "two-lost"

    def kill_rank_0_and_its_replica() -> None:
        wait_for_step(run_dir / "metrics.jsonl", 15, None)
        wait_for_commit(run_dir, None)  # storage must hold a step for the fallback to load
        (workers,) = [e["workers"] for e in events_of(run_dir) if e["kind"] == "workers_started"]
        nodes = [w["node_id"] for w in workers]
        # Rank 0's node and the node holding its replica: both go, and rank 0's shard with
        # them (replicas=1).
        holder = holders_for(nodes, 1)[0][0]
        lost = {nodes[0], nodes[holder]}
        assert len(lost) == 2, f"rank 0's replica should be on another node: {nodes}"
        _kill_nodes_at_once(cluster, lost)

    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*SHARDED4, "scaling.wait_for_workers_s=60"),
                  "--address", cluster.address, "--run-dir", "two-lost", cwd=tmp_path,
                  during=kill_rank_0_and_its_replica)
    events = events_of(run_dir)
    print(*[{k: v for k, v in e.items() if k not in ("workers", "message")} for e in events],
          sep="\n")  # shown when the test fails
    chosen = [e for e in events if e["kind"] == "checkpoint_chosen"]
    assert chosen and chosen[-1]["source"] == "storage"
    assert "is not complete in memory" in chosen[-1]["reason"] or \
        "nothing complete in memory" in chosen[-1]["reason"]
    recovered = [e for e in events if e["kind"] == "recovered"][-1]
    committed = [e["step"] for e in events if e["kind"] == "checkpoint_committed"]
    assert recovered["source"] == "storage" and recovered["from_step"] in committed
    assert recovered["from_step"] % 10 == 0
    assert events[-1]["kind"] == "finished"


def _thaw_and_forget_frozen(cluster) -> None:
    """Nodes a freeze-node fault stopped (raylet in state T): SIGKILL them (a stopped process
    takes SIGKILL at once) and clean them up."""
    from stalwart.workers.node_agent import process_state

    for node in list(cluster.worker_nodes):
        raylet = _raylet(node)
        if raylet.poll() is None and process_state(raylet.pid) == "T":
            for pid in [raylet.pid, *children_of(raylet.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            cluster.remove_node(node, allow_graceful=False)


def test_a_frozen_node_is_noticed_within_a_second_and_restored_from_replicas(tmp_path,
                                                                             cluster):
    _three_live_nodes(cluster)  # whatever an earlier test left
    run_dir = tmp_path / "node-frozen"
    try:
        stalwart_here("run", str(REFERENCE_CONFIG), *sets(*SHARDED4), "--address",
                      cluster.address, "--inject", "freeze-node:node=2,step=25", "--run-dir",
                      "node-frozen", cwd=tmp_path)
    finally:
        _thaw_and_forget_frozen(cluster)
    events = events_of(run_dir)
    print(*[{k: v for k, v in e.items() if k not in ("workers", "message")} for e in events],
          sep="\n")  # shown when the test fails
    # The first world and the one after the freeze (a later one may grow back).
    workers, new_world = [e["workers"] for e in events if e["kind"] == "workers_started"][:2]
    fault = only(events, "fault_injected")
    frozen_node = workers[fault["rank"]]["node_id"]
    failure = only(events, "failure")
    # Its agent went silent (the raylet's socket still accepts connections, and Ray's
    # health check takes far longer): every rank of that node is hung, and only those.
    assert failure["failure_kind"] == "hang" and "stopped answering" in failure["message"]
    assert failure["ranks"] == [r for r, w in enumerate(workers) if w["node_id"] == frozen_node]
    assert failure["step"] == 24 and 0 <= failure["detection_s"] < 30
    # The survivors left their world and trained on: their collectives with the frozen
    # ranks failed when they cut their connections (gloo cannot abort them), so none was
    # stuck, killed and replaced. The world trains on with the survivors (a recovery does
    # not wait for new workers to warm up); never with a worker on the frozen node.
    survivors = {w["pid"] for w in workers if w["node_id"] != frozen_node}
    kept = {w["pid"] for w in new_world} & {w["pid"] for w in workers}
    assert kept and kept <= survivors
    assert all(w["node_id"] != frozen_node for w in new_world)
    recovered = only(events, "recovered")
    assert recovered["source"] == "memory"  # the frozen ranks' shards, from their replicas
    assert recovered["from_step"] == 24 and recovered["lost_steps"] == 0
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, 51))
    assert events[-1]["kind"] == "finished"
