"""Losing a whole node on a multi-node Ray cluster (ray.cluster_utils on this machine): the
world shrinks to the surviving node, grows back when a node returns, and the final weights
equal a failure-free run's bit for bit (with parallel.invariant_reduction)."""

from __future__ import annotations

import subprocess
import textwrap

import pytest
import torch

from stalwart.core.events import read_jsonl
from tests.cli_helpers import (
    REFERENCE_CONFIG,
    STALWART,
    exported_weights,
    sets,
    stalwart_here,
    wait_for_event,
)
from tests.ray.helpers import ELASTIC, consumed_samples, driven_cluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

# The reference task, 0.2 s slower per micro-batch (a sleep: no CPU, no change to the
# numbers): the small world then trains long enough for the returning node's workers to
# start, however loaded the machine is.
PATIENT_TASK = textwrap.dedent('''
    import time

    from stalwart.examples.gpt.task import GPTTask


    class PatientTask(GPTTask):
        def loss(self, model, inputs, targets):
            time.sleep(0.2)
            return super().loss(model, inputs, targets)
''')
# The failure-free reference trains the reference task itself (the sleep changes no number)
# on one worker: with invariant_reduction the weights are the same at every world size.
REFERENCE = [*ELASTIC, "train.steps=120", "scaling.num_workers=1"]
WORLD4 = [*ELASTIC, "train.steps=120", "scaling.num_workers=4", "scaling.min_workers=2",
          "task.path=patient_task:PatientTask"]


@pytest.fixture(scope="module")
def cluster():
    """A driver-only head node and two worker nodes of 2 CPUs each."""
    with driven_cluster(2) as c:
        yield c


def test_node_loss_shrinks_then_grows_back_bit_identical(tmp_path, cluster):
    (tmp_path / "patient_task.py").write_text(PATIENT_TASK)
    reference = tmp_path / "reference"
    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*REFERENCE), "--address",
                  cluster.address, "--run-dir", "reference", cwd=tmp_path)

    # A process of its own: Ray adds a node from the main thread only, and the test's is
    # free to do so while this run trains.
    run_dir = tmp_path / "node-loss"
    proc = subprocess.Popen(
        [STALWART, "run", str(REFERENCE_CONFIG), *sets(*WORLD4, "failure.max_failures=2",
                                                       "scaling.resize_check_s=2"),
         "--address", cluster.address, "--inject", "kill-node:node=2,step=25",
         "--run-dir", "node-loss"], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        shrunk = wait_for_event(run_dir / "events.jsonl", "resized", proc, timeout=300)
        cluster.add_node(num_cpus=2)  # the node comes back
        out, err = proc.communicate(timeout=400)
    finally:
        proc.kill()
    assert proc.returncode == 0, f"{out}\n{err}"

    events = read_jsonl(run_dir / "events.jsonl")
    print(*[{k: v for k, v in e.items() if k not in ("workers", "message")} for e in events],
          sep="\n")  # shown when the test fails
    first = [e for e in events if e["kind"] == "workers_started"][0]["workers"]
    (fault,) = [e for e in events if e["kind"] == "fault_injected"]
    lost_node = first[fault["rank"]]["node_id"]
    (failure,) = [e for e in events if e["kind"] == "failure"]
    assert failure["failure_kind"] == "node_died" and len(failure["ranks"]) == 2
    assert sorted(failure["ranks"]) == [w["rank"] for w in first if w["node_id"] == lost_node]
    assert failure["retry"] and failure["detection_s"] is not None
    resized = [e for e in events if e["kind"] == "resized"]
    assert resized[0] == shrunk
    assert [(e["old_world_size"], e["new_world_size"], e["reason"]) for e in resized] == [
        (4, 2, "shrink"), (2, 4, "grow")]
    # Resizing keeps the layout's shape and changes the data-parallel degree only.
    assert resized[0]["new_layout"] == {"dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1,
                                           "ep": 1}
    (recovered,) = [e for e in events if e["kind"] == "recovered"]
    # Restored from the survivors' memory: the step before the node was lost, no step lost.
    assert recovered["world_size"] == 2 and recovered["source"] == "memory"
    assert recovered["from_step"] == 24 and recovered["lost_steps"] == 0
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert {2, 4} == {r["world_size"] for r in rows}
    assert events[-1]["kind"] == "finished"

    assert consumed_samples(run_dir) == consumed_samples(reference)
    a = exported_weights(reference, tmp_path, "reference")
    b = exported_weights(run_dir, tmp_path, "node-loss")
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs after shrinking and growing back"


def test_drained_node_is_left_at_a_checkpoint_without_losing_a_step(tmp_path, cluster):
    # One worker per node; Ray is asked to drain rank 1's node (as a preemption notice).
    # The drain is seen at the next resize check and the world leaves after the step then in
    # flight: about 2.5 s here, 50 of these tiny steps, more on a busy machine. 300 steps
    # leave room for it.
    run_dir = tmp_path / "drained"
    stalwart_here("run", str(REFERENCE_CONFIG),
                  *sets(*ELASTIC, "train.steps=300", "scaling.num_workers=2",
                        "scaling.min_workers=1", "scaling.placement_strategy=SPREAD",
                        "scaling.resize_check_s=1"),
                  "--address", cluster.address, "--inject", "drain:node=2,step=15",
                  "--run-dir", "drained", cwd=tmp_path)
    events = read_jsonl(run_dir / "events.jsonl")
    assert not [e for e in events if e["kind"] == "failure"]
    # The drained node is left first: the world shrinks, or keeps its size where a new actor
    # on the other node is warm by then (timing); it may grow back once the drain has passed.
    resized, *later = [e for e in events if e["kind"] == "resized"]
    assert (resized["reason"], resized["old_world_size"]) == ("drain", 2)
    assert resized["new_world_size"] in (1, 2)
    worlds = {e["generation"]: e["workers"] for e in events if e["kind"] == "workers_started"}
    drained = worlds[0][1]["node_id"]  # rank 1's node
    assert drained not in {w["node_id"] for w in worlds[resized["generation"]]}
    assert all(e["reason"] == "grow" for e in later), later
    committed = [e["step"] for e in events if e["kind"] == "checkpoint_committed"]
    assert resized["step"] in committed  # every rank stopped there and checkpointed it
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, 301))  # no step lost or trained twice
    consumed_samples(run_dir)
    assert events[-1]["kind"] == "finished"

