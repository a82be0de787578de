"""The in-memory checkpoint tier from the CLI on a local Ray, with a sharded layout (FSDP2:
every rank's shard is distinct, so a dead rank's state exists only in its replica).

A kill restores the step before it from memory (only the step in flight is lost); a kill
while a snapshot is staged or replicated restores the step before that one; the final
weights equal a failure-free run's bit for bit every time."""

from __future__ import annotations

import pytest

from stalwart.core.events import read_jsonl
from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart_here
from tests.ray.helpers import assert_same_weights, only

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("local_ray")]

SHARDED = [*TINY, "train.steps=40", "checkpoint.persist_every=10", "checkpoint.keep_last=0",
           "run.log_every=1", "data.val_every=0", "parallel.dp_replicate=1",
           "parallel.dp_shard=-1", "failure.max_failures=1"]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory, local_ray):
    """A failure-free run of SHARDED: what every recovered run must end up equal to."""
    cwd = tmp_path_factory.mktemp("sharded")
    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*SHARDED), "--run-dir", "straight", cwd=cwd)
    return cwd / "straight"


def run_with(tmp_path, fault: str, name: str) -> list[dict]:
    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*SHARDED), "--inject", fault,
                  "--run-dir", name, cwd=tmp_path)
    return read_jsonl(tmp_path / name / "events.jsonl")


def test_the_memory_tier_reports_its_size(sharded_run):
    events = read_jsonl(sharded_run / "events.jsonl")
    tier = only(events, "memory_tier")
    # Two snapshots of its own shard and two of the one it holds for its peer, at least.
    assert tier["bytes_per_worker"] > 0 and tier["replicas"] == 1
    assert tier["bytes_total"] >= tier["bytes_per_worker"]
    # The default limit: 40% of the smallest bound, shared by the node's 2 ranks. Ray's
    # memory resource is below the machine's RAM (the object store takes its share), so
    # the bound is Ray's, or a container's below it; never the RAM.
    assert tier["limit_bound"] in ("ray", "cgroup")
    assert tier["limit_bytes"] == int(0.4 * tier["limit_bound_bytes"] / 2)


@pytest.mark.parametrize("kind", ["kill-staging", "kill-replicating"])
def test_a_kill_during_a_snapshot_restores_the_previous_step(tmp_path, sharded_run, kind):
    # Rank 1 dies after completing step 25, while its snapshot of step 25 is half staged (or
    # half sent): step 25 is not complete in memory, step 24 is.
    events = run_with(tmp_path, f"{kind}:rank=1,step=25", kind)
    assert only(events, "fault_injected")["fault"] == f"{kind}:rank=1,step=25"
    recovered = only(events, "recovered")
    assert recovered == {**recovered, "source": "memory", "from_step": 24, "lost_steps": 1}
    rows = read_jsonl(tmp_path / kind / "metrics.jsonl")
    assert [r["step"] for r in rows].count(25) == 2  # step 25 was trained again
    assert_same_weights(tmp_path, sharded_run, tmp_path / kind)


def test_a_kill_restores_the_step_before_it_from_memory_and_replicas_are_made_again(
        tmp_path, sharded_run):
    # Rank 1 dies as step 25 starts; then rank 0, which holds since that recovery the
    # replica of the other's shard: the new world must have replicated its snapshots anew.
    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*SHARDED, "failure.max_failures=2"),
                  "--inject", "kill:rank=1,step=25", "--inject", "kill:rank=0,step=32",
                  "--run-dir", "twice", cwd=tmp_path)
    events = read_jsonl(tmp_path / "twice" / "events.jsonl")
    first_failure = [e for e in events if e["kind"] == "failure"][0]
    assert first_failure["failure_kind"] == "worker_died" and first_failure["step"] == 24
    recovered = [e for e in events if e["kind"] == "recovered"]
    assert [(e["source"], e["from_step"], e["lost_steps"], e["world_size"])
            for e in recovered] == [("memory", 24, 0, 2), ("memory", 31, 0, 2)]
    # The new rank 1 holds nothing: its shard came from its replica on rank 0.
    assert recovered[0]["peer_fetches"] >= 1
    chosen = [e for e in events if e["kind"] == "checkpoint_chosen"][0]
    assert (chosen["source"], chosen["memory_step"]) == ("memory", 24)
    # Saves are asynchronous: on a loaded machine step 20 may not be committed by step 24.
    assert chosen["storage_step"] in (10, 20)
    assert_same_weights(tmp_path, sharded_run, tmp_path / "twice")


def test_a_tier_that_cannot_fit_fails_with_the_setting_named(tmp_path):
    proc = stalwart_here("run", str(REFERENCE_CONFIG),
                         *sets(*SHARDED, "checkpoint.memory_limit_gb=0.0001"),
                         "--run-dir", "too-big", cwd=tmp_path, check=1)
    assert "the in-memory checkpoint tier needs about" in proc.stdout
    assert "more than checkpoint.memory_limit_gb allows (0.00 GiB)" in proc.stdout
    events = read_jsonl(tmp_path / "too-big" / "events.jsonl")
    assert events[-1]["kind"] == "failed" and events[-1]["step"] == 0
    assert [e["retry"] for e in events if e["kind"] == "failure"] == [False]
