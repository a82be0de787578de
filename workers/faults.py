"""Fault injection on the worker: the real thing, done to this process or this node.

`kill` and `hang` signal this process (SIGKILL, SIGSTOP), `term` sends it the SIGTERM a
preempted machine gets, `raise` throws from the training loop like a bug in user code,
`kill-node` SIGKILLs this node's raylet (Ray's per-node daemon) and every process it started,
exactly as when a machine is lost, and `drain` asks Ray to drain this node for
preemption. The controller decides which rank carries out each fault (see
orchestrator/faults.py); this module only does it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass


class InjectedFault(RuntimeError):
    """Raised by a `raise` fault: stands for an exception in the task's code."""


@dataclass(frozen=True)
class FaultFired:
    """Told to the controller just before the fault is done, so it knows when it happened."""

    fault: str
    """The fault as the user wrote it, e.g. kill:rank=1,step=20."""
    kind: str
    rank: int
    step: int
    time: float


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


def kill_this_node() -> None:
    """What losing the machine does to Ray: the raylet and every process it started go at
    once (its workers would otherwise live on for a while as orphans, still answering)."""
    raylet = raylet_pid()
    doomed = [p for p in children_of(raylet) if p != os.getpid()]
    os.kill(raylet, signal.SIGKILL)
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os.kill(os.getpid(), signal.SIGKILL)


def drain_this_node(deadline_s: float = 60.0) -> None:
    """Ask the GCS to drain this node for preemption, as a cloud provider's notice would."""
    import ray
    from ray.core.generated import autoscaler_pb2

    ctx = ray.get_runtime_context()
    gcs = ray._raylet.GcsClient(address=ctx.gcs_address)
    accepted, why = gcs.drain_node(
        ctx.get_node_id(), autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "stalwart fault injection", int((time.time() + deadline_s) * 1000))
    if not accepted:
        raise RuntimeError(f"drain: Ray refused to drain this node: {why}")


def carry_out(kind: str, fault: str) -> None:
    if kind in ("kill", "kill-staging", "kill-replicating"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "term":
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind == "raise":
        raise InjectedFault(f"injected fault {fault}")
    elif kind == "kill-node":
        kill_this_node()
    elif kind == "drain":
        drain_this_node()
    else:
        raise ValueError(f"unknown fault kind {kind!r}")
