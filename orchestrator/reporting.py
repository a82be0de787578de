"""Reports on a running world: commits, profiler traces, the memory tier's size, stragglers,
and the console's one line for a failure or a restore.

Each writes its own event: `checkpoint_committed`, and as observers of the controller
(orchestrator/observers.py) `profile_saved`, `numerical_fault`, `memory_tier`,
`snapshot_interval` and `straggler`. Only the straggler reporter answers back:
with failure.replace_stragglers, a straggler is a failure for the controller to act on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.catalog import list_step_dirs, read_checkpoint, verify
from stalwart.core import events as ev
from stalwart.orchestrator import classify
from stalwart.orchestrator.failures import FailureKind
from stalwart.orchestrator.observers import ControllerObserver
from stalwart.orchestrator.profiles import save_trace
from stalwart.orchestrator.stragglers import StragglerDetector

if TYPE_CHECKING:
    from stalwart.checkpointing.memory.limits import MemoryLimit
    from stalwart.checkpointing.snapshot_schedule import Decision, ScheduleReport
    from stalwart.checkpointing.storage.catalog import CheckpointInfo
    from stalwart.checkpointing.storage.signing import CheckpointTrust
    from stalwart.core.config import JobConfig
    from stalwart.core.events import WorkerPlace
    from stalwart.core.run_logs import EventLog
    from stalwart.orchestrator.detection import LastSeen
    from stalwart.orchestrator.failures import WorkerFailure
    from stalwart.orchestrator.observers import Display
    from stalwart.orchestrator.states import Running, State
    from stalwart.workers.reports import CommitReport, StepReport, WorkerStatus

# Characters of a Ray node id that name it on the console (the full id is in events.jsonl).
NODE_ID_CHARS = 8

# Steps into a world after which its memory tier holds what it will hold from then on (two
# snapshots of each shard it keeps, the newest of them replicated): when its size is reported.
TIER_STEADY_AFTER = 3


def failure_line(failure: WorkerFailure, workers: Sequence[WorkerPlace]) -> str:
    """The console's one line for a failure the run recovers from. A lost node is named, with
    the ranks that ran there (`workers`: the failed world's places); any other failure by
    its message's last line (a traceback's is the exception)."""
    ranks = failure.failed_ranks
    lost = sorted({(w.node_ip, w.node_id) for w in workers if w.rank in ranks})
    if failure.kind is not FailureKind.NODE_DIED or not lost:
        return failure.message.strip().splitlines()[-1]
    nodes = ", ".join(f"{ip} ({node_id[:NODE_ID_CHARS]})" for ip, node_id in lost)
    return (f"{'node' if len(lost) == 1 else 'nodes'} {nodes} lost, with "
            f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))}")


def restore_line(source: str, step: int, why: str | None = None) -> str:
    """The console's line as a world starts to load the step it goes on from."""
    return f"restoring step {step} from {source}" + (f" ({why})" if why else "")


class CommitLog:
    """Logs each committed checkpoint once, as `checkpoint_committed`."""

    def __init__(self, events: EventLog, resume_from: CheckpointInfo | None) -> None:
        self.events = events
        # The newest step logged (a resume's own step was logged by the run that wrote it).
        self.newest = resume_from.step if resume_from else -1
        self._logged: set[CommitReport] = set()  # a world's leave hands over polled ones too

    def reported(self, commits: list[CommitReport]) -> None:
        """Commits rank 0 reported (it commits for everyone)."""
        for commit in commits:
            if commit in self._logged:
                continue
            self._logged.add(commit)
            self.events.emit(ev.CheckpointCommitted(step=commit.step, path=commit.path,
                             save_s=round(commit.save_s, 3), cleared=list(commit.cleared)))
            self.newest = max(self.newest, commit.step)

    def found_on_storage(self, url: str, trust: CheckpointTrust) -> list[int]:
        """Every checkpoint that storage holds committed past the newest logged and that
        verifies, logged as `found` (oldest first); their steps. For the end of a run whose
        workers may have committed after the driver stopped listening (an abandoned stop)."""
        steps = []
        for step, done in list_step_dirs(url):
            if not done or step <= self.newest:
                continue
            try:
                checkpoint = verify(read_checkpoint(url, step), trust, hashes=False)
            except CheckpointError:
                continue  # damaged, or signed by another key: no commit of this run's
            self.found(checkpoint)
            steps.append(step)
        return steps

    def found(self, checkpoint: CheckpointInfo | None) -> None:
        """A commit that storage holds but no rank reported: rank 0 writes the manifest
        and reports it at the next poll, so a rank 0 lost in between (its node gone) leaves
        a committed checkpoint the log would otherwise never name, though the restore uses
        it. Tune and `stalwart report` learn of checkpoints from this event."""
        if checkpoint is None or checkpoint.step <= self.newest:
            return
        self.events.emit(ev.CheckpointCommitted(step=checkpoint.step, path=checkpoint.path,
                         save_s=None, found_on_restore=True))
        self.newest = checkpoint.step


