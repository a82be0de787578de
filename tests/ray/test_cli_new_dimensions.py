"""Context- and expert-parallel runs from the CLI on a local Ray: a rank killed mid-run is
restored from the in-memory tier with no step lost, and the run ends bit-identical to one
never killed.

cp = 2 on 2 workers: each rank holds half of every sequence and half of every parameter
(FSDP2 shards over dp_shard x cp). ep = 2 on 2 workers (the MoE example): each rank holds
half of the dense parameters and half of every layer's experts. Either way the dead rank's
state exists only in its replica on the other."""

from __future__ import annotations

import pytest

from stalwart.core.events import read_jsonl
from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart_here
from tests.ray.helpers import assert_same_weights, only

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("local_ray")]

CONTEXT = [*TINY, "train.steps=20", "checkpoint.persist_every=10", "checkpoint.keep_last=0",
           "run.log_every=1", "data.val_every=0", "parallel.dp_replicate=1",
           "parallel.dp_shard=1", "parallel.cp=2", "failure.max_failures=1"]


MOE_CONFIG = REFERENCE_CONFIG.parents[1] / "moe" / "config.toml"
EXPERTS = [*TINY, "task.args.n_experts=4", "train.steps=20", "checkpoint.persist_every=10",
           "checkpoint.keep_last=0", "run.log_every=1", "data.val_every=0",
           "parallel.dp_replicate=1", "parallel.dp_shard=2", "parallel.ep=2",
           "failure.max_failures=1"]


@pytest.mark.parametrize(("config", "overrides", "key"), [
    pytest.param(REFERENCE_CONFIG, CONTEXT, "cp = 2", id="cp2"),
    pytest.param(MOE_CONFIG, EXPERTS, "ep = 2", id="ep2"),
])
def test_a_killed_rank_is_restored_from_memory_with_no_step_lost(tmp_path, config, overrides,
                                                                 key):
    stalwart_here("run", str(config), *sets(*overrides), "--run-dir", "straight", cwd=tmp_path)
    stalwart_here("run", str(config), *sets(*overrides), "--inject", "kill:rank=1,step=13",
                  "--run-dir", "killed", cwd=tmp_path)
    events = read_jsonl(tmp_path / "killed" / "events.jsonl")
    assert key in (tmp_path / "killed" / "config.toml").read_text()
    recovered = only(events, "recovered")
    assert (recovered["source"], recovered["from_step"], recovered["lost_steps"]) == (
        "memory", 12, 0)
    assert_same_weights(tmp_path, tmp_path / "straight", tmp_path / "killed")
