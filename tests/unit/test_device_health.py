"""A GPU's health check before its worker joins a world (workers/device_health.py), without a
GPU: each probe fed fakes (NVML's readings, a matmul's result, a copy's timings), the whole
check over a faked CUDA, the CPU that is never checked, the classification of a failed check
as a node failure, and the controller going on without a worker whose check failed (the fake
worker group, tests/fake_group.py)."""

from __future__ import annotations

import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from stalwart.core.errors import DeviceUnhealthy
from stalwart.orchestrator import classify
from stalwart.orchestrator.failures import FailureKind
from stalwart.orchestrator.states import Failed, Finished
from stalwart.workers import device_health as dh
from tests.fake_group import Plan, Poll
from tests.unit.controller_world import T1, FakeWorld, status, statuses

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

CUDA = torch.device("cuda", 0)


class FakeNvml:
    """The parts of the pynvml module the check reads, answering as told."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NOT_FOUND = 6
    NVML_ERROR_GPU_IS_LOST = 15
    NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = 230

    class NVMLError(Exception):
        def __init__(self, value: int) -> None:
            super().__init__(value)
            self.value = value

        def __str__(self) -> str:
            return {3: "Not Supported", 6: "Not Found", 15: "GPU is lost"}[self.value]

    def __init__(self, *, ecc: int = 0, pages: int = 0, rows: tuple[int, ...] = (0, 0, 0, 0),
                 action: int = 0, uuid: str = "GPU-1234", fail: dict[str, int] | None = None,
                 init_error: int | None = None) -> None:
        self.ecc, self.pages, self.rows, self.action, self.uuid = ecc, pages, rows, action, uuid
        self.fail = fail or {}  # method name -> the NVML error code it raises
        self.init_error = init_error
        self.open = 0

    def _answer(self, name: str, value: Any) -> Any:
        if name in self.fail:
            raise self.NVMLError(self.fail[name])
        return value

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.NVMLError(self.init_error)
        self.open += 1

    def nvmlShutdown(self) -> None:
        self.open -= 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if uuid != self.uuid:
            raise self.NVMLError(self.NVML_ERROR_NOT_FOUND)
        return "handle"

    def nvmlDeviceGetTotalEccErrors(self, handle: str, error_type: int, counter: int) -> int:
        assert (handle, error_type, counter) == ("handle", 1, 0)  # uncorrected, volatile
        return self._answer("nvmlDeviceGetTotalEccErrors", self.ecc)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: str) -> int:
        return self._answer("nvmlDeviceGetRetiredPagesPendingStatus", self.pages)

    def nvmlDeviceGetRemappedRows(self, handle: str) -> tuple[int, ...]:
        return self._answer("nvmlDeviceGetRemappedRows", self.rows)

    def nvmlDeviceGetFieldValues(self, handle: str, ids: list[int]) -> list[Any]:
        assert ids == [230]
        return self._answer("nvmlDeviceGetFieldValues", [
            SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=self.action))])


# ---------------------------------------------------------------------------- visibility


def test_a_device_this_process_cannot_see_is_named() -> None:
    assert dh.visibility_problem(CUDA, available=True, count=1) is None
    assert dh.visibility_problem(CUDA, available=False, count=0) == (
        "cuda:0 is not visible: CUDA is not available to this process")
    assert "sees 1 device(s)" in dh.visibility_problem(torch.device("cuda", 2), available=True,
                                                       count=1)


# ---------------------------------------------------------------------------- NVML


def test_a_healthy_gpu_reads_clean_through_nvml() -> None:
    nvml = FakeNvml()
    reading = dh.read_nvml(nvml, "1234")  # torch's UUID has no GPU- prefix
    assert reading == dh.NvmlReading(uncorrected_ecc=0, retired_pages_pending=False,
                                     rows_pending=False, rows_failed=False, recovery_action=0)
    assert dh.nvml_problems(reading) == []
    assert nvml.open == 0  # NVML was shut down again


def test_nvml_reporting_ecc_errors_and_pending_repairs_is_unhealthy() -> None:
    reading = dh.read_nvml(FakeNvml(ecc=3, pages=1, rows=(0, 1, 1, 1), action=1), "1234")
    assert dh.nvml_problems(reading) == [
        "NVML counts 3 volatile uncorrected ECC error(s) since the driver loaded",
        "NVML: retired memory pages are waiting for a GPU reset",
        "NVML: remapped memory rows are waiting for a GPU reset",
        "NVML: a memory row could not be remapped (the GPU needs replacing)",
        "NVML: the driver asks for a GPU reset (after a critical XID error)"]


def test_a_reading_the_device_does_not_support_is_skipped_alone() -> None:
    # An H100 has no retired pages (it remaps rows); ECC may be off.
    nvml = FakeNvml(rows=(0, 0, 1, 0), fail={"nvmlDeviceGetRetiredPagesPendingStatus": 3,
                                             "nvmlDeviceGetTotalEccErrors": 3})
    reading = dh.read_nvml(nvml, "1234")
    assert reading.uncorrected_ecc is None and reading.retired_pages_pending is None
    assert reading.skipped == ("volatile uncorrected ECC errors (Not Supported)",
                               "retired pages pending (Not Supported)")
    assert dh.nvml_problems(reading) == [
        "NVML: remapped memory rows are waiting for a GPU reset"]


def test_nvml_saying_the_gpu_is_lost_is_the_verdict() -> None:
    reading = dh.read_nvml(FakeNvml(fail={"nvmlDeviceGetRemappedRows": 15}), "1234")
    assert dh.nvml_problems(reading) == ["NVML could not read remapped rows: GPU is lost"]


def test_missing_pynvml_skips_the_nvml_part_and_says_so() -> None:
    reading = dh.read_nvml(None, "1234")
    assert dh.nvml_problems(reading) == []
    assert reading.skipped == ("NVML checks (ECC, row remapping, recovery action): the pynvml "
                               "module (nvidia-ml-py) is not installed",)


def test_nvml_that_cannot_start_or_find_the_gpu_is_skipped() -> None:
    assert dh.read_nvml(FakeNvml(init_error=6), "1234").skipped == (
        "NVML checks: NVML did not start (Not Found)",)
    assert dh.read_nvml(FakeNvml(), "9999").skipped == (
        "NVML checks: NVML knows no GPU with UUID 9999",)
    older = FakeNvml()
    older.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION = None  # type: ignore[assignment]
    assert dh.read_nvml(older, "1234").skipped == (
        "the recovery action (this pynvml predates it)",)


# ---------------------------------------------------------------------------- matmul, copy


def test_the_matmul_reference_is_exact_and_a_wrong_value_is_caught() -> None:
    a, b = dh.matmul_inputs(64)
    want = a @ b
    assert dh.matmul_problem(dh.matmul_on(torch.device("cpu"), a, b), want) is None
    # TF32 rounds float32 inputs to 10 bits of mantissa: these stay exact.
    assert torch.equal(a, a.to(torch.bfloat16).to(torch.float32))
    wrong = want.clone()
    wrong[3, 5] += 2.0
    wrong[7, 1] = float("nan")
    assert dh.matmul_problem(wrong, want) == (
        "the matmul check got wrong values: 2 of 4096 entries differ from the CPU's "
        "(largest difference inf; the exact answer is known)")
    assert "shape (64, 63)" in dh.matmul_problem(want[:, 1:], want)


def test_a_copy_too_slow_for_the_floor_is_unhealthy() -> None:
    copies: list[int] = []
    ticks = iter([0.0, 0.5, 1.0, 1.25, 2.0, 3.0])  # three timed copies: 0.5 s, 0.25 s, 1 s
    speed = dh.copy_speed(lambda: copies.append(1), 100_000_000, repeats=3,
                          clock=lambda: next(ticks))
    assert len(copies) == 4  # one untimed first
    assert speed == pytest.approx(0.4)  # the fastest: 100 MB in 0.25 s
    assert dh.copy_problem(speed, 1.0) == (
        "host-to-device copies from pinned memory run at 0.40 GB/s, under the 1 GB/s floor "
        "(a degraded link or a device in trouble)")
    assert dh.copy_problem(12.0, 1.0) is None


# ---------------------------------------------------------------------------- the check


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A CUDA device that is visible and answers as the test sets: the matmul computed on the
    CPU (or `wrong`), the copy at `gb_s`, NVML missing unless `nvml` is set."""
    gpu: dict[str, Any] = {"wrong": False, "gb_s": 20.0, "nvml": None, "ran": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(uuid="1234", name="Fake GPU"))
    monkeypatch.setattr(dh, "load_nvml", lambda: gpu["nvml"])

    def matmul_on(device: torch.device, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        gpu["ran"].append("matmul")
        if gpu["wrong"] == "raise":
            raise RuntimeError("CUDA error: uncorrectable ECC error encountered\nmore")
        return a @ b + (1.0 if gpu["wrong"] else 0.0)

    def copy_speed(copy: Any, nbytes: int) -> float:
        gpu["ran"].append("copy")
        return gpu["gb_s"]

    monkeypatch.setattr(dh, "matmul_on", matmul_on)
    monkeypatch.setattr(dh, "h2d_copier", lambda device: lambda: None)
    monkeypatch.setattr(dh, "copy_speed", copy_speed)
    return gpu


def test_a_healthy_gpu_passes_and_says_what_it_skipped(fake_gpu: dict[str, Any]) -> None:
    health = dh.check_device(CUDA, node_ip="10.0.0.7")
    assert health is not None and health.h2d_gb_s == 20.0
    assert fake_gpu["ran"] == ["matmul", "copy"]
    assert health.summary() == (
        "cuda:0 (Fake GPU) is healthy: matmul exact, host-to-device 20.0 GB/s (floor 1); "
        "skipped: NVML checks (ECC, row remapping, recovery action): the pynvml module "
        "(nvidia-ml-py) is not installed")


def test_every_failed_probe_is_named_with_the_node(fake_gpu: dict[str, Any]) -> None:
    fake_gpu.update(wrong=True, gb_s=0.3)
    with pytest.raises(DeviceUnhealthy) as raised:
        dh.check_device(CUDA, node_ip="10.0.0.7")
    exc = raised.value
    assert (exc.device, exc.node_ip) == ("cuda:0", "10.0.0.7") and exc.pid is not None
    assert str(exc).startswith("device cuda:0 unhealthy on node 10.0.0.7: the matmul check "
                               "got wrong values: 262144 of 262144 entries differ")
    assert exc.reasons[1].startswith("host-to-device copies from pinned memory run at 0.30")


def test_a_probe_that_raises_is_a_failed_check(fake_gpu: dict[str, Any]) -> None:
    fake_gpu["wrong"] = "raise"
    with pytest.raises(DeviceUnhealthy) as raised:
        dh.check_device(CUDA)
    assert raised.value.reasons == ("the matmul check raised RuntimeError: CUDA error: "
                                    "uncorrectable ECC error encountered",)


def test_a_gpu_nvml_calls_broken_is_not_probed(fake_gpu: dict[str, Any]) -> None:
    fake_gpu["nvml"] = FakeNvml(ecc=2)
    with pytest.raises(DeviceUnhealthy) as raised:
        dh.check_device(CUDA)
    assert raised.value.reasons == (
        "NVML counts 2 volatile uncorrected ECC error(s) since the driver loaded",)
    assert fake_gpu["ran"] == []


def test_an_invisible_device_fails_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceUnhealthy, match="CUDA is not available to this process"):
        dh.check_device(CUDA, node_ip="10.0.0.7")


