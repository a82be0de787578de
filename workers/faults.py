"""Fault injection on the worker: one injector, holding the faults armed on this rank.

The faults are real, done to this process or this node: `kill` and `hang` signal this
process (SIGKILL, SIGSTOP), `term` sends it the SIGTERM a preempted machine gets, `raise`
throws from the training loop like a bug in user code, `kill-node` SIGKILLs this node's
raylet (Ray's per-node daemon) and every process it started, exactly as when a machine is
lost, `freeze-node` SIGSTOPs them instead (a frozen machine: its sockets stay open, nothing
answers; it stays so until someone sends SIGCONT or Ray's health check gives up on it),
`drain` asks Ray to drain this node for preemption, `slow` makes this rank a
straggler, and `slow-link` caps the bytes per second its snapshot exchanges send (the sending
thread sleeps in proportion to each exchange's bytes, as a slow NIC would hold it). The
numerical ones act on the step itself, through the engine's hooks: `nan`
makes the rank's loss NaN once, `spike` scales the loss of that step's batch up each time
it is trained, and `bitflip` flips one bit of one parameter in place. The controller decides which rank carries out each fault (see
orchestrator/faults.py); this module only does it.

The engine, the stager and the replicator know nothing of faults: they call small hooks at
the moments they mark (the start of a step, `after_local_work`, `mid_copy`,
`before_payload`, `sending`), and FaultInjector implements them.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stalwart.core.config import FaultKind, FaultSpec
from stalwart.core.ray_private import drain_node

if TYPE_CHECKING:  # the node agent imports this module, and must not load torch
    import torch


class InjectedFault(RuntimeError):
    """Raised by a `raise` fault: stands for an exception in the task's code."""


@dataclass(frozen=True, kw_only=True)
class FaultFired:
    """Told to the controller just before the fault is done, so it knows when it happened."""

    fault: FaultSpec
    """The fault as configured; str() gives it as the user wrote it, e.g. kill:rank=1,step=20."""
    rank: int
    time: float

    @property
    def step(self) -> int:
        return self.fault.step


# The moment each kind strikes at; every other kind strikes at the start of its step.
STRIKES_AT = {
    FaultKind.KILL_STAGING: "mid_copy",            # half of the snapshot's tensors are staged
    FaultKind.KILL_REPLICATING: "before_payload",  # the snapshot's headers are on its holders
}
# How long a fault waits for the controller to hear of it before it is carried out. Long:
# a fault done unheard is armed again in the next world and strikes twice, and a busy
# machine can hold the controller's poll back for seconds.
FAULT_NOTICE_TIMEOUT_S = 30.0
# A `slow` fault: the rank sleeps this x its local work each step (3x as long in all).
SLOWDOWN = 2.0
# A `spike` fault: the loss (and so the gradients) of the bad batch on that rank, times this.
SPIKE_FACTOR = 100.0
# The faults the engine's step carries out (loss_factor, tamper), not the process.
NUMERICAL = (FaultKind.NAN, FaultKind.SPIKE, FaultKind.BITFLIP)


class FaultInjector:
    """The faults armed on this worker for its current world, and the hooks they strike at.

    Each fault is told to the controller (`fired`, drained by the worker's poll) and carried
    out once the controller has acknowledged it (`ack`): not when the poll returns, as its
    reply could still be on its way when the process dies, and the fault would then be
    armed again in the next world. A `slow` or `slow-link` fault lasts for the rest of the
    process's life.
    """

    def __init__(self, notice_timeout_s: float = FAULT_NOTICE_TIMEOUT_S) -> None:
        self.notice_timeout_s = notice_timeout_s
        self.rank = -1
        self._armed: list[FaultSpec] = []
        self._fired: deque[FaultFired] = deque()
        self._heard = threading.Event()
        self.slowdown = 0.0
        self.link_bytes_per_s = 0.0  # a slow-link fault's cap (0: none)
        self._due: list[FaultSpec] = []  # numerical faults fired, for the step's hooks

    def arm(self, rank: int, faults: Iterable[FaultSpec]) -> None:
        """The faults this rank carries out in the world it joins (replacing any others)."""
        self.rank, self._armed = rank, list(faults)
        self._fired.clear()
        self._due.clear()

    def disarm(self) -> None:
        """The world is left: its faults go with it (the controller arms them again)."""
        self.rank, self._armed = -1, []
        self._fired.clear()
        self._due.clear()

    def drain(self) -> list[FaultFired]:
        """The faults fired since the last call, for the worker's poll."""
        return [self._fired.popleft() for _ in range(len(self._fired))]

    def ack(self) -> None:
        """The controller has heard of the faults fired: carry them out now."""
        self._heard.set()

    # ------------------------------------------------------------------ the hooks

    def at_step(self, step: int) -> None:
        """At the start of step `step`, before any of its work."""
        self._strike("step", step)

    def mid_copy(self, step: int) -> None:
        """Half of step `step`'s snapshot is staged."""
        self._strike("mid_copy", step)

    def before_payload(self, step: int) -> None:
        """Step `step`'s snapshot headers are exchanged with its holders, not its payload."""
        self._strike("before_payload", step)

    def sending(self, step: int, nbytes: int) -> None:
        """Step `step`'s snapshot exchange is about to send `nbytes` (on its own thread):
        under a slow-link fault, first take the time that many bytes need at its cap."""
        if self.link_bytes_per_s > 0:
            time.sleep(nbytes / self.link_bytes_per_s)

    def after_local_work(self, seconds: float) -> None:
        """This rank's own work in a step took `seconds`: a straggler takes longer."""
        if self.slowdown > 0:
            time.sleep(self.slowdown * seconds)

    def loss_factor(self, step: int) -> float:
        """What this rank's loss of `step` is multiplied by: NaN once after a `nan` fault,
        SPIKE_FACTOR on every try of a `spike` fault's batch in this world, else 1."""
        factor = 1.0
        for fault in [f for f in self._due if f.step == step]:
            if fault.kind is FaultKind.NAN:
                self._due.remove(fault)
                factor *= math.nan
            elif fault.kind is FaultKind.SPIKE:
                factor *= SPIKE_FACTOR
        return factor

    def tamper(self, step: int, model: torch.nn.Module) -> None:
        """At the start of `step`: a `bitflip` fault due now flips its bit."""
        for fault in [f for f in self._due if f.step == step and f.kind is FaultKind.BITFLIP]:
            self._due.remove(fault)
            flip_bit(model)

    def _strike(self, moment: str, step: int) -> None:
        due = [f for f in self._armed
               if f.step == step and STRIKES_AT.get(f.kind, "step") == moment]
        for fault in due:
            self._armed.remove(fault)
            self._fire(fault)

    def _fire(self, fault: FaultSpec) -> None:
        # The controller hears of the fault first (its exact time), then it happens.
        self._heard.clear()
        self._fired.append(FaultFired(fault=fault, rank=self.rank, time=time.time()))
        self._heard.wait(self.notice_timeout_s)
        if fault.kind is FaultKind.SLOW:  # after_local_work carries it out, from now on
            self.slowdown = SLOWDOWN
            return
        if fault.kind is FaultKind.SLOW_LINK:  # `sending` carries it out, from now on
            self.link_bytes_per_s = fault.mbps * 1e6 / 8
            return
        if fault.kind in NUMERICAL:  # the step's hooks carry it out
            self._due.append(fault)
            return
        carry_out(fault)


