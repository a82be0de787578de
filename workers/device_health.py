"""A GPU's health, checked once by each worker before it can join a world.

check_device runs four probes on a CUDA device and raises DeviceUnhealthy naming every one
that failed; the worker's warm-up calls it, so a bad GPU never joins a world (the group drops
the worker and the controller records a node failure). The probes:

- the device is visible to this process;
- NVML's word on it, where the `pynvml` module (nvidia-ml-py) is installed: volatile
  uncorrected ECC errors, retired pages or memory rows waiting for a reset, a failed row
  remap, and the recovery action the driver asks for after a critical XID (r570 drivers and
  newer; NVML keeps no history of XIDs to read back). Without the module this part is skipped
  and said so; a reading the device or driver does not support is skipped alone;
- a matmul whose exact answer is known, compared with the CPU's;
- a host-to-device copy from pinned memory, at no less than a floor in GB/s.

Each probe is a small function of its inputs (an NVML module, two tensors, a copy and a
clock), so the unit tests feed it fakes. A CPU device is not checked at all: it returns None
at once, and the worker does not even call it then.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.core.errors import DeviceUnhealthy

MATMUL_SIZE = 512
"""A 512 x 512 matmul: microseconds on a GPU, about 10 ms for the CPU's reference."""
MATMUL_SEED = 20240601
COPY_BYTES = 64 << 20
"""64 MiB per copy: milliseconds on any healthy link, big enough that launch overhead is noise."""
COPY_REPEATS = 3
MIN_H2D_GB_S = 1.0
"""Pinned host-to-device copies run at 10-25 GB/s on PCIe 3 and 4 x16 and faster on newer
links; an idle H100 does about 50. 1 GB/s is far below any healthy link even on a busy node,
so it trips only on a link trained down to a few lanes or a slow generation, or a device in
trouble, never on noise. Not a config key: nothing healthy comes near it."""

# What NVML's recovery action asks for (nvmlGpuRecoveryAction_t); 0 is none.
RECOVERY_ACTIONS = {1: "a GPU reset", 2: "a node reboot", 3: "draining peer-to-peer traffic",
                    4: "draining its work and a GPU reset", 5: "a GPU reset through the bus"}


@dataclass(frozen=True, kw_only=True)
class NvmlReading:
    """What NVML says of one GPU; None where it could not be read (see `skipped`)."""

    uncorrected_ecc: int | None = None
    """Volatile uncorrected ECC errors: since the driver last loaded."""
    retired_pages_pending: bool | None = None
    """Pages retired but waiting for a reset (GPUs before Ampere)."""
    rows_pending: bool | None = None
    """Memory rows remapped but waiting for a reset (Ampere and newer)."""
    rows_failed: bool | None = None
    """A memory row could not be remapped: the GPU needs replacing."""
    recovery_action: int | None = None
    """The driver's recovery action after a critical XID (0: none)."""
    errors: tuple[str, ...] = ()
    """NVML answers that are themselves the verdict: the GPU is lost, or needs a reset."""
    skipped: tuple[str, ...] = ()
    """What could not be read, and why."""


@dataclass(frozen=True, kw_only=True)
class DeviceHealth:
    """A device that passed: what was measured, and what was skipped."""

    device: str
    name: str
    h2d_gb_s: float
    floor_gb_s: float
    nvml: NvmlReading

    def summary(self) -> str:
        """One line for the worker's log."""
        skipped = "".join(f"; skipped: {s}" for s in self.nvml.skipped)
        return (f"{self.device} ({self.name}) is healthy: matmul exact, host-to-device "
                f"{self.h2d_gb_s:.1f} GB/s (floor {self.floor_gb_s:g}){skipped}")


# ---------------------------------------------------------------------------- the probes


