"""The numerics benchmark's reading of its runs (bench/numerics.py): a fault run's figures
from made-up events and metrics rows, the overhead's ratios and verdict, and the side-by-side
rows. The runs themselves are the benchmark, not a test."""

from __future__ import annotations

import math

import pytest

from bench import numerics

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NAN = float("nan")
FAULT = 100.0  # the fault_injected event's time


def _rows(steps, *, t0: float = 90.0, step_s: float = 0.02, loss: float = 3.0) -> list[dict]:
    return [{"step": s, "time": t0 + i * step_s, "loss": loss, "window_s": step_s,
             "steps_in_window": 1} for i, s in enumerate(steps)]


def _decision(action: str, t: float, *, fault: str = "nan", step: int = 20,
              rollback_to: int | None = None, decided_s: float = 0.01) -> dict:
    return {"kind": "numerical_fault", "time": t, "step": step, "fault": fault,
            "action": action, "ranks": [], "rollback_to": rollback_to, "detail": "d",
            "reason": "r", "decided_s": decided_s}


def _events(*decisions: dict, finished: float | None = 3.1, step: int = 20) -> list[dict]:
    out = [{"kind": "started", "time": 80.0},
           {"kind": "fault_injected", "time": FAULT, "fault": f"nan:rank=1,step={step}",
            "rank": 1, "step": step}, *decisions]
    if finished is not None:
        out.append({"kind": "finished", "time": 120.0, "step": 60, "loss": finished})
    return out


def test_a_replayed_nan_is_timed_from_the_injection_to_the_decision_and_to_its_step() -> None:
    rows = _rows(range(1, 20)) + [{"step": 20, "time": FAULT + 0.05, "loss": 3.2,
                                   "window_s": 0.9, "steps_in_window": 1}]
    rows += _rows(range(21, 61), t0=FAULT + 0.07)
    s = numerics.fault_summary(_events(_decision("replay", FAULT + 0.02, decided_s=0.6)),
                               rows, 20)
    assert s["detection_s"] == pytest.approx(0.02)
    assert s["decided_s"] == 0.6
    assert s["next_good_step_s"] == pytest.approx(0.05)
    assert s["actions"] == "replay"
    assert s["normal_step_s"] == pytest.approx(0.02)  # the fault's long window is one of 60
    assert (s["finished"], s["failures"], s["final_loss"]) == (True, 0, 3.1)
    assert (s["finite_steps_after_fault"], s["steps_after_fault"]) == (40, 40)
    assert s["first_nan_step"] is None
    assert numerics.outcome(s) == "replayed; run finished, loss finite"


def test_a_rollback_counts_the_step_trained_again_once_and_its_replayed_fault_step() -> None:
    # Steps 1..39, the flip found in step 40, back to 38: 39 again, then 40..60.
    rows = _rows(range(1, 40)) + _rows(range(39, 61), t0=FAULT + 0.06)
    s = numerics.fault_summary(_events(_decision("rollback", FAULT + 0.03, fault="mismatch",
                                                 step=40, rollback_to=38), step=40), rows, 40)
    assert s["actions"] == "rollback to 38"
    assert s["next_good_step_s"] == pytest.approx(0.08)  # the second row at 40's number
    assert (s["finite_steps_after_fault"], s["steps_after_fault"]) == (20, 20)
    assert s["decisions"][0]["since_fault_s"] == pytest.approx(0.03)
    assert numerics.outcome(s) == "rolled back; run finished, loss finite"


def test_a_spike_replayed_then_skipped_lists_both_actions_in_order() -> None:
    events = _events(_decision("replay", FAULT + 0.02, fault="spike", step=30),
                     _decision("skip", FAULT + 0.04, fault="spike", step=30), step=30)
    s = numerics.fault_summary(events, _rows(range(1, 61)), 30)
    assert s["actions"] == "replay, skip"
    assert s["detection_s"] == pytest.approx(0.02)
    assert numerics.outcome(s) == "replayed, batch skipped; run finished, loss finite"


def test_a_run_with_no_decision_and_no_finish_says_so_and_times_nothing() -> None:
    rows = _rows(range(1, 20)) + _rows(range(20, 31), t0=FAULT, loss=NAN)
    s = numerics.fault_summary(_events(finished=None), rows, 20)
    assert s["detection_s"] is None and s["decided_s"] is None
    assert s["actions"] == "none"
    assert s["first_nan_step"] == 20
    assert math.isnan(s["final_loss"])
    assert (s["finite_steps_after_fault"], s["steps_after_fault"]) == (0, 10)
    assert numerics.outcome(s) == "not detected; run did not finish, loss not finite"


def test_without_a_fault_injected_event_nothing_is_timed() -> None:
    events = [e for e in _events(_decision("replay", FAULT + 0.02))
              if e["kind"] != "fault_injected"]
    s = numerics.fault_summary(events, _rows(range(1, 61)), 20)
    assert s["injected"] is None
    assert s["detection_s"] is None and s["next_good_step_s"] is None


