"""The chaos soak's own logic (bench/chaos_faults.py, bench/chaos_checks.py, bench/harness.py):
its plan from a seed, how it tells a fault was recorded, killing a driver's process tree, and
its bit-equality check on real saved weights. The soak itself is a bench, not a test."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import chaos_checks, harness
from bench import chaos_faults as cf
from stalwart.core import events as ev

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_the_plan_is_a_function_of_the_seed_and_a_chunk_is_a_slice_of_it() -> None:
    plans = cf.plan_soak(7, 20, ["ddp2", "fsdp2"])
    assert plans == cf.plan_soak(7, 20, ["ddp2", "fsdp2"])
    assert plans[:5] == cf.plan_soak(7, 5, ["ddp2", "fsdp2"])  # --first-run chunks agree
    assert plans != cf.plan_soak(8, 20, ["ddp2", "fsdp2"])
    assert {p.layout for p in plans} == {"ddp2", "fsdp2"}
    assert {f.kind for p in plans for f in p.faults} == set(cf.KINDS)
    for p in plans:
        assert cf.MIN_FAULTS <= len(p.faults) <= cf.MAX_FAULTS
        at = [f.at for f in p.faults]
        assert at == sorted(at) and 0.0 <= at[0] and at[-1] <= 0.9
        assert all(b - a >= cf.MIN_GAP for a, b in zip(at, at[1:], strict=False))
        assert all(0.0 <= f.pick < 1.0 for f in p.faults)


def _place(rank: int, pid: int) -> ev.WorkerPlace:
    return ev.WorkerPlace(rank=rank, pid=pid, node_ip="10.0.0.1", node_id="n")


def _failure(t: float, ranks: list[int]) -> ev.Failure:
    return ev.Failure(time=t, failure_kind="worker_died", rank=ranks[0], ranks=ranks, nodes=[],
                      message="", step=1, retry=True, detection_s=None, attempt=1)


def test_a_worker_fault_is_recorded_by_a_failure_naming_the_rank_its_process_had() -> None:
    world0 = ev.WorkersStarted(time=1.0, generation=0, world_size=2,
                               workers=(_place(0, 100), _place(1, 101)))
    # pid 101 was rank 1, then a recovery made it rank 0
    world1 = ev.WorkersStarted(time=5.0, generation=1, world_size=2,
                               workers=(_place(0, 101), _place(1, 102)))
    events = [world0, _failure(3.0, [0]), world1, _failure(6.0, [0])]
    assert chaos_checks.worker_fault_record({"time": 2.0, "pid": 100, "kind": "kill"},
                                            events) is events[1]
    assert chaos_checks.worker_fault_record({"time": 5.5, "pid": 101, "kind": "stop"},
                                            events) is events[3]
    # a failure of another rank records nothing; a preemption records only a SIGTERM
    assert chaos_checks.worker_fault_record({"time": 5.5, "pid": 102, "kind": "kill"},
                                            events) is None
    resized = ev.Resized(time=7.0, old_world_size=2, new_world_size=2, old_layout={},
                         new_layout={}, reason="preempted", step=9, generation=2)
    assert chaos_checks.worker_fault_record({"time": 6.5, "pid": 102, "kind": "term"},
                                            [*events, resized]) is resized
    assert chaos_checks.worker_fault_record({"time": 6.5, "pid": 102, "kind": "kill"},
                                            [*events, resized]) is None


def test_killing_a_driver_kills_its_whole_tree_even_a_process_in_a_session_of_its_own() -> None:
    # The "driver" starts a child in the same group and a grandchild that leaves the group
    # (setsid), as a daemon would: the group kill misses it, the tree kill does not.
    driver = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, time\n"
         "subprocess.Popen(['sleep', '60'])\n"
         "subprocess.Popen(['sleep', '61'], start_new_session=True)\n"
         "time.sleep(60)"], start_new_session=True)
    # Both children counted once they run `sleep`: a child forked but not yet in its own
    # session would still die with the group.
    deadline = time.monotonic() + 20
    while ([name for _, name in harness.descendants(driver.pid).values()].count("sleep") < 2
           and time.monotonic() < deadline):
        time.sleep(0.05)
    tree = harness.descendants(driver.pid)
    assert len(tree) == 3
    left = harness.kill_tree(driver.pid, wait_s=5.0)  # the group has died by then
    driver.wait(timeout=10)
    assert [name.split(":")[0] for name in left] == ["sleep"]  # the one outside the group
    assert harness.survivors(tree) == []


def test_the_bit_equality_check_reads_real_saved_weights_and_catches_one_bit(
        tmp_path: Path) -> None:
    import torch

    from stalwart.checkpointing.storage.export import write_weights

    torch.manual_seed(0)
    weights = {"embed.weight": torch.randn(8, 4), "blocks.0.ln.bias": torch.zeros(4),
               "blocks.0.steps": torch.tensor(3)}

    def saved(name: str, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
        copy = {k: v.clone() for k, v in weights.items()}
        change(copy)
        return write_weights(copy, 10, tmp_path / name)  # what `stalwart export` writes

    reference = saved("reference.pt", lambda w: None)
    assert chaos_checks.weights_equal(reference, saved("same.pt", lambda w: None)) == (
        True, "3 tensors equal")

    def low_bit(w: dict[str, torch.Tensor]) -> None:
        w["embed.weight"].view(torch.int32)[2, 1] ^= 1  # the last bit of one float

    same, detail = chaos_checks.weights_equal(reference, saved("low-bit.pt", low_bit))
    assert not same and detail.startswith("1/3 tensors differ, most in embed.weight")

    def sign_of_zero(w: dict[str, torch.Tensor]) -> None:
        w["blocks.0.ln.bias"][1] = -0.0  # torch.equal takes -0.0 for 0.0; its bits differ

    assert not chaos_checks.weights_equal(reference, saved("sign.pt", sign_of_zero))[0]
    other = tmp_path / "torch-save.pt"
    torch.save({k: v.clone() for k, v in weights.items()}, other)  # a plain torch.save too
    assert chaos_checks.weights_equal(other, reference)[0]
