"""What workers tell the controller: plain, picklable records (the heartbeat is a StepReport).

Every reply of a TrainWorker RPC is one of these, or stalwart.events.WorkerPlace for where
the worker runs. CommitReport is the storage writer's (checkpointing never imports workers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from stalwart.checkpointing.memory.limits import MemoryLimit
from stalwart.checkpointing.snapshot_schedule import ScheduleReport
from stalwart.checkpointing.storage.commit_report import CommitReport
from stalwart.core.stream import SampleIds
from stalwart.workers.faults import FaultFired


@dataclass(frozen=True)
class StepReport:
    """One completed optimizer step, as seen by one rank (loss is already the global mean)."""

    rank: int
    step: int
    loss: float
    lr: float
    tokens: int
    """Tokens the whole world consumed in this step."""
    step_time_s: float
    time: float
    """Wall-clock time (time.time()) at the end of the step."""
    val_loss: float | None = None
    samples_seen: int = 0
    """Global sample index after this step: the step trained samples [this - batch, this)."""
    local_s: float = 0.0
    """Seconds of this rank's own work before its first gradient synchronisation (what a
    straggler takes longer for; see orchestrator/stragglers.py)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The task's own metrics, global means like the loss; `val_<name>` ones too on a
    validation step."""
    samples: list[dict[str, str]] = field(default_factory=list)
    """Rank 0's `validation_samples` on a validation step (empty otherwise)."""
    data_wait_s: float = 0.0
    """Seconds the step waited for its data, the mean over ranks."""
    ledger: SampleIds | None = None
    """Rank 0's, with data.ledger on: every sample of the global batch, in order."""
    skipped: bool = False
    """The step's update was dropped (a numerical fault, or numerics.skip_steps)."""
    replays: int = 0
    """Times the step was trained again after a numerical fault."""
    grad_bytes: int | None = None
    """Bytes of gradient this rank's data-parallel reduction carried (None: no reduction
    counted, see TrainEngine.grad_bytes)."""


@dataclass(frozen=True, kw_only=True)
class LeaveReport:
    """A worker's answer to leaving its world (TrainWorker.leave)."""

    left: bool
    """False when its training thread is still stuck: the process is not reusable."""
    step: int
    """The last step this rank completed (the controller counts the steps a failure cost)."""
    commits: tuple[CommitReport, ...] = ()
    """This world's commits, polled or not (an answer may have been dropped as the world
    ended), and the save in flight if it completed."""
    steps: tuple[StepReport, ...] = ()
    """Steps after the controller's last one that it may not have heard of: queued after the
    last poll, or drained by a poll whose answer was dropped as the world ended."""


@dataclass(frozen=True, kw_only=True)
class MemoryRestoreReport:
    """A worker's answer to restoring from the memory tier (TrainWorker.restore_memory)."""

    step: int
    fetched: tuple[int, ...]
    """The source ranks whose shards came from peers (the rest it held itself)."""


@dataclass(frozen=True)
class ProfileReport:
    """A torch.profiler trace of steps[0]..steps[1] (both included) on one rank."""

    rank: int
    generation: int
    steps: tuple[int, int]
    trace_zlib: bytes
    """The chrome trace JSON, zlib-compressed (the driver writes it to the run dir)."""
    export_s: float
    """Seconds the rank spent stopping the profiler and exporting the trace."""


@dataclass(frozen=True)
class WorkerStatus:
    """Everything a worker has to say since the last poll."""

    rank: int
    generation: int
    steps: list[StepReport]
    commits: list[CommitReport]
    done: bool
    """The training thread has ended normally (finished or stopped on request)."""
    stopped_early: bool = False
    error: str | None = None
    """Formatted traceback of an exception in the training thread (user code or ours)."""
    error_kind: str | None = None
    """"user" for the task's code, "collective" for a failed or timed-out collective,
    "numerics" for a numerical fault the world could not mend in place."""
    evict: tuple[int, ...] = ()
    """With error_kind "numerics": the ranks found faulty, to replace (none: stop)."""
    numerics: list[dict[str, Any]] = field(default_factory=list)
    """Rank 0's numerical-fault decisions since the last poll (`numerical_fault` events)."""
    faults: list[FaultFired] = field(default_factory=list)
    profiles: list[ProfileReport] = field(default_factory=list)
    """Profiler traces finished since the last poll (run.profile_steps)."""
    preempted: bool = False
    """The process got SIGTERM: its machine is going away."""
    snapshot_bytes: int = 0
    """Memory the worker's in-memory checkpoint tier holds (its snapshots and replicas)."""
    tier_limit: MemoryLimit | None = None
    """The most the tier may hold on this worker, and which bound set it."""
    snapshot_schedule: ScheduleReport | None = None
    """With checkpoint.snapshot_every = "auto": the interval's changes since the last poll
    and its measured overhead (the same on every rank)."""
    busy: str | None = None
    """What the training thread is waiting on between steps ("saving a checkpoint",
    "validating"): slow, not stuck, so the hang detector gives it a longer limit."""
    flight_record: str | None = None
    """Where the training thread is, from the flight recorder, once it has completed no step
    for half the hang limit: the collective it waits in, or none (parallel/nccl.py)."""
