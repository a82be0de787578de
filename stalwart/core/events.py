"""The run directory's record: one frozen dataclass per event kind, and the metrics row.

This module is the schema of `events.jsonl` and `metrics.jsonl` (docs/run-directory.md is
generated from it). Writers build these objects (`EventLog.emit(Failure(...))`); readers
(`stalwart report`, Tune, TensorBoard, bench/) get them back with `read_events`, never by
picking keys out of dicts. A line is `{"time", "kind", ...fields}`.

Old run directories stay readable: a field added later has a default, and a key this
version does not know is ignored (`from_row`).
"""

from __future__ import annotations

import dataclasses
import json
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from stalwart.core.errors import RecordError
from stalwart.core.records import read_rows, record


@dataclass(frozen=True, kw_only=True)
class WorkerPlace:
    """Where one rank of a world runs."""

    rank: int
    pid: int
    """The worker's process id on its node."""
    node_ip: str
    node_id: str
    """Ray's node id."""


@dataclass(frozen=True, kw_only=True)
class KeptUnlogged:
    """Steps a world ended with after its last metrics row that the run keeps."""

    first_step: int
    last_step: int
    window_s: float
    """Seconds from the end of the last logged step to the end of `last_step`, on the
    workers' clock."""


@dataclass(frozen=True, kw_only=True)
class Event:
    """One line of events.jsonl."""

    kind: ClassVar[str]
    time: float = field(default_factory=time.time)
    """time.time() when the event was written."""

    def to_row(self) -> dict[str, Any]:
        fields = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}
        return {"time": fields.pop("time"), "kind": self.kind, **fields}


# ---------------------------------------------------------------- the run's life


@dataclass(frozen=True, kw_only=True)
class Started(Event):
    """The first world launched (once per invocation of `stalwart run`)."""

    kind: ClassVar[str] = "started"
    world_size: int
    steps: int
    """train.steps: the step the run ends at."""
    start_step: int
    """0 for a fresh run; the restored step on --resume."""
    task: str
    """task.path."""


@dataclass(frozen=True, kw_only=True)
class Resumed(Event):
    """`--resume` or `--auto-resume`: the run continues from a committed checkpoint."""

    kind: ClassVar[str] = "resumed"
    from_step: int
    path: str
    """The checkpoint the run continues from."""
    config_changes: dict[str, Any] = field(default_factory=dict)
    """key -> [old, new] for each config key the resume changed."""


@dataclass(frozen=True, kw_only=True)
class StartedFrom(Event):
    """A new run starts from another run's checkpoint (Tune's PBT, Tuner.restore), copied
    into this run's storage first."""

    kind: ClassVar[str] = "started_from"
    from_step: int
    origin: str
    """The checkpoint the run started from: another run's, or one Ray Tune handed a trial."""
    path: str
    """Its verified copy in this run's storage, which the workers load."""


@dataclass(frozen=True, kw_only=True)
class WorkersStarted(Event):
    """A world (generation) launched its training loops."""

    kind: ClassVar[str] = "workers_started"
    generation: int
    """0 for the first world, then +1 per recovery or resize."""
    world_size: int
    workers: tuple[WorkerPlace, ...] = ()
    """Where each rank runs, in rank order."""
    kept_unlogged: KeptUnlogged | None = None
    """The previous world's steps after its last metrics row that this world goes on from,
    with their seconds as in a metrics row; null if none."""


@dataclass(frozen=True, kw_only=True)
class Finished(Event):
    kind: ClassVar[str] = "finished"
    step: int
    loss: float | None = None
    val_loss: float | None = None


@dataclass(frozen=True, kw_only=True)
class Stopped(Event):
    """Stopped on request (Ctrl-C, SIGTERM, `stalwart stop`) after checkpointing `step`."""

    kind: ClassVar[str] = "stopped"
    step: int
    """The last completed step; it was checkpointed."""
    kept_unlogged: KeptUnlogged | None = None
    """As in workers_started: the steps after the last metrics row up to `step`."""


