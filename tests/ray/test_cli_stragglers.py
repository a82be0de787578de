"""A slow rank (an injected sleep in its own work each step) is reported as a straggler, and
with failure.replace_stragglers replaced by a warm spare, the run finishing all the same."""

from __future__ import annotations

import pytest

from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart_here
from tests.ray.helpers import events_of, only

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300), pytest.mark.usefixtures("local_ray")]

# DDP on 2 workers (the layout whose local time is exact), a row every step.
RUN = [*TINY, "train.steps=40", "run.log_every=1", "data.val_every=0",
       "parallel.dp_replicate=-1", "parallel.dp_shard=1", "failure.straggler_steps=5"]


def test_a_slow_rank_is_reported(tmp_path) -> None:
    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*RUN, "scaling.spare_workers=0"),
                  "--inject", "slow:rank=1,step=10", "--run-dir", "slow", cwd=tmp_path)
    events = events_of(tmp_path / "slow")
    straggler = only(events, "straggler")  # reported once, not on every later step
    assert straggler["rank"] == 1 and straggler["replaced"] is False
    assert 14 <= straggler["step"] <= 20  # 5 slow steps in a row after step 10
    assert straggler["ratio"] >= 2.0 and straggler["local_s"] > straggler["peers_median_s"]
    assert not [e for e in events if e["kind"] == "failure"]
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == 40


def test_a_straggler_is_replaced_when_configured(tmp_path) -> None:
    stalwart_here("run", str(REFERENCE_CONFIG),
                  *sets(*RUN, "scaling.spare_workers=1", "failure.replace_stragglers=true",
                   "failure.max_failures=1"),
                  "--inject", "slow:rank=1,step=10", "--run-dir", "replaced", cwd=tmp_path)
    events = events_of(tmp_path / "replaced")
    assert only(events, "straggler")["replaced"] is True
    failure = only(events, "failure")
    assert failure["failure_kind"] == "straggler" and failure["ranks"] == [1]
    recovered = only(events, "recovered")
    assert recovered["lost_steps"] == 0  # restored from memory at the step it stopped
    assert events[-1]["kind"] == "finished" and events[-1]["step"] == 40
