"""Numerical faults from the CLI, as a user injects them: a NaN replayed, a spike's batch
skipped, a flipped bit rolled back from memory; each ends with the weights of the failure-free
run (or of the run told to skip the same batch) bit for bit, and no failure."""

from __future__ import annotations

import pytest

from tests.cli_helpers import REFERENCE_CONFIG, sets, stalwart_here
from tests.ray.conftest import RUN
from tests.ray.helpers import assert_same_weights, events_of

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("local_ray")]

SPIKE = ["numerics.spike_z=6", "numerics.spike_warmup=10"]


def numerical(events):
    return [(e["step"], e["fault"], e["action"], e["ranks"], e["rollback_to"])
            for e in events if e["kind"] == "numerical_fault"]


def test_an_injected_nan_is_replayed_to_the_failure_free_weights(tmp_path, straight_run):
    run = stalwart_here("run", str(REFERENCE_CONFIG), *sets(*RUN), "--inject",
                        "nan:rank=1,step=20", "--run-dir", "nan", cwd=tmp_path)
    events = events_of(tmp_path / "nan")
    assert numerical(events) == [(20, "nan", "replay", [], None)]
    assert not [e for e in events if e["kind"] == "failure"]
    # The loss names its rank; the gradients are every rank's after their all-reduce.
    assert ("step 20: nan (loss not finite on rank 1; gradient norm not finite on 2 rank(s)); "
            "replay") in " ".join((run.stdout + run.stderr).split())
    assert_same_weights(tmp_path, straight_run, tmp_path / "nan")


def test_an_injected_spike_is_skipped_like_a_run_told_to_skip_its_batch(tmp_path):
    # The ledger too: the skipped batch counts as consumed, marked as not trained on.
    stalwart_here("run", str(REFERENCE_CONFIG),
                  *sets(*RUN, *SPIKE, "data.ledger=true", "numerics.skip_steps=[30]"),
                  "--run-dir", "told", cwd=tmp_path)
    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*RUN, *SPIKE, "data.ledger=true"),
                  "--inject", "spike:step=30", "--run-dir", "spike", cwd=tmp_path)
    events = events_of(tmp_path / "spike")
    assert numerical(events) == [(30, "spike", "replay", [], None),
                                 (30, "spike", "skip", [], None)]
    assert numerical(events_of(tmp_path / "told")) == []
    assert_same_weights(tmp_path, tmp_path / "told", tmp_path / "spike")
    report = stalwart_here("report", "spike", cwd=tmp_path)
    assert "numerical faults: 2 (spike 2; replay 1, skip 1)" in report.stdout
    assert ("each exactly once; 8 of them in 1 skipped step(s), not trained on"
            in report.stdout)


def test_a_flipped_bit_is_rolled_back_from_memory_and_replayed(tmp_path, straight_run):
    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*RUN, "numerics.fingerprint_every=1"),
                  "--inject", "bitflip:rank=1,step=40", "--run-dir", "flip", cwd=tmp_path)
    events = events_of(tmp_path / "flip")
    # Two replicas: they differ, with no majority to blame one; both roll back to step 38,
    # the newest snapshot taken before the last matching fingerprint (step 39's).
    assert numerical(events) == [(40, "mismatch", "rollback", [0, 1], 38)]
    assert not [e for e in events if e["kind"] == "failure"]
    assert_same_weights(tmp_path, straight_run, tmp_path / "flip")


def test_a_fault_past_max_skips_stops_the_run_with_one_clear_error(tmp_path):
    run = stalwart_here("run", str(REFERENCE_CONFIG),
                        *sets(*RUN, *SPIKE, "numerics.max_skips=0", "failure.max_failures=2"),
                        "--inject", "spike:step=30", "--run-dir", "stopped", cwd=tmp_path,
                        check=None)
    assert run.returncode != 0
    events = events_of(tmp_path / "stopped")
    assert [(e["fault"], e["action"]) for e in events if e["kind"] == "numerical_fault"] == \
        [("spike", "replay"), ("spike", "stop")]
    (failure,) = [e for e in events if e["kind"] == "failure"]
    assert failure["failure_kind"] == "numerics" and not failure["retry"]
    assert "numerical fault at step 30 (spike" in failure["message"]
    assert "numerics.max_skips = 0" in run.stdout + run.stderr