class ProfileSaver(ControllerObserver):
    """Writes each rank's profiler trace into the run dir (where events.jsonl is)."""

    def __init__(self, events: EventLog) -> None:
        self.events = events

    def on_status(self, rank: int, status: WorkerStatus, now: float) -> None:
        for trace in status.profiles:  # every rank traces its own part of the steps
            path = save_trace(self.events.path.parent / "profile", trace)
            self.events.emit(ev.ProfileSaved(rank=trace.rank, steps=list(trace.steps),
                             path=str(path.resolve()), generation=trace.generation,
                             export_s=round(trace.export_s, 3)))


class NumericsLog(ControllerObserver):
    """Writes rank 0's numerical-fault decisions as `numerical_fault` events, one console
    line each (every rank took the same decisions: rank 0 speaks for them)."""

    def __init__(self, events: EventLog, display: Display) -> None:
        self.events = events
        self.display = display

    def on_status(self, rank: int, status: WorkerStatus, now: float) -> None:
        for fields in status.numerics:
            event = ev.NumericalFault(**fields)
            self.events.emit(event)
            where = f" to step {event.rollback_to}" if event.rollback_to is not None else ""
            self.display.log(f"step {event.step}: {event.fault} ({event.detail}); "
                             f"{event.action}{where}")


class SampleLog(ControllerObserver):
    """Writes the model's validation samples (a task's `validation_samples`) as events."""

    def __init__(self, events: EventLog) -> None:
        self.events = events

    def on_step(self, report: StepReport) -> None:
        if report.samples:
            self.events.emit(ev.ValidationSamples(step=report.step, samples=report.samples))


class TierReporter(ControllerObserver):
    """Once per world, when every rank has reported after the world's first few snapshots
    (two of its own and its peers' copies held): the memory tier's size."""

    def __init__(self, config: JobConfig, events: EventLog) -> None:
        self.checkpoint = config.checkpoint
        self.events = events
        self.world_size = 0
        self._reported = -1  # the generation whose memory-tier size was last reported
        self._bytes: dict[int, int] = {}
        self._limit: MemoryLimit | None = None  # the tightest any worker of the world has
        self.intervals = IntervalLog(events)

    def after_launch(self, generation: int, world_size: int, now: float) -> None:
        self.world_size, self._bytes, self._limit = world_size, {}, None

    def on_status(self, rank: int, status: WorkerStatus, now: float) -> None:
        if status.snapshot_bytes:
            self._bytes[rank] = max(status.snapshot_bytes, self._bytes.get(rank, 0))
        limit = status.tier_limit
        if limit is not None and (self._limit is None or limit.bytes < self._limit.bytes):
            self._limit = limit
        if rank == 0 and status.snapshot_schedule is not None:  # every rank decided alike
            self.intervals.reported(status.generation, status.snapshot_schedule)

    def before_recovery(self, failure: WorkerFailure) -> None:
        self.intervals.world_ended()

    def on_end(self, state: State) -> None:
        self.intervals.world_ended()

    def after_poll(self, state: Running, last_step: int, now: float) -> None:
        if self._reported == state.generation or len(self._bytes) < self.world_size \
                or last_step < state.start_step + TIER_STEADY_AFTER:
            return
        self._reported = state.generation
        ck, limit = self.checkpoint, self._limit
        auto = not isinstance(ck.snapshot_every, int)
        self.events.emit(ev.MemoryTier(generation=state.generation,
                         bytes_per_worker=max(self._bytes.values()),
                         bytes_total=sum(self._bytes.values()),
                         snapshot_every=self.intervals.interval if auto else ck.snapshot_every,
                         replicas=ck.replicas,
                         limit_bytes=limit.bytes if limit else None,
                         limit_bound=limit.bound if limit else None,
                         limit_bound_bytes=limit.bound_bytes if limit else None,
                         snapshot_auto=auto))