def test_a_cpu_is_not_checked_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    def touched(*args: Any) -> None:
        raise AssertionError("a CPU check touched CUDA or NVML")

    for name in ("is_available", "device_count", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, touched)
    monkeypatch.setattr(dh, "load_nvml", touched)
    assert dh.check_device(torch.device("cpu")) is None


# ---------------------------------------------------------------------------- classification


def test_the_error_crosses_ray_whole() -> None:
    exc = DeviceUnhealthy("cuda:0", ["a", "b"], "10.0.0.7", 41)
    back = pickle.loads(pickle.dumps(exc))
    assert (back.device, back.reasons, back.node_ip, back.pid, str(back)) == (
        "cuda:0", ("a", "b"), "10.0.0.7", 41, str(exc))


def test_an_unhealthy_device_at_warm_up_is_a_node_failure() -> None:
    cause = DeviceUnhealthy("cuda:0", ["NVML counts 2 volatile uncorrected ECC error(s)"],
                            "10.0.0.7", 41)
    failure = classify.warm_up_failed(cause, now=5.0)
    assert (failure.kind, failure.rank, failure.failed_ranks, failure.pids, failure.nodes) == (
        FailureKind.NODE_DIED, None, (), (41,), ("10.0.0.7",))
    assert failure.message == (
        "device unhealthy on node 10.0.0.7 (cuda:0, worker pid 41): NVML counts 2 volatile "
        "uncorrected ECC error(s); the worker was dropped before it joined a world")
    # Anything else a warm-up raises is the task failing to load: not a node's fault.
    other = classify.warm_up_failed(ImportError("no module named task"), now=5.0)
    assert (other.kind, other.message) == (
        FailureKind.START_ERROR, "a worker could not load the task: no module named task")