@dataclass(frozen=True, kw_only=True)
class Failed(Event):
    """The run ended in failure (budget exhausted, an error not retried, no workers)."""

    kind: ClassVar[str] = "failed"
    reason: str
    step: int


@dataclass(frozen=True, kw_only=True)
class Interrupted(Event):
    """The driver ended without a final checkpoint (a second Ctrl-C or SIGTERM, a stop past
    failure.stop_timeout_s, Tune stopping or pausing a trial, a callback's exception).
    Workers were stopped; committed checkpoints are intact."""

    kind: ClassVar[str] = "interrupted"
    step: int
    reason: str


# ---------------------------------------------------------------- failures and recovery


@dataclass(frozen=True, kw_only=True)
class Failure(Event):
    """A failure was detected; `retry` says whether the run recovers from it."""

    kind: ClassVar[str] = "failure"
    failure_kind: str
    """worker_died, node_died, hang, user_error, collective_error, start_error, straggler."""
    rank: int | None
    """The rank to blame first, or null."""
    ranks: list[int]
    """Every rank that is replaced."""
    nodes: list[str]
    """IPs of the nodes the failed ranks ran on."""
    pids: list[int] = field(default_factory=list)
    """Process ids of the failed ranks on their nodes (the ranks' order)."""
    message: str
    """One line. For a user error: where it failed (rank, step), the phase of the task (building the model, a batch with its samples, the forward pass and its module, the loss, ...) and the error."""
    traceback: str = ""
    """For a user error: its traceback, trimmed to the frames in the task's own code (the last few when none is), ending with the error; empty otherwise."""
    step: int
    """The last completed step the controller had heard of."""
    retry: bool
    detection_s: float | None
    """Seconds from the failure (the injected fault, or the ranks' last heartbeat) to its
    detection."""
    attempt: int
    """Failures so far in this invocation, this one included."""


@dataclass(frozen=True, kw_only=True)
class CheckpointChosen(Event):
    """Where a new world restores from, both candidates, and why. Written at every restore
    after a failure or resize, and when a restore from memory fails and falls back."""

    kind: ClassVar[str] = "checkpoint_chosen"
    source: str
    """memory, storage or none."""
    step: int | None
    """The step restored."""
    memory_step: int | None
    """The newest step complete in memory, or null."""
    storage_step: int | None
    """The newest valid storage checkpoint, or null."""
    reason: str
    generation: int


@dataclass(frozen=True, kw_only=True)
class Recovered(Event):
    """The first step after a failure completed."""

    kind: ClassVar[str] = "recovered"
    from_step: int
    source: str
    """memory, storage or none (no checkpoint existed yet)."""
    peer_fetches: int
    """Shards the new ranks fetched from peers rather than their own memory."""
    world_size: int
    lost_steps: int
    """Steps completed before the failure that were trained again."""
    recovery_s: float
    """Seconds from the failure to the end of the first step after it."""
    phases: dict[str, float]
    """Seconds in each phase: detect, teardown, wait, join, restore, first_step."""
    generation: int


@dataclass(frozen=True, kw_only=True)
class Resized(Event):
    kind: ClassVar[str] = "resized"
    old_world_size: int
    new_world_size: int
    old_layout: dict[str, int]
    """{"dp_replicate", "dp_shard", "cp", "tp", "pp", "ep"}."""
    new_layout: dict[str, int]
    reason: str
    """shrink, grow, preempted or drain."""
    step: int
    generation: int


@dataclass(frozen=True, kw_only=True)
class Straggler(Event):
    """A rank stayed slower than its peers' median local time per step."""

    kind: ClassVar[str] = "straggler"
    rank: int
    node_ip: str | None
    step: int
    """When its streak reached `steps`."""
    local_s: float
    """Its local work (before the first gradient sync) that step."""
    peers_median_s: float
    ratio: float
    steps: int
    """Steps in a row the rank was slow: failure.straggler_steps."""
    replaced: bool
    """failure.replace_stragglers: the rank is replaced as a failure."""


