"""The numerics benchmark's peer rows (bench/peers/numerics_peers.py) read from a run's own
records: what each outcome is, the first NaN step, the finite steps after the fault, and the
NaN itself, injected once on rank 1. The runs themselves are the benchmark, not a test."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bench.peers import numerics_peers as peers

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NAN = float("nan")


def _steps(losses: dict[int, float], pid: int = 10, t0: float = 100.0) -> list[dict]:
    return [{"step": s, "time": t0 + s * 0.5, "loss": loss, "nan_weights": 0.0 if
             math.isfinite(loss) else 1.0, "pid": pid} for s, loss in losses.items()]


def _attempt(rank: int, pid: int, t: float, restored_from: int | None = None) -> list[dict]:
    return [{"event": "start", "time": t, "rank": rank, "pid": pid},
            {"event": "ready", "time": t + 1, "rank": rank, "pid": pid,
             "restored_from": restored_from}]


def test_a_run_that_finishes_with_nan_losses_after_the_fault_is_loss_stays_nan() -> None:
    losses = {s: (3.0 if s < 20 else NAN) for s in range(1, 41)}
    row = peers.measure(_steps(losses), _attempt(0, 10, 0.0) + _attempt(1, 11, 0.0),
                        exit_code=0, wall_s=6.0, fault_step=20)
    assert row["outcome"] == "loss stays NaN"
    assert row["first_nan_step"] == 20
    assert row["finite_steps_after_fault"] == 0
    assert math.isnan(row["final_loss"])
    assert row["restarts"] == 0
    assert row["nan_weights_at_end"] == 1.0
    assert row["step_s_median"] == pytest.approx(0.5)
    assert "20/20 steps after step 20" in row["detail"]


def test_finite_losses_after_the_fault_are_counted_and_a_clean_finish_is_loss_recovers() -> None:
    losses = {s: (NAN if s == 20 else 3.0) for s in range(1, 41)}
    row = peers.measure(_steps(losses), _attempt(0, 10, 0.0), exit_code=0, wall_s=6.0,
                        fault_step=20)
    assert row["outcome"] == "loss recovers"
    assert row["first_nan_step"] == 20
    assert row["finite_steps_after_fault"] == 20
    assert row["final_loss"] == 3.0


def test_a_nonzero_exit_is_run_fails_with_its_error_in_the_detail() -> None:
    row = peers.measure(_steps({s: 3.0 for s in range(1, 20)}), _attempt(0, 10, 0.0),
                        exit_code=1, wall_s=4.0, fault_step=20, error="ValueError: nan")
    assert row["outcome"] == "run fails"
    assert row["first_nan_step"] is None
    assert row["finite_steps_after_fault"] == 0
    assert row["detail"] == "exit 1 after step 19: ValueError: nan"


def test_a_second_attempt_is_a_restart_from_the_step_it_restored() -> None:
    first = _steps({s: (3.0 if s < 20 else NAN) for s in range(1, 23)}, pid=10)
    second = _steps({s: 3.0 for s in range(21, 41)}, pid=20, t0=120.0)
    row = peers.measure(first + second, _attempt(0, 10, 0.0) + _attempt(0, 20, 115.0, 20),
                        exit_code=0, wall_s=30.0, fault_step=20)
    assert row["outcome"] == "restarts from storage"
    assert row["restarts"] == 1
    assert row["restored_from_steps"] == [20]
    assert row["finite_steps_after_fault"] == 20  # the second attempt's; the first's 2 are NaN
    assert row["final_loss"] == 3.0


def test_the_nan_is_armed_on_rank_1_at_the_fault_step_once_over_all_attempts(
        tmp_path: Path) -> None:
    assert not peers.arm_once(tmp_path, 0, 20, 20)
    assert not peers.arm_once(tmp_path, 1, 19, 20)
    assert peers.arm_once(tmp_path, 1, 20, 20)
    assert not peers.arm_once(tmp_path, 1, 20, 20)  # a restarted attempt replays step 20


class _Task:
    val_fraction = 0.1

    def loss(self, model: torch.nn.Module, inputs: torch.Tensor,
             targets: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(model(inputs), targets)


def test_an_armed_loss_is_nan_and_its_gradients_too_while_the_task_stays_the_same() -> None:
    model, x = torch.nn.Linear(2, 1), torch.ones(3, 2)
    poison = peers.NaNLoss(_Task())
    assert poison.val_fraction == 0.1
    assert math.isfinite(poison.loss(model, x, torch.zeros(3, 1)).item())
    poison.armed = True
    loss = poison.loss(model, x, torch.zeros(3, 1))
    loss.backward()
    assert math.isnan(loss.item())
    assert all(p.grad.isnan().all() for p in model.parameters())
    assert peers.nan_weight_fraction(model) == 0.0


def test_a_fault_step_outside_the_run_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"fault_step=41 must be in \[1, steps=40\]"):
        peers.run_peer_rows(tmp_path, steps=40, fault_step=41)