# ---------------------------------------------------------------------------- the controller


def test_a_spare_whose_device_fails_is_dropped_when_a_recovery_looks_for_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The spare is asked for once the first world trained; a recovery collects it, finds its
    # device failed, counts that as a node failure and forms with another actor.
    w = FakeWorld(tmp_path, monkeypatch, [
        Plan(polls=[statuses([1, 2]), Poll([status(0)], dead=[1])]),
        Plan(polls=[statuses(range(3, 7), done=True, t0=T1)]),
    ], ["failure.max_failures=2", "scaling.spare_workers=1"])
    w.group.bad_devices[1002] = "NVML counts 2 volatile uncorrected ECC error(s)"
    assert w.run() == Finished(step=6)
    assert w.members(0) == [1000, 1001] and w.members(1) == [1000, 1003]
    assert 1002 in w.killed()
    assert w.kinds()[:3] == ["started", "failure", "failure"]
    failure = w.all("failure")[1]
    assert (failure["failure_kind"], failure["retry"], failure["ranks"], failure["nodes"],
            failure["pids"], failure["attempt"]) == ("node_died", True, [], ["10.0.0.1"],
                                                     [1002], 2)
    assert failure["message"].startswith(
        "device unhealthy on node 10.0.0.1 (cuda:0, worker pid 1002): NVML counts 2")
    assert failure["message"] in w.display.logs