class IntervalLog:
    """Rank 0's auto snapshot interval as `snapshot_interval` events: each change, and a
    world's reading when it ends (what the tier cost it once its schedule took over)."""

    def __init__(self, events: EventLog) -> None:
        self.events = events
        self.interval = 1  # the interval in use (a world starts at 1)
        self._generation = -1
        self._latest: ScheduleReport | None = None

    def reported(self, generation: int, report: ScheduleReport) -> None:
        if generation != self._generation:
            self.world_ended()  # a world whose end this log did not hear of
            self._generation = generation
        for decision in report.changes:
            self._emit(decision, report.budget)
        self._latest, self.interval = report, report.interval

    def _emit(self, d: Decision, budget: float) -> None:
        self.events.emit(ev.SnapshotInterval(
            generation=self._generation, step=d.step, interval=d.interval,
            previous=d.previous, change="grew" if d.interval > d.previous else "shrank",
            overhead=round(d.overhead, 6), expected=round(d.expected, 6), budget=budget,
            step_s=round(d.step_s, 6), cost_s=round(d.cost_s, 6)))

    def world_ended(self) -> None:
        """The ending world's reading, once (none before its schedule measured a window)."""
        r, self._latest = self._latest, None
        if r is None or not r.windows:
            return
        self.events.emit(ev.SnapshotInterval(
            generation=self._generation, step=r.step, interval=r.interval,
            previous=r.interval, change="ended",
            overhead=round(r.overhead, 6) if r.overhead is not None else None,
            expected=round(r.expected, 6), budget=r.budget, step_s=round(r.step_s, 6),
            cost_s=round(r.cost_s, 6), windows=r.windows))


class StragglerReporter(ControllerObserver):
    """Reports each new straggler; with failure.replace_stragglers, the first is a failure."""

    def __init__(self, config: JobConfig, events: EventLog, display: Display) -> None:
        fc = config.failure
        self.detector = StragglerDetector(fc.straggler_factor, fc.straggler_steps)
        self.replace = fc.replace_stragglers
        self.events = events
        self.display = display
        self.workers: list[WorkerPlace] = []

    def after_form(self, generation: int, workers: list[WorkerPlace], now: float) -> None:
        self.workers = workers

    def after_launch(self, generation: int, world_size: int, now: float) -> None:
        self.detector.reset(world_size)

    def on_status(self, rank: int, status: WorkerStatus, now: float) -> None:
        for report in status.steps:
            self.detector.observe(rank, report.step, report.local_s)

    def check(self, now: float, seen: LastSeen) -> WorkerFailure | None:
        """Each new straggler is reported; with failure.replace_stragglers, the first is
        returned as the failure to act on."""
        for s in self.detector.check():
            node_ip = self.workers[s.rank].node_ip if s.rank < len(self.workers) else None
            self.events.emit(ev.Straggler(rank=s.rank, node_ip=node_ip,
                             step=s.step, local_s=round(s.local_s, 4),
                             peers_median_s=round(s.peers_median_s, 4),
                             ratio=round(s.ratio, 2), steps=s.steps, replaced=self.replace))
            self.display.log(f"rank {s.rank} is a straggler: {s.ratio:.1f}x its peers' local "
                             f"time per step for {s.steps} steps")
            if self.replace:
                return classify.straggler(s, self.detector.factor, now, seen.at((s.rank,)))
        return None