def test_the_normal_step_is_the_median_of_each_rows_window_per_step() -> None:
    rows = [{"step": 5, "window_s": 1.0, "steps_in_window": 5},
            {"step": 10, "window_s": 0.5, "steps_in_window": 5},
            {"step": 11, "window_s": None, "steps_in_window": None},
            {"step": 15, "window_s": 3.0, "steps_in_window": 5}]
    assert numerics.normal_step_s(rows) == pytest.approx(0.2)
    assert numerics.normal_step_s([]) is None


def _run(runner: str, rnd: int, tps: float, faults: int = 0) -> dict:
    return {"runner": runner, "round": rnd, "tokens_per_s": tps, "numerical_faults": faults,
            "normal_step_s": 512 / tps, "loss_by_step": {"21": 3.0, "22": 2.9}}


def test_the_overhead_is_the_ratio_of_medians_with_each_rounds_pair() -> None:
    on, off = numerics.CHECKS_ON, numerics.CHECKS_OFF
    results = [_run(on, 0, 990.0), _run(off, 0, 1000.0), _run(off, 1, 1100.0),
               _run(on, 1, 1045.0), _run(on, 2, 1000.0), _run(off, 2, 1000.0)]
    s = numerics.overhead_summary(results, 3)
    assert s["median_tokens_per_s"] == {on: 1000.0, off: 1000.0}
    assert s["median_step_s"] == pytest.approx({on: 0.512, off: 0.512})
    assert s["ratio"] == pytest.approx(1.0)
    assert s["paired_ratios"] == pytest.approx([0.99, 0.95, 1.0])
    assert s["paired_ratio_median"] == pytest.approx(0.99)
    assert s["target_met"] is True
    assert s["false_positives"] == 0
    assert s["loss_max_abs_diff"] == 0.0


def test_a_slower_run_with_the_checks_misses_the_target_and_false_positives_count() -> None:
    on, off = numerics.CHECKS_ON, numerics.CHECKS_OFF
    results = [_run(on, 0, 900.0, faults=1), _run(off, 0, 1000.0),
               {"runner": on, "round": 1, "error": "exit code 1"}, _run(off, 1, 1000.0)]
    s = numerics.overhead_summary(results, 2)
    assert s["ratio"] == pytest.approx(0.9)
    assert s["paired_ratios"] == pytest.approx([0.9])  # round 2 measured one side only
    assert s["target_met"] is False
    assert s["false_positives"] == 1


def test_a_run_of_one_side_only_gives_no_ratio_and_no_verdict() -> None:
    s = numerics.overhead_summary([_run(numerics.CHECKS_OFF, 0, 1000.0)], 1)
    assert s["ratio"] is None and s["target_met"] is False and s["paired_ratios"] == []


def test_the_side_by_side_rows_count_the_steps_after_the_fault_and_show_a_nan_loss() -> None:
    peer = {"runner": "torchrun", "mode": "default", "outcome": "loss stays NaN",
            "final_loss": NAN, "finite_steps_after_fault": 0, "wall_s": 6.04,
            "loss_by_step": {str(s): (3.0 if s < 20 else NAN) for s in range(1, 61)}}
    row = numerics.peer_side_row(peer, 20)
    assert "loss_by_step" not in row and row["steps_after_fault"] == 40
    assert numerics.side_cells(row) == ["torchrun", "default", "loss stays NaN", "0/40", "nan",
                                        "6.0"]
    rows = _rows(range(1, 61))
    ours = numerics.fault_summary(_events(_decision("replay", FAULT + 0.02)), rows, 20)
    ours |= {"outcome": numerics.outcome(ours), "exit_code": 0, "wall_s": 13.8}
    side = numerics.stalwart_side_row(ours)
    assert numerics.side_cells(side) == ["stalwart", "default",
                                         "replayed; run finished, loss finite", "40/40",
                                         "3.1000", "13.8"]
    assert "replay" in side["detail"]


def test_a_failed_stalwart_run_shows_its_error_beside_the_peers() -> None:
    side = numerics.stalwart_side_row({"error": "exit code 1", "exit_code": 1})
    assert side["outcome"] == "failed" and side["detail"] == "exit code 1"
    assert numerics.side_cells(side)[3:] == ["-", "-", "-"]


def test_the_overhead_window_must_leave_steps_to_measure() -> None:
    with pytest.raises(SystemExit):
        numerics.parse_args(["--steps", "20", "--exclude", "20"])
    args = numerics.parse_args(["--skip-peers", "--rounds", "1", "--json", "out.json"])
    assert (args.skip_peers, args.rounds, args.out, args.steps) == (True, 1, "out.json", 300)