@dataclass(frozen=True, kw_only=True)
class NumericalFault(Event):
    """A numerical fault a step's checks found, and what the world did about it ([numerics])."""

    kind: ClassVar[str] = "numerical_fault"
    step: int
    """The step it was found in (before that step's update)."""
    fault: str
    """`nan` (a loss or gradient norm not finite), `spike` (the loss far above its median)
    or `mismatch` (data-parallel replicas whose state differs)."""
    action: str
    """`replay`, `skip`, `rollback`, `evict` or `stop`."""
    ranks: list[int]
    """The ranks a mismatch names (those differing from their replicas' majority)."""
    rollback_to: int | None
    """The step a rollback restored from the memory tier."""
    detail: str
    reason: str
    """Why the policy chose `action`."""
    decided_s: float
    """Seconds from the start of the step to the decision, on rank 0."""


# ---------------------------------------------------------------- checkpoints


@dataclass(frozen=True, kw_only=True)
class CheckpointCommitted(Event):
    """A storage checkpoint is complete (its manifest is written)."""

    kind: ClassVar[str] = "checkpoint_committed"
    step: int
    path: str
    save_s: float | None
    """Seconds from the start of the save to the manifest written; null when found on
    restore."""
    found_on_restore: bool = False
    """No rank reported it: rank 0 died just after the manifest landed, or the workers
    committed it after the driver stopped listening (a second Ctrl-C). A restore, or the
    end of a failed or interrupted run, found it on storage."""
    cleared: list[str] = field(default_factory=list)
    """Files the step directory held before the save began (an earlier attempt's, or
    planted), removed so that the manifest signs only what the save wrote."""


@dataclass(frozen=True, kw_only=True)
class DataFilesChanged(Event):
    """A resume went on although the stream's files changed since its checkpoint
    (data.accept_changed_files): the order follows the new file list from here."""

    kind: ClassVar[str] = "data_files_changed"
    changes: list[str]
    """What changed, a line per kind: added, removed, rewritten, with the files."""


@dataclass(frozen=True, kw_only=True)
class CheckpointSkipped(Event):
    """A checkpoint was skipped: damaged, incomplete, or it failed to load. The next older
    valid one is used."""

    kind: ClassVar[str] = "checkpoint_skipped"
    message: str
    """What is wrong with it, and where."""
    step: int | None = None


@dataclass(frozen=True, kw_only=True)
class UnsignedCheckpointAccepted(Event):
    """A checkpoint without a trusted signature was accepted, because the run was started
    with --trust-unsigned (one made elsewhere, or before signing). Its files matched its
    manifest."""

    kind: ClassVar[str] = "unsigned_checkpoint_accepted"
    step: int
    path: str
    why: str
    """Why its signature is not trusted: not signed, or signed with another key."""


@dataclass(frozen=True, kw_only=True)
class MemoryTier(Event):
    """The memory tier's size in a world: once per world, after its first three steps."""

    kind: ClassVar[str] = "memory_tier"
    generation: int
    bytes_per_worker: int
    """The most any worker's tier holds: its staging buffers and the snapshots it keeps for
    itself and its peers."""
    bytes_total: int
    snapshot_every: int
    """Snapshots every this many steps (with `snapshot_auto`: the interval then in use)."""
    replicas: int
    limit_bytes: int | None = None
    """The most the tier may hold on a worker (the smallest of the workers' limits): the
    configured checkpoint.memory_limit_gb, else 40% of `limit_bound_bytes` shared among the
    node's ranks."""
    limit_bound: str | None = None
    """What set that limit: configured (checkpoint.memory_limit_gb), cgroup (the worker's
    container or job: cgroup v2 memory.max, v1 memory.limit_in_bytes), ray (Ray's memory
    resource of the node) or physical (the node's RAM), whichever is smallest."""
    limit_bound_bytes: int | None = None
    """That bound's bytes: for the node (cgroup, ray, physical), or per worker (configured)."""
    snapshot_auto: bool = False
    """checkpoint.snapshot_every = "auto": the interval follows `snapshot_interval` events."""