def test_a_worker_whose_device_fails_is_replaced_before_the_world_forms(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    w = FakeWorld(tmp_path, monkeypatch, [Plan(polls=[statuses(range(1, 7), done=True)])],
                  ["failure.max_failures=1"])
    w.group.bad_devices[1000] = "the matmul check got wrong values"
    assert w.run() == Finished(step=6)
    assert w.members(0) == [1001, 1002] and w.killed() == [1000]
    assert w.event("failure")["failure_kind"] == "node_died"


def test_a_failed_device_check_counts_against_the_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A GPU that fails again and again ends the run, rather than a loop of new workers.
    w = FakeWorld(tmp_path, monkeypatch, [Plan()])
    w.group.bad_devices[1001] = "NVML: a memory row could not be remapped"
    state = w.run()
    assert isinstance(state, Failed)
    assert state.reason.startswith("failure budget exhausted (failure.max_failures=0; "
                                   "failures: node_died): device unhealthy on node 10.0.0.1")
    assert w.event("failure")["retry"] is False


def test_without_nvidia_ml_py_rays_own_nvml_bindings_are_used() -> None:
    """Every Ray node has NVML's bindings through Ray, installed or not as nvidia-ml-py."""
    import importlib.util

    nvml = dh.load_nvml()
    if importlib.util.find_spec("pynvml") is None:
        assert nvml is not None and nvml.__name__ == "ray._private.thirdparty.pynvml"
    assert nvml is None or callable(getattr(nvml, "nvmlInit", None))
