"""`stalwart run --profile` and `run.tensorboard` end to end: a trace per rank of exactly the
asked steps, written by the driver into the run dir, and TensorBoard event files whose scalars
are the run's metrics rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from stalwart.core.events import read_jsonl
from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart_here

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180), pytest.mark.usefixtures("local_ray")]


def test_profile_and_tensorboard(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    stalwart_here("run", str(REFERENCE_CONFIG),
                  *sets(*TINY, "train.steps=12", "run.log_every=2",
                   "run.tensorboard=true"),
                  "--profile", "5-6", "--run-dir", str(run_dir), cwd=tmp_path)

    events = read_jsonl(run_dir / "events.jsonl")
    assert events[-1]["kind"] == "finished", events[-1]
    saved = sorted((e for e in events if e["kind"] == "profile_saved"), key=lambda e: e["rank"])
    assert [(e["rank"], e["steps"], e["generation"]) for e in saved] == [(0, [5, 6], 0),
                                                                          (1, [5, 6], 0)]
    traces = sorted((run_dir / "profile").iterdir())
    assert [p.name for p in traces] == ["rank0-step5-6.json", "rank1-step5-6.json"]
    assert [Path(e["path"]) for e in saved] == [p.resolve() for p in traces]
    for path in traces:
        trace = json.loads(path.read_text())["traceEvents"]
        names = [e.get("name", "") for e in trace]
        # the two steps, each under its span, with their ops: forward, backward, all-reduce
        assert [n for n in names if n.startswith("stalwart step")] == ["stalwart step 5",
                                                                       "stalwart step 6"]
        assert names.count("aten::mm") > 10 and "autograd::engine::evaluate_function: " \
            "MmBackward0" in names, path
        assert any("allreduce" in n for n in names), f"no gradient all-reduce in {path}"
    assert (run_dir / "config.toml").read_text().count("profile_steps = [\n    5,\n    6,\n]")

    rows = read_jsonl(run_dir / "metrics.jsonl")
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("loss")] == [
        (r["step"], pytest.approx(r["loss"])) for r in rows]
    assert [(e.step, e.value) for e in acc.Scalars("val_loss")] == [
        (r["step"], pytest.approx(r["val_loss"])) for r in rows if "val_loss" in r]
    assert [e.step for e in acc.Scalars("tokens_per_s")] == [2, 4, 6, 8, 10, 12]
    assert {e.value for e in acc.Scalars("world_size")} == {2}
    assert [e.step for e in acc.Tensors("events/finished/text_summary")] == [12]


def test_a_failure_inside_the_window_is_traced_again_by_the_recovered_world(
        tmp_path: Path) -> None:
    """Rank 1 is killed at the start of step 6: generation 0's trace (step 5 and a broken
    step 6) is dropped, generation 1 restores step 5 from memory and traces steps 6-7."""
    run_dir = tmp_path / "run"
    stalwart_here("run", str(REFERENCE_CONFIG),
                  *sets(*TINY, "train.steps=9", "scaling.spare_workers=1", "failure.max_failures=1",
                   "data.val_every=0"),
                  "--inject", "kill:rank=1,step=6", "--profile", "5-7", "--run-dir", str(run_dir),
                  cwd=tmp_path)

    events = read_jsonl(run_dir / "events.jsonl")
    assert events[-1]["kind"] == "finished", events[-1]
    (recovered,) = [e for e in events if e["kind"] == "recovered"]
    assert recovered["from_step"] == 5 and recovered["generation"] == 1
    saved = sorted((e for e in events if e["kind"] == "profile_saved"), key=lambda e: e["rank"])
    assert [(e["rank"], e["steps"], e["generation"]) for e in saved] == [(0, [6, 7], 1),
                                                                          (1, [6, 7], 1)]
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == [
        "rank0-step6-7.json", "rank1-step6-7.json"]
    for e in saved:
        names = [x.get("name", "") for x in json.loads(Path(e["path"]).read_text())["traceEvents"]]
        assert [n for n in names if n.startswith("stalwart step")] == ["stalwart step 6",
                                                                       "stalwart step 7"]