@dataclass(frozen=True, kw_only=True)
class SnapshotInterval(Event):
    """With checkpoint.snapshot_every = "auto": the memory tier's interval changed (every rank
    of the world decided it at the same snapshot, from the costs they all measured), or a
    world ended (`change` = `ended`: its reading, what the tier cost it)."""

    kind: ClassVar[str] = "snapshot_interval"
    generation: int
    step: int
    """The snapshot step at which the decision was taken. From there snapshots are at most
    `interval` steps apart, spread evenly up to each persist step and the last step."""
    interval: int
    previous: int
    change: str
    """`grew`, `shrank`, or `ended` (the world's reading as it ended)."""
    overhead: float | None
    """Measured: what the tier cost as a fraction of the step time (the longest any rank
    measured). For a change, the last window's (snapshot to snapshot) at `previous`; for
    `ended`, the median window's since the world's first decision (of its last 64)."""
    expected: float
    """What the costs measured predict at `interval`."""
    budget: float
    """checkpoint.snapshot_budget."""
    step_s: float
    """The step time the decision used (the longest any rank measured, smoothed)."""
    cost_s: float
    """Seconds one snapshot is predicted to cost the step at `interval`."""
    windows: int = 0
    """For `ended`: the windows (snapshot to snapshot) the reading is taken over."""


# ---------------------------------------------------------------- faults and profiles


@dataclass(frozen=True, kw_only=True)
class FaultInjected(Event):
    kind: ClassVar[str] = "fault_injected"
    fault: str
    """The fault as written, e.g. kill:rank=1,step=20."""
    rank: int
    """The rank that carried it out."""
    step: int


@dataclass(frozen=True, kw_only=True)
class FaultSkipped(Event):
    """An injected fault has no target in this world, e.g. a node that does not exist."""

    kind: ClassVar[str] = "fault_skipped"
    message: str


@dataclass(frozen=True, kw_only=True)
class ValidationSamples(Event):
    """What the model wrote at a validation step (a task's `validation_samples`: greedy
    completions of fixed prompts), so a run's progress can be read, not only its loss."""

    kind: ClassVar[str] = "validation_samples"
    step: int
    samples: list[dict[str, str]]
    """One {"prompt", "text"} per prompt, in the task's order."""


@dataclass(frozen=True, kw_only=True)
class ProfileSaved(Event):
    kind: ClassVar[str] = "profile_saved"
    rank: int
    steps: list[int]
    """[first, last] step of the trace, both included."""
    path: str
    """The trace, in RUN_DIR/profile/."""
    generation: int
    export_s: float
    """Seconds the rank spent stopping the profiler and exporting the trace."""


# ---------------------------------------------------------------- trackers


@dataclass(frozen=True, kw_only=True)
class TrackerFailed(Event):
    """An experiment tracker (run.loggers) raised an error: a warning, the run goes on. That
    tracker gets nothing more in this invocation (docs/trackers.md)."""

    kind: ClassVar[str] = "tracker_failed"
    tracker: str
    """The logger's name: tensorboard, mlflow or wandb."""
    message: str
    """The error, as `Type: message`."""
    step: int | None = None
    """The step of the row, event or end the tracker failed at, if it has one."""


# ---------------------------------------------------------------- metrics.jsonl


@dataclass(frozen=True, kw_only=True)
class MetricsRow:
    """One line of metrics.jsonl: a logged step (every run.log_every, the last step, and
    each validation)."""

    step: int
    loss: float
    """The step's mean training loss over all ranks."""
    lr: float
    """The learning rate the step used."""
    tokens_per_s: float
    """Tokens of all ranks over the row's window (`window_s`)."""
    world_size: int
    samples_seen: int
    """The global sample index after the step: it trained samples
    [samples_seen - global_batch_size, samples_seen)."""
    time: float
    """Unix seconds at the end of the step, on the workers' clock."""
    window_s: float | None = None
    """Seconds, on the workers' clock, from the end of the previous row's step (or the start
    of the world's first step) to the end of this one."""
    steps_in_window: int | None = None
    """How many steps the window holds."""
    val_loss: float | None = None
    """On validation steps only."""
    data_wait_s: float | None = None
    """Seconds the window's steps waited for their data (the mean over ranks, summed over the
    steps): reading that did not keep up with training."""
    grad_bytes: int | None = None
    """Bytes of gradient each rank handed its data-parallel reduction in this step, after
    `parallel.grad_compression` (a ring all-reduce puts about twice that on the wire); with
    data parallelism and tp = ep = 1 only."""
    task_metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """The task's own metrics at this step (`val_<name>` on validation steps): columns of
    their own in the file, next to the ones above."""

    def to_row(self) -> dict[str, Any]:
        row = dataclasses.asdict(self)
        for key in ("val_loss", "data_wait_s", "grad_bytes"):
            if row[key] is None:
                del row[key]
        row.update(row.pop("task_metrics"))
        return row