def visibility_problem(device: torch.device, *, available: bool, count: int) -> str | None:
    """Why this process cannot use `device`, or None."""
    if not available:
        return f"{device} is not visible: CUDA is not available to this process"
    index = 0 if device.index is None else device.index
    if index >= count:
        return (f"{device} is not visible: this process sees {count} device(s) "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return None


def load_nvml() -> Any | None:
    """The pynvml module (from nvidia-ml-py, or the older pynvml package), else the copy Ray
    ships; None if neither is there."""
    try:
        with warnings.catch_warnings():  # the old pynvml package warns that it is deprecated
            warnings.simplefilter("ignore")
            import pynvml  # type: ignore[import-not-found]
    except Exception:
        from stalwart.core.ray_private import rays_pynvml

        return rays_pynvml()
    return pynvml


class _Reader:
    """Calls into NVML, each guarded: an answer, or a note of what was skipped and why."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.errors: list[str] = []
        self.skipped: list[str] = []
        # The answers that say the GPU itself is broken, whatever was asked.
        self._fatal = {getattr(nvml, name, None) for name in
                       ("NVML_ERROR_GPU_IS_LOST", "NVML_ERROR_RESET_REQUIRED")} - {None}

    def get(self, what: str, name: str, *args: Any) -> Any:
        fn = getattr(self.nvml, name, None)
        if fn is None:
            self.skipped.append(f"{what} (this pynvml has no {name})")
            return None
        try:
            return fn(*args)
        except Exception as exc:
            if getattr(exc, "value", None) in self._fatal:
                self.errors.append(f"NVML could not read {what}: {exc}")
            else:
                self.skipped.append(f"{what} ({exc})")
            return None


def read_nvml(nvml: Any | None, uuid: str) -> NvmlReading:
    """NVML's readings for the GPU with this UUID (torch's device property): `nvml` is the
    pynvml module (load_nvml), or None when it is not installed."""
    if nvml is None:
        return NvmlReading(skipped=("NVML checks (ECC, row remapping, recovery action): the "
                                    "pynvml module (nvidia-ml-py) is not installed",))
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return NvmlReading(skipped=(f"NVML checks: NVML did not start ({exc})",))
    try:
        return _read(_Reader(nvml), uuid)
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _handle(reader: _Reader, uuid: str) -> Any:
    """NVML's handle on the GPU: found by UUID, since CUDA's index 0 in a Ray actor is
    whichever GPU CUDA_VISIBLE_DEVICES names, and NVML numbers every GPU of the node."""
    names = [uuid] if uuid.startswith(("GPU-", "MIG-")) else [f"GPU-{uuid}", f"MIG-{uuid}"]
    for name in names:
        with contextlib.suppress(Exception):
            return reader.nvml.nvmlDeviceGetHandleByUUID(name)
    return None


def _read(reader: _Reader, uuid: str) -> NvmlReading:
    nvml = reader.nvml
    handle = _handle(reader, uuid)
    if handle is None:
        return NvmlReading(skipped=(f"NVML checks: NVML knows no GPU with UUID {uuid}",))
    ecc = reader.get("volatile uncorrected ECC errors", "nvmlDeviceGetTotalEccErrors", handle,
                     getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
                     getattr(nvml, "NVML_VOLATILE_ECC", 0))
    pages = reader.get("retired pages pending", "nvmlDeviceGetRetiredPagesPendingStatus", handle)
    rows = reader.get("remapped rows", "nvmlDeviceGetRemappedRows", handle)
    return NvmlReading(
        uncorrected_ecc=None if ecc is None else int(ecc),
        retired_pages_pending=None if pages is None else bool(pages),
        rows_pending=None if rows is None else bool(rows[2]),
        rows_failed=None if rows is None else bool(rows[3]),
        recovery_action=_recovery_action(reader, handle),
        errors=tuple(reader.errors), skipped=tuple(reader.skipped))


def _recovery_action(reader: _Reader, handle: Any) -> int | None:
    """The driver's recovery action (a field value since r570 drivers), None if unread."""
    field_id = getattr(reader.nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
    if field_id is None:
        reader.skipped.append("the recovery action (this pynvml predates it)")
        return None
    values = reader.get("the recovery action", "nvmlDeviceGetFieldValues", handle, [field_id])
    if values is None:
        return None
    value = values[0]
    if value.nvmlReturn != 0:  # NVML_SUCCESS; a driver before r570 does not report it
        reader.skipped.append(f"the recovery action (NVML answered code {value.nvmlReturn})")
        return None
    return int(value.value.uiVal)


def nvml_problems(reading: NvmlReading) -> list[str]:
    """What NVML's readings say is wrong with the GPU (nothing read is nothing wrong)."""
    out = list(reading.errors)
    if reading.uncorrected_ecc:
        out.append(f"NVML counts {reading.uncorrected_ecc} volatile uncorrected ECC error(s) "
                   f"since the driver loaded")
    if reading.retired_pages_pending:
        out.append("NVML: retired memory pages are waiting for a GPU reset")
    if reading.rows_pending:
        out.append("NVML: remapped memory rows are waiting for a GPU reset")
    if reading.rows_failed:
        out.append("NVML: a memory row could not be remapped (the GPU needs replacing)")
    if reading.recovery_action:
        action = RECOVERY_ACTIONS.get(reading.recovery_action,
                                      f"action {reading.recovery_action}")
        out.append(f"NVML: the driver asks for {action} (after a critical XID error)")
    return out


def matmul_inputs(size: int = MATMUL_SIZE, seed: int = MATMUL_SEED
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two float32 matrices of small integers, on the CPU.

    Integers in [-4, 4] make the right answer exact whatever the device does: they are
    exact in TF32 and bf16 (a run may allow either for float32 matmuls), every product and
    partial sum is an integer far below 2**24, exact in float32, in any summation order.
    So any difference at all is a fault, not rounding.
    """
    gen = torch.Generator().manual_seed(seed)
    a, b = (torch.randint(-4, 5, (size, size), generator=gen).to(torch.float32)
            for _ in range(2))
    return a, b


def matmul_on(device: torch.device, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b computed on `device`, brought back to the CPU."""
    return (a.to(device) @ b.to(device)).cpu()


def matmul_problem(got: torch.Tensor, want: torch.Tensor) -> str | None:
    """How the device's matmul differs from the CPU's reference, or None if it is exact."""
    if got.shape != want.shape:
        return f"the matmul check returned shape {tuple(got.shape)}, not {tuple(want.shape)}"
    wrong = got != want  # NaN differs from everything, itself included
    count = int(wrong.sum())
    if count == 0:
        return None
    worst = (got[wrong] - want[wrong]).abs().nan_to_num(nan=math.inf).max().item()
    return (f"the matmul check got wrong values: {count} of {want.numel()} entries differ "
            f"from the CPU's (largest difference {worst:g}; the exact answer is known)")


def h2d_copier(device: torch.device, nbytes: int = COPY_BYTES) -> Callable[[], None]:
    """One host-to-device copy of `nbytes` from pinned memory, waited for (CUDA only)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)

    return copy


def copy_speed(copy: Callable[[], None], nbytes: int, *, repeats: int = COPY_REPEATS,
               clock: Callable[[], float] = time.perf_counter) -> float:
    """GB/s of the fastest of `repeats` copies, after one untimed (the first pays for setup)."""
    copy()
    best = math.inf
    for _ in range(repeats):
        start = clock()
        copy()
        best = min(best, clock() - start)
    return nbytes / max(best, 1e-9) / 1e9


def copy_problem(gb_s: float, floor_gb_s: float = MIN_H2D_GB_S) -> str | None:
    """Why the copy speed is too low, or None."""
    if gb_s >= floor_gb_s:
        return None
    return (f"host-to-device copies from pinned memory run at {gb_s:.2f} GB/s, under the "
            f"{floor_gb_s:g} GB/s floor (a degraded link or a device in trouble)")


def _raised(what: str, exc: Exception) -> str:
    """A probe that raised (a CUDA error, an ECC fault), as a problem of the device."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{what} raised {type(exc).__name__}: {first}"


# ---------------------------------------------------------------------------- the check


def check_device(device: torch.device, *, node_ip: str = "", nvml: Any | None = None,
                 min_h2d_gb_s: float = MIN_H2D_GB_S) -> DeviceHealth | None:
    """Check a CUDA device before its worker joins a world: None for a CPU (nothing is
    checked), a DeviceHealth if it passed, else DeviceUnhealthy naming every failed check
    and `node_ip`. `nvml`: the pynvml module (default: imported here, if installed)."""
    if device.type != "cuda":
        return None
    visible = visibility_problem(device, available=torch.cuda.is_available(),
                                 count=torch.cuda.device_count())
    if visible is not None:
        raise DeviceUnhealthy(str(device), [visible], node_ip, os.getpid())
    props = torch.cuda.get_device_properties(device)
    reading = read_nvml(nvml if nvml is not None else load_nvml(), str(props.uuid))
    problems = nvml_problems(reading)
    speed = 0.0
    if not problems:  # a GPU that NVML calls broken may hang the probes: they add nothing
        a, b = matmul_inputs()
        try:
            wrong = matmul_problem(matmul_on(device, a, b), a @ b)
        except Exception as exc:
            wrong = _raised("the matmul check", exc)
        try:
            speed = copy_speed(h2d_copier(device), COPY_BYTES)
            slow = copy_problem(speed, min_h2d_gb_s)
        except Exception as exc:
            slow = _raised("the host-to-device copy", exc)
        problems += [p for p in (wrong, slow) if p is not None]
    if problems:
        raise DeviceUnhealthy(str(device), problems, node_ip, os.getpid())
    return DeviceHealth(device=str(device), name=props.name, h2d_gb_s=speed,
                        floor_gb_s=min_h2d_gb_s, nvml=reading)
