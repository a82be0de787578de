"""The snapshot budget benchmark's pure parts (bench/snapshot_budget.py): its runners' settings
as `stalwart run` gets them, an auto run's schedule read from made-up events, the rows, the
table and the verdict. The runs themselves are the benchmark, not a test."""

from __future__ import annotations

import pytest

from bench import snapshot_budget as sb
from stalwart.core.config import load_config, parse_fault

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_the_runners_are_the_tier_off_every_step_and_auto_on_both_links() -> None:
    assert sb.runner_overrides(sb.OFF, 0.02) == [
        "parallel.dp_replicate=1", "parallel.dp_shard=-1", "checkpoint.snapshot_every=0"]
    auto = sb.runner_overrides(f"{sb.AUTO}, {sb.SLOW}", 0.05)
    assert auto[-2:] == ["checkpoint.snapshot_every=auto", "checkpoint.snapshot_budget=0.05"]
    config = load_config(None, auto)  # what stalwart run is given loads
    assert config.checkpoint.snapshot_every == "auto" and config.checkpoint.snapshot_budget == 0.05
    assert sb.injects(sb.EVERY, 20) == []
    flag, spec = sb.injects(f"{sb.EVERY}, {sb.SLOW}", 20.0)
    assert flag == "--inject" and str(parse_fault(spec)) == "slow-link:rank=1,step=2,mbps=20"


def test_the_arguments_and_their_checks() -> None:
    args = sb.parse_args([])
    assert (args.steps, args.exclude, args.rounds, args.mbps, args.budget) == (100, 20, 2, 20.0,
                                                                            0.02)
    assert args.out.endswith("bench/results/snapshot_budget.json")
    assert args.runners == list(sb.RUNNERS)
    assert sb.parse_args(["--runners", sb.AUTO]).runners == [sb.OFF, sb.AUTO]  # and its baseline
    for bad in (["--budget", "1.5"], ["--steps", "20"], ["--exclude", "7"], ["--mbps", "0"]):
        with pytest.raises(SystemExit):
            sb.parse_args(bad)


def _interval(step: int, previous: int, interval: int, change: str, **extra) -> dict:
    return {"kind": "snapshot_interval", "generation": 0, "step": step, "previous": previous,
            "interval": interval, "change": change, "overhead": 0.5, "expected": 0.01,
            **extra}


def test_an_auto_runs_schedule_is_its_changes_and_its_own_reading() -> None:
    events = [{"kind": "started"}, _interval(6, 1, 4, "grew"), _interval(30, 4, 6, "grew"),
              {"kind": "finished", "step": 100},
              _interval(100, 6, 6, "ended", overhead=0.012, expected=0.011)]
    assert sb.schedule_of(events) == {"interval": 6, "changes": [(6, 1, 4), (30, 4, 6)],
                                      "overhead": 0.012, "expected": 0.011}
    assert sb.schedule_of([{"kind": "finished"}]) == {
        "interval": 1, "changes": [], "overhead": None, "expected": None}


def _result(runner: str, rnd: int, rate: float, **extra) -> dict:
    return {"runner": runner, "round": rnd, "tokens_per_s": rate, **extra}


def test_rows_pair_each_round_with_the_tier_off_and_read_the_schedules() -> None:
    schedule = {"interval": 6, "changes": [], "overhead": 0.01, "expected": 0.01}
    results = [_result(sb.OFF, 0, 1000.0), _result(sb.OFF, 1, 800.0),
               _result(sb.EVERY, 0, 900.0), _result(sb.EVERY, 1, 760.0),
               _result(sb.AUTO, 0, 990.0, schedule=schedule),
               _result(sb.AUTO, 1, 792.0, schedule={**schedule, "interval": 8}),
               _result(f"{sb.EVERY}, {sb.SLOW}", 0, 300.0),
               {"runner": f"{sb.EVERY}, {sb.SLOW}", "round": 1, "error": "exit code 1"},
               _result(f"{sb.AUTO}, {sb.SLOW}", 0, 985.0, schedule={**schedule, "overhead": None})]
    rows = {r["runner"]: r for r in sb.summary(results, rounds=2)}
    assert rows[sb.OFF]["ratio_to_off"] == 1.0 and rows[sb.OFF]["interval"] is None
    assert rows[sb.EVERY]["ratio_to_off"] == pytest.approx(0.925)  # 0.9 and 0.95
    assert rows[sb.AUTO]["ratio_to_off"] == pytest.approx(0.99)
    assert (rows[sb.AUTO]["interval"], rows[sb.AUTO]["overhead_read"]) == (7, 0.01)
    assert rows[f"{sb.EVERY}, {sb.SLOW}"]["tokens_per_s"] == 300.0  # the failed round left out
    assert rows[f"{sb.AUTO}, {sb.SLOW}"]["overhead_read"] is None
    assert sb.verdict(list(rows.values()), 0.02) == {sb.AUTO: True, f"{sb.AUTO}, {sb.SLOW}": True}
    lines = sb.table(list(rows.values()), 0.02)
    assert lines[0] == ["runner", "tokens/s", "x off", "interval", "overhead (run's own)"]
    assert lines[3] == [sb.AUTO, "891", "0.990", "7", "1.00% (budget 2%)"]
    assert lines[1][3:] == ["-", "-"]


def test_an_unmeasured_runner_has_no_verdict() -> None:
    rows = sb.summary([_result(sb.OFF, 0, 1000.0)], rounds=1)
    assert sb.verdict(rows, 0.02) == {sb.AUTO: None, f"{sb.AUTO}, {sb.SLOW}": None}
    assert sb.table(rows, 0.02)[2] == [sb.EVERY, "-", "-", "-", "-"]
    only = sb.summary([_result(sb.OFF, 0, 1000.0)], rounds=1, runners=[sb.OFF, sb.AUTO])
    assert [r["runner"] for r in only] == [sb.OFF, sb.AUTO]
    assert sb.verdict(only, 0.02)[f"{sb.AUTO}, {sb.SLOW}"] is None