# ---------------------------------------------------------------- reading back

EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls for cls in (
        Started, Resumed, StartedFrom, WorkersStarted, Finished, Stopped, Failed, Interrupted,
        Failure, CheckpointChosen, Recovered, Resized, Straggler, CheckpointCommitted,
        CheckpointSkipped, DataFilesChanged, UnsignedCheckpointAccepted, MemoryTier,
        SnapshotInterval, FaultInjected, FaultSkipped,
        ProfileSaved, ValidationSamples, TrackerFailed, NumericalFault)
}

T = TypeVar("T")


# A diverging run logs a NaN or infinite loss: a true record. Every other number is finite.
MAY_BE_NAN = frozenset({"loss", "val_loss"})


def parse_event(row: dict[str, Any], *, where: str = "event") -> Event:
    """The typed event of one events.jsonl row, every field checked (`where` names the row
    in a RecordError: file and line)."""
    kind = row.get("kind")
    if kind is None:
        raise RecordError(f"{where} has no field 'kind'")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise RecordError(f"{where}: unknown event kind {kind!r}; this stalwart knows "
                          f"{', '.join(sorted(EVENT_TYPES))}")
    return record(cls, row, where=f"{where}: {kind} event", required=("time",),
                  may_be_nan=MAY_BE_NAN)


def from_row(cls: type[T], row: dict[str, Any]) -> T:
    """Build `cls` from a JSON row: nested records rebuilt, unknown keys ignored."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in row:
            kwargs[f.name] = _build(hints[f.name], row[f.name])
    return cls(**kwargs)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every row of a JSONL file, which a running (or crashed) writer may have left with a
    half-written last line: that one is left out. Any other damage is a RecordError naming
    the file and line (stalwart.records)."""
    return [row for _, row in read_rows(path)]


def read_events(path: Path) -> list[Event]:
    """Every event of an events.jsonl (a half-written last line is left out)."""
    return [parse_event(row, where=f"{path} line {n}") for n, row in read_rows(path)]


def read_metrics(path: Path) -> list[MetricsRow]:
    """Every row of a metrics.jsonl (a half-written last line is left out); a column that is
    not one of MetricsRow's fields and holds a number is a task metric."""
    fields = {f.name for f in dataclasses.fields(MetricsRow)}
    rows = []
    for n, row in read_rows(path):
        metrics = record(MetricsRow, row, where=f"{path} line {n}", may_be_nan=MAY_BE_NAN)
        extra = {k: v for k, v in row.items() if k not in fields
                 and isinstance(v, (int, float)) and not isinstance(v, bool)}
        rows.append(dataclasses.replace(metrics, task_metrics=extra) if extra else metrics)
    return rows


def dumps(record: Event | MetricsRow) -> str:
    return json.dumps(record.to_row(), default=str)


def _build(hint: Any, value: Any) -> Any:
    """A JSON value as the field's type: nested dataclasses and tuples of them."""
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if arg is not type(None):
                return _build(arg, value)
    if dataclasses.is_dataclass(hint) and isinstance(value, dict):
        return from_row(hint, value)  # type: ignore[arg-type]
    if origin is tuple:
        (item, *_) = typing.get_args(hint)
        return tuple(_build(item, v) for v in value)
    return value


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value