# The bit flipped per element size: the top mantissa bit (the value changes by up to half,
# stays finite, and nothing but a comparison with a replica can tell).
MANTISSA_TOP_BIT = {2: 6, 4: 22, 8: 51}


def flip_bit(model: torch.nn.Module) -> str:
    """Flip one bit of the first element of the first floating parameter this rank holds,
    in place; returns which (for the log)."""
    import torch
    from torch.distributed.tensor import DTensor

    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            size = local.element_size()
            if local.numel() == 0 or not local.is_floating_point() or size not in ints:
                continue
            bits = local.view(-1)[:1].view(ints[size])
            bits ^= 1 << MANTISSA_TOP_BIT[size]
            return f"{name}[0] bit {MANTISSA_TOP_BIT[size]}"
    raise RuntimeError("bitflip: this rank holds no floating parameter to flip")


def raylet_pid() -> int:
    """The raylet that started this worker (its parent), checked by name before any kill."""
    ppid = os.getppid()
    with open(f"/proc/{ppid}/comm") as f:
        name = f.read().strip()
    if name != "raylet":
        raise RuntimeError(f"kill-node: this worker's parent process {ppid} is {name!r}, "
                           f"not Ray's raylet; refusing to kill it")
    return ppid


def children_of(pid: int) -> list[int]:
    """PIDs whose parent is `pid` (from /proc; Linux only, as Ray's raylet is)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                # "pid (comm) state ppid ...": comm may hold spaces, so split after ")".
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out.append(int(entry))
    return out


def _signal_this_node(sig: signal.Signals) -> None:
    """Send `sig` to this node's raylet and every process it started, this one last."""
    raylet = raylet_pid()
    others = [p for p in children_of(raylet) if p != os.getpid()]
    os.kill(raylet, sig)
    for pid in others:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), sig)


def kill_this_node() -> None:
    """What losing the machine does to Ray: the raylet and every process it started go at
    once (its workers would otherwise live on for a while as orphans, still answering)."""
    _signal_this_node(signal.SIGKILL)


def freeze_this_node() -> None:
    """What a frozen machine (a paused VM, a hung kernel) does to Ray: the raylet and every
    process it started stop at once, holding their connections open."""
    _signal_this_node(signal.SIGSTOP)


def drain_this_node(deadline_s: float = 60.0) -> None:
    """Ask the GCS to drain this node for preemption, as a cloud provider's notice would."""
    import ray

    accepted, why = drain_node(ray.get_runtime_context().get_node_id(),
                               reason="stalwart fault injection",
                               deadline_ms=int((time.time() + deadline_s) * 1000))
    if not accepted:
        raise RuntimeError(f"drain: Ray refused to drain this node: {why}")


def carry_out(fault: FaultSpec) -> None:
    """Do the fault to this process or this node (every kind but `slow` and `slow-link`,
    lasting states)."""
    kind = fault.kind
    if kind in (FaultKind.KILL, FaultKind.KILL_STAGING, FaultKind.KILL_REPLICATING):
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind is FaultKind.HANG:
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind is FaultKind.TERM:
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind is FaultKind.RAISE:
        raise InjectedFault(f"injected fault {fault}")
    elif kind is FaultKind.KILL_NODE:
        kill_this_node()
    elif kind is FaultKind.FREEZE_NODE:
        freeze_this_node()
    elif kind is FaultKind.DRAIN:
        drain_this_node()
    else:
        raise ValueError(f"unknown fault kind {kind!r}")
