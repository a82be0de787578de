"""The controller: a synchronous state machine on the driver that carries out decisions.

Each `_on_<state>` handler does that state's work and returns the next state; `run` checks
every change against the transition table (orchestrator/states.py). The worker group is
behind a small interface, so tests can drive the controller with a fake group.

Recovery is in place: failed ranks are killed, survivors leave their process group and
keep their processes, the next world forms from survivors, warm spares and new actors (or
shrinks to what the cluster can hold) and restores from the newest complete checkpoint.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from stalwart import events as ev
from stalwart.checkpointing.memory.catalog import MemoryChoice, newest_complete
from stalwart.checkpointing.memory.store import Inventory
from stalwart.checkpointing.storage.catalog import CheckpointInfo, newest_valid
from stalwart.orchestrator.failures import (
    FailDecision,
    FailureKind,
    FailurePolicy,
    WorkerFailure,
)
from stalwart.orchestrator.faults import FaultPlan
from stalwart.orchestrator.health import HangDetector
from stalwart.orchestrator.profiles import save_trace
from stalwart.orchestrator.states import (
    Failed,
    Finished,
    Recovering,
    Rendezvous,
    Resizing,
    Restoring,
    Running,
    Scheduling,
    State,
    Stopped,
    check_transition,
)
from stalwart.orchestrator.stragglers import StragglerDetector

if TYPE_CHECKING:
    from stalwart.config import FaultSpec, JobConfig
    from stalwart.run_dir import EventLog, MetricsLog
    from stalwart.workers.reports import CommitReport, ProfileReport, StepReport, WorkerStatus


class WorkerGroup(Protocol):
    """The run's workers across generations (orchestrator/worker_group.py: ElasticGroup)."""

    driver_node_id: str

    def top_up(self) -> None: ...
    def refresh(self, timeout: float = 0.0) -> None: ...
    def placed_starting(self) -> int: ...
    def available(self) -> int: ...
    def best_world(self, up_to: int | None = None) -> int: ...
    def nodes_alive(self, node_ids: set[str]) -> bool: ...
    def form(self, world_size: int, generation: int,
             arm: Callable[[list[ev.WorkerPlace]], dict[int, list[FaultSpec]]]
             ) -> list[ev.WorkerPlace]: ...
    def restore(self, path: str) -> int: ...
    def memory_inventory(self) -> dict[str, Inventory]: ...
    def restore_memory(self, choice: MemoryChoice) -> tuple[int, list[list[int]]]: ...
    def finish_restore(self) -> None: ...
    def launch(self) -> None: ...
    def poll(self, wait_s: float) -> tuple[dict[int, WorkerStatus], list[WorkerFailure]]: ...
    def ack_faults(self, rank: int) -> None: ...
    def request_stop(self) -> None: ...
    def remove(self, ranks: tuple[int, ...]) -> None: ...
    def disband(self) -> tuple[list[int], list[CommitReport]]: ...
    def shutdown(self, *, graceful: bool) -> None: ...


class Display(Protocol):
    def update(self, report: StepReport, tokens_per_s: float | None) -> None: ...
    def log(self, message: str) -> None: ...


# Steps into a world after which its memory tier holds what it will hold from then on (two
# snapshots of each shard it keeps, the newest of them replicated): when its size is reported.
TIER_STEADY_AFTER = 3


class Controller:
    # Heartbeats are drained in batches; a poll costs an RPC per worker, so not faster.
    POLL_INTERVAL_S = 0.5
    # A failed collective means some peer failed: give its death this long to show up, so
    # the rank that died is blamed (and replaced) rather than the ranks that noticed.
    COLLECTIVE_GRACE_S = 3.0

    def __init__(self, config: JobConfig, *, storage_url: str, group: WorkerGroup,
                 group_error: type[Exception], events: EventLog, metrics: MetricsLog,
                 display: Display, resume_from: CheckpointInfo | None,
                 draining_nodes: Callable[[], set[str]] | None = None) -> None:
        self.config = config
        self.storage_url = storage_url
        self.group = group
        self.group_error = group_error
        self.events = events
        self.metrics = metrics
        self.display = display
        self.resume_from = resume_from
        self.draining_nodes = draining_nodes or (lambda: set())
        fc = config.failure
        self.policy = FailurePolicy(fc.max_failures, retry_user_errors=fc.retry_user_errors,
                                    backoff_s=fc.backoff_s)
        self.hangs = HangDetector(floor_s=fc.hang_timeout_floor_s, factor=fc.hang_factor,
                                  start_timeout_s=config.scaling.start_timeout_s)
        self.faults = FaultPlan(config.faults)
        self.stragglers = StragglerDetector(fc.straggler_factor, fc.straggler_steps)
        self.state: State = Scheduling(generation=0, since=time.time())
        self.last_step = resume_from.step if resume_from else 0
        # The newest step logged as checkpoint_committed (a resume's own step was logged by
        # the run that wrote it).
        self._newest_commit_logged = resume_from.step if resume_from else -1
        self.last_loss: float | None = None
        self.last_val_loss: float | None = None
        self.world_size = 0
        self.layout: dict[str, int] = {}
        self.workers: list[ev.WorkerPlace] = []
        # Metrics windows run on the workers' clock: from the end of the step of the last
        # row (or the start of a world's first step) to the end of the current step.
        self._last_log_time: float | None = None
        self._last_step_end: float | None = None
        self._tokens_since_log = 0
        # End time of each step since the last row: the next row's steps_in_window, and the
        # unlogged steps a world ends with, whose time is reported when they are known to be
        # kept (kept_unlogged; stalwart report counts it as productive time).
        self._unlogged_ends: dict[int, float] = {}
        # Throughput of this invocation: all tokens over the workers' time spent in steps
        # (checkpoint waits included, start-up and recovery excluded).
        self.tokens_total = 0
        self.train_time_s = 0.0
        # (failure, step restored from, steps lost) until the first step after a recovery
        self._pending_recovery: tuple[WorkerFailure, int, int] | None = None
        self._failure_steps: list[int] = []  # engine steps of the survivors of a failure
        # time.time() at each phase of the recovery in flight, for the `recovered` event
        self._phases: dict[str, float] = {}
        self._recovering_from: WorkerFailure | None = None
        self._stop_requested = False  # set by the SIGINT handler
        self._stop_sent = False
        # A planned resize waiting for every rank to stop: (reason, ranks that must go).
        self._planned: tuple[str, tuple[int, ...]] | None = None
        self._started_emitted = False
        self._done: dict[int, WorkerStatus] = {}
        self._collective_error_since: float | None = None
        self._fault_times: dict[int, float] = {}  # rank -> when an injected fault hit it
        self._next_resize_check = 0.0
        self._restored_from = "none"  # memory, storage or none: where this world started
        self._tier_reported = -1  # the generation whose memory-tier size was last reported
        self._tier_bytes: dict[int, int] = {}
        self._peer_fetches = 0  # shards the last memory restore fetched from peers

    # ------------------------------------------------------------------ driver loop

    def run(self) -> State:
        previous_handler = self._install_interrupt_handler()
        try:
            while not self.state.terminal:
                try:
                    new = self._handle(self.state)
                except self.group_error as exc:
                    new = self._on_failure(exc.failure)  # type: ignore[attr-defined]
                self._transition(new)
        finally:
            graceful = isinstance(self.state, Finished | Stopped)
            self.group.shutdown(graceful=graceful)
            if previous_handler is not None:
                signal.signal(signal.SIGINT, previous_handler)
        return self.state

    def _install_interrupt_handler(self) -> Any:
        """First Ctrl-C: stop after the step in flight and checkpoint it. Second: abandon.

        A flag rather than KeyboardInterrupt, so the interrupt never lands half-way through
        the controller's own bookkeeping. Only the main thread may own signal handlers.
        """
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_sigint(signum: int, frame: Any) -> None:
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True

        return signal.signal(signal.SIGINT, on_sigint)

    def _transition(self, new: State) -> None:
        if new is self.state:  # a handler that returns its own state stays (RUNNING polls)
            return
        check_transition(self.state, new)
        self.state = new

    def _handle(self, state: State) -> State:
        if isinstance(state, Scheduling):
            return self._on_scheduling(state)
        if isinstance(state, Rendezvous):
            return self._on_rendezvous(state)
        if isinstance(state, Restoring):
            return self._on_restoring(state)
        if isinstance(state, Running):
            return self._on_running(state)
        if isinstance(state, Recovering):
            return self._on_recovering(state)
        if isinstance(state, Resizing):
            return self._on_resizing(state)
        raise ValueError(f"unexpected state {state!r}")

    # ------------------------------------------------------------------ forming a world

    def _on_scheduling(self, state: Scheduling) -> State:
        """Wait for warm workers: all that Ray has placed, then form the largest valid world."""
        sc = self.config.scaling
        self.group.top_up()
        want = max(self.world_size or sc.num_workers, sc.floor)  # back to the size we had
        self.group.refresh()
        if self.group.best_world() < want:  # wait a little for actors still warming up
            self.group.refresh(timeout=self.POLL_INTERVAL_S)
        waited = time.time() - state.since
        best = self.group.best_world()
        # Workers Ray has placed are coming; the rest wait for room that may never come.
        enough = best >= want or (best >= sc.floor and (
            self.group.placed_starting() == 0 or waited > sc.start_timeout_s))
        if self._stop_requested:  # between worlds: the newest checkpoint is where a resume starts
            newest = newest_valid(self.storage_url)
            step = newest.step if newest else 0
            self.events.emit(ev.Stopped(step=step, kept_unlogged=self._kept_unlogged(step)))
            return Stopped(step=step)
        if enough:
            return Rendezvous(generation=state.generation, world_size=best)
        key = "start_timeout_s" if state.generation == 0 else "wait_for_workers_s"
        limit = getattr(sc, key)
        if waited > limit:
            floor = (f"scaling.min_workers={sc.min_workers}" if sc.min_workers else
                     f"scaling.num_workers={sc.num_workers} (no scaling.min_workers set)")
            return Failed(reason=(
                f"only {self.group.available()} workers could be started, {floor} are needed; "
                f"waited {waited:.1f}s (scaling.{key}={limit:g}); checkpoints are intact "
                f"under {self.storage_url}"))
        return state

    def _on_rendezvous(self, state: Rendezvous) -> State:
        old_world, old_layout = self.world_size, self.layout
        self._phases["scheduled"] = time.time()
        self.workers = self.group.form(state.world_size, state.generation, self._arm_faults)
        self._phases["joined"] = time.time()
        self.world_size = state.world_size
        replicate, shard = self.config.parallel.degrees(self.world_size)
        self.layout = {"dp_replicate": replicate, "dp_shard": shard,
                       "tp": self.config.parallel.tp, "pp": self.config.parallel.pp}
        if old_world and (old_world != self.world_size or self._planned):
            reason = self._planned[0] if self._planned else "shrink" \
                if self.world_size < old_world else "grow"
            self.events.emit(ev.Resized(old_world_size=old_world, new_world_size=self.world_size,
                             old_layout=old_layout, new_layout=self.layout, reason=reason,
                             step=self.last_step, generation=state.generation))
            self.display.log(f"world resized {old_world} -> {self.world_size} ({reason})")
        self._planned = None
        if state.generation == 0:
            return Restoring(generation=0, checkpoint=self.resume_from)
        checkpoint = newest_valid(self.storage_url, on_skip=self._on_damaged_checkpoint)
        self._found_commit(checkpoint)
        return Restoring(generation=state.generation, checkpoint=checkpoint,
                         memory=self._choose_memory(checkpoint, state.generation))

    def _choose_memory(self, checkpoint: CheckpointInfo | None,
                       generation: int) -> MemoryChoice | None:
        """The memory tier's newest complete step, if it is at least as new as storage's
        newest checkpoint; the choice and its reason go to the event log."""
        if self.config.checkpoint.snapshot_every == 0:
            return None
        choice, why_not = newest_complete(self.group.memory_inventory())
        storage_step = checkpoint.step if checkpoint else None
        memory_step = choice.step if choice else None
        if choice is not None and (storage_step is None or choice.step >= storage_step):
            source, reason = "memory", (f"memory holds step {choice.step} complete" + (
                f", storage's newest is step {storage_step}" if storage_step is not None
                else ", storage has none") + (f" ({why_not})" if why_not else ""))
        elif checkpoint is not None:
            source, choice = "storage", None
            reason = (f"storage's step {storage_step} is newer than memory's step "
                      f"{memory_step}" if memory_step is not None else
                      f"nothing complete in memory: {why_not}")
        else:
            source, reason = "none", f"nothing complete in memory ({why_not}) or in storage"
        self._chosen(source, memory_step, storage_step, reason, generation)
        return choice

    def _chosen(self, source: str, memory_step: int | None, storage_step: int | None,
                reason: str, generation: int) -> None:
        """Log where a world restores from, with both candidates and why."""
        self.events.emit(ev.CheckpointChosen(source=source, step=memory_step
                         if source == "memory" else storage_step, memory_step=memory_step,
                         storage_step=storage_step, reason=reason, generation=generation))
        self.display.log(f"restoring from {source}: {reason}")

    def _arm_faults(self, workers: list[ev.WorkerPlace]) -> dict[int, list[FaultSpec]]:
        armed, unresolved = self.faults.arm(workers, self.group.driver_node_id)
        for message in unresolved:
            self.events.emit(ev.FaultSkipped(message=message))
        return armed

    def _on_restoring(self, state: Restoring) -> State:
        start_step, self._restored_from, self._peer_fetches = 0, "none", 0
        if state.memory is not None:
            try:
                start_step, fetched = self.group.restore_memory(state.memory)
                self._restored_from = "memory"
                self._peer_fetches = sum(len(f) for f in fetched)
            except self.group_error as exc:
                failure: WorkerFailure = exc.failure  # type: ignore[attr-defined]
                if failure.kind in (FailureKind.WORKER_DIED, FailureKind.NODE_DIED,
                                    FailureKind.HANG):
                    raise
                # A holder vanished or a shard would not load: storage is the fallback.
                storage_step = state.checkpoint.step if state.checkpoint else None
                self._chosen("storage" if state.checkpoint else "none", state.memory.step,
                             storage_step, f"restoring from memory failed: {failure.message}",
                             state.generation)
        if self._restored_from == "none" and state.checkpoint is not None:
            start_step = self.group.restore(state.checkpoint.path)
            self._restored_from = "storage"
        if self._restored_from != "none" or state.generation > 0:
            # The restored step is staged and replicated in this world; older worlds'
            # snapshots are dropped everywhere.
            self.group.finish_restore()
        if self._recovering_from is not None:
            failure, self._recovering_from = self._recovering_from, None
            done = max([self.last_step, *self._failure_steps])
            self._pending_recovery = (failure, start_step, max(0, done - start_step))
        self.last_step = start_step
        kept = self._kept_unlogged(start_step)
        self._phases["restored"] = time.time()
        self.group.launch()
        now = time.time()
        self.hangs.reset(range(self.world_size), now)
        self.stragglers.reset(self.world_size)
        self._done = {}
        self._fault_times = {}  # ranks are renumbered: an old fault dates nothing new
        self._tier_bytes = {}
        self._collective_error_since = None
        self._stop_sent = False
        self._next_resize_check = now + self.config.scaling.resize_check_s
        self._last_log_time = self._last_step_end = None
        self._tokens_since_log, self._unlogged_ends = 0, {}
        if not self._started_emitted:  # once, even if the first world never launched
            self._started_emitted = True
            self.events.emit(ev.Started(world_size=self.world_size,
                             steps=self.config.train.steps, start_step=start_step,
                             task=self.config.task.path))
        self.events.emit(ev.WorkersStarted(generation=state.generation,
                         world_size=self.world_size, workers=tuple(self.workers),
                         kept_unlogged=kept))
        return Running(generation=state.generation, start_step=start_step)

    # ------------------------------------------------------------------ running

    def _on_running(self, state: Running) -> State:
        if self._stop_requested and not self._stop_sent:
            self._stop_sent = True
            self.display.log("stopping after the step in flight and checkpointing it "
                             "(Ctrl-C again to abandon the checkpoint)")
            self.group.request_stop()
        # Pace the polls: every answer costs the workers' actor threads the GIL, taken from
        # the training thread; answers arrive in milliseconds, so without this pause the
        # loop would poll back to back (measured: 40% fewer tokens/s).
        time.sleep(self.POLL_INTERVAL_S)
        answered, dead = self.group.poll(wait_s=self.POLL_INTERVAL_S)
        now = time.time()
        for rank, st in answered.items():
            self._absorb(rank, st, now)
        self._report_tier()
        failure = self._find_failure(answered, dead, now) or self._check_stragglers(now)
        if failure is not None:
            return self._on_failure(failure)
        if len(self._done) == self.world_size:
            return self._on_all_done()
        self._check_resize(now)
        return state

    def _absorb(self, rank: int, st: WorkerStatus, now: float) -> None:
        for fired in st.faults:
            self.faults.fired(fired.fault)
            self._fault_times[fired.rank] = now  # the fault happens when it is acknowledged
            self.events.emit(ev.FaultInjected(fault=str(fired.fault), rank=fired.rank,
                             step=fired.step))
        if st.faults:
            self.group.ack_faults(rank)
        for trace in st.profiles:  # every rank traces its own part of the steps
            self._save_profile(trace)
        if rank == 0:  # rank 0 commits for everyone; the loss is the global mean on every rank
            self._committed(st.commits)
            for report in st.steps:
                self._on_step(report)
        self.hangs.answered(rank, now, progressed=bool(st.steps or st.commits))
        for report in st.steps:
            self.stragglers.observe(rank, report.step, report.local_s)
        if st.snapshot_bytes:
            self._tier_bytes[rank] = max(st.snapshot_bytes, self._tier_bytes.get(rank, 0))
        if st.done:
            self._done[rank] = st
            self.hangs.finished(rank)  # done ranks wait for their peers: not a stall
        if st.preempted and not self._stop_requested:
            self._plan_preemption(rank)

    def _committed(self, commits: list[CommitReport]) -> None:
        for commit in commits:
            self.events.emit(ev.CheckpointCommitted(step=commit.step, path=commit.path,
                             save_s=round(commit.save_s, 3)))
            self._newest_commit_logged = max(self._newest_commit_logged, commit.step)
            self._next_resize_check = 0.0  # a checkpoint boundary: look for room now

    def _found_commit(self, checkpoint: CheckpointInfo | None) -> None:
        """Log a commit that storage holds but no rank reported: rank 0 writes the manifest
        and reports it at the next poll, so a rank 0 lost in between (its node gone) leaves
        a committed checkpoint the log would otherwise never name, though the restore uses
        it. Tune and `stalwart report` learn of checkpoints from this event."""
        if checkpoint is None or checkpoint.step <= self._newest_commit_logged:
            return
        self.events.emit(ev.CheckpointCommitted(step=checkpoint.step, path=checkpoint.path,
                         save_s=None, found_on_restore=True))
        self._newest_commit_logged = checkpoint.step

    def _save_profile(self, trace: ProfileReport) -> None:
        """Write a rank's profiler trace into the run dir (where events.jsonl is)."""
        path = save_trace(self.events.path.parent / "profile", trace)
        self.events.emit(ev.ProfileSaved(rank=trace.rank, steps=list(trace.steps),
                         path=str(path.resolve()), generation=trace.generation,
                         export_s=round(trace.export_s, 3)))

    def _report_tier(self) -> None:
        """Once per world, when every rank has reported after the world's first few
        snapshots (two of its own and its peers' copies held): the memory tier's size."""
        generation = getattr(self.state, "generation", 0)
        start = getattr(self.state, "start_step", 0)
        if self._tier_reported == generation or len(self._tier_bytes) < self.world_size \
                or self.last_step < start + TIER_STEADY_AFTER:
            return
        self._tier_reported = generation
        ck = self.config.checkpoint
        self.events.emit(ev.MemoryTier(generation=generation,
                         bytes_per_worker=max(self._tier_bytes.values()),
                         bytes_total=sum(self._tier_bytes.values()),
                         snapshot_every=ck.snapshot_every, replicas=ck.replicas))

    def _find_failure(self, answered: dict[int, WorkerStatus], dead: list[WorkerFailure],
                      now: float) -> WorkerFailure | None:
        """The failure to act on, if any: a dead rank outranks a silent one, which outranks
        an exception, which outranks a failed collective (that is a symptom of the others)."""
        if dead:
            ranks = tuple(sorted({r for f in dead for r in f.failed_ranks}))
            first = dead[0]
            node_ids = {self.workers[r].node_id for r in ranks if r < len(self.workers)}
            lost_node = not self.group.nodes_alive(node_ids)
            return WorkerFailure(
                kind=FailureKind.NODE_DIED if lost_node else FailureKind.WORKER_DIED,
                rank=ranks[0], ranks=ranks, message=first.message if len(dead) == 1 else
                f"worker ranks {list(ranks)} died (node(s) {sorted(node_ids)}): {first.message}",
                detected_at=now, last_seen=self._last_seen(ranks))
        hang = self.hangs.check(now)
        if hang is not None:
            blame = () if hang.answering else hang.ranks
            what = ("no rank completed a step" if hang.answering else
                    f"worker rank(s) {list(hang.ranks)} stopped answering")
            return WorkerFailure(
                kind=FailureKind.HANG, rank=blame[0] if blame else None, ranks=blame,
                message=f"hang: {what} for {hang.silent_s:.1f}s (limit {hang.limit_s:.1f}s = "
                        f"max(failure.hang_timeout_floor_s, failure.hang_factor x median "
                        f"step time))",
                detected_at=now, last_seen=self._last_seen(hang.ranks, hang.last_heartbeat))
        errors = {r: st for r, st in answered.items() if st.error is not None}
        user = {r: st for r, st in errors.items() if st.error_kind != "collective"}
        if user:
            rank, st = min(user.items())
            # The rank that raised is replaced: its peers are stuck in the next collective
            # waiting for it, and only its exit releases them.
            return WorkerFailure(kind=FailureKind.USER_ERROR, rank=rank, ranks=(rank,),
                                 message=st.error or "", detected_at=now,
                                 last_seen=self._last_seen((rank,)))
        if errors:
            self._collective_error_since = self._collective_error_since or now
            if now - self._collective_error_since >= self.COLLECTIVE_GRACE_S:
                rank, st = min(errors.items())
                return WorkerFailure(kind=FailureKind.COLLECTIVE_ERROR, rank=None,
                                     message=f"worker rank {rank}: a collective failed with "
                                             f"no rank to blame:\n{st.error}",
                                     detected_at=now, last_seen=self._last_seen(()))
        return None

    def _check_stragglers(self, now: float) -> WorkerFailure | None:
        """Report each new straggler; with failure.replace_stragglers, replace the first."""
        replace = self.config.failure.replace_stragglers
        for s in self.stragglers.check():
            node_ip = self.workers[s.rank].node_ip if s.rank < len(self.workers) else None
            self.events.emit(ev.Straggler(rank=s.rank, node_ip=node_ip,
                             step=s.step, local_s=round(s.local_s, 4),
                             peers_median_s=round(s.peers_median_s, 4),
                             ratio=round(s.ratio, 2), steps=s.steps, replaced=replace))
            self.display.log(f"rank {s.rank} is a straggler: {s.ratio:.1f}x its peers' local "
                             f"time per step for {s.steps} steps")
            if replace:
                return WorkerFailure(
                    kind=FailureKind.STRAGGLER, rank=s.rank, ranks=(s.rank,), detected_at=now,
                    message=f"rank {s.rank} took {s.ratio:.1f}x its peers' median local time "
                            f"per step for {s.steps} steps (failure.straggler_factor="
                            f"{self.stragglers.factor:g}, failure.replace_stragglers=true)",
                    last_seen=self._last_seen((s.rank,)))
        return None

    def _last_seen(self, ranks: tuple[int, ...], heartbeat: float | None = None) -> float | None:
        """The moment the failure happened, as well as we know it: an injected fault's own
        time, else the last heartbeat."""
        times = [self._fault_times[r] for r in ranks if r in self._fault_times]
        if times:
            return max(times)
        if heartbeat is not None:
            return heartbeat
        return self._last_step_end

    def _on_all_done(self) -> State:
        statuses = self._done.values()
        if not any(st.stopped_early for st in statuses):
            self.events.emit(ev.Finished(step=self.last_step, loss=self.last_loss,
                             val_loss=self.last_val_loss))
            return Finished(step=self.last_step)
        if self._stop_requested:
            self.events.emit(ev.Stopped(step=self.last_step,
                             kept_unlogged=self._kept_unlogged(self.last_step)))
            return Stopped(step=self.last_step)
        for rank, st in self._done.items():  # a preempted rank may stop the world on its own
            if st.preempted:
                self._plan_preemption(rank)
        assert self._planned is not None
        reason, leaving = self._planned
        return Resizing(generation=getattr(self.state, "generation", 0), reason=reason,
                        leaving=leaving)

    def _plan_preemption(self, rank: int) -> None:
        """Every preempted rank leaves, also one preempted during another planned resize."""
        if self._planned is None:
            self._plan("preempted", ranks=(rank,))
        elif rank not in self._planned[1]:
            self._planned = ("preempted", (*self._planned[1], rank))

    def _plan(self, reason: str, ranks: tuple[int, ...] = ()) -> None:
        """Stop every rank after the same step, checkpoint it, then form a new world."""
        self._planned = (reason, ranks)
        what = f"rank(s) {list(ranks)} leaving" if ranks else "room for more workers"
        self.display.log(f"planned resize ({reason}, {what}): checkpointing the next step")
        self.group.request_stop()

    def _check_resize(self, now: float) -> None:
        """Every scaling.resize_check_s: a node being drained, or room to grow."""
        if now < self._next_resize_check or self._planned is not None or self._stop_requested:
            return
        self._next_resize_check = now + self.config.scaling.resize_check_s
        draining = self.draining_nodes()
        leaving = tuple(r for r, w in enumerate(self.workers) if w.node_id in draining)
        if leaving:
            self._plan("drain", ranks=leaving)
            return
        if self.world_size < self.config.scaling.ceiling:
            self.group.top_up()
            self.group.refresh()
            if self.group.best_world() > self.world_size:
                self._plan("grow")

    # ------------------------------------------------------------------ failures

    def _on_failure(self, failure: WorkerFailure) -> State:
        decision = self.policy.make_decision(failure)
        detection = (None if failure.last_seen is None else
                     round(max(0.0, failure.detected_at - failure.last_seen), 3))
        nodes = sorted({self.workers[r].node_ip for r in failure.failed_ranks
                        if r < len(self.workers)})
        self.events.emit(ev.Failure(failure_kind=failure.kind.value, rank=failure.rank,
                         ranks=list(failure.failed_ranks), nodes=nodes,
                         message=failure.message, step=self.last_step,
                         retry=not isinstance(decision, FailDecision),
                         detection_s=detection, attempt=self.policy.failures))
        if isinstance(decision, FailDecision):
            return Failed(reason=f"{decision.reason}: {failure.message}")
        generation = getattr(self.state, "generation", 0)
        if decision.delay_s:
            self.display.log(f"backing off {decision.delay_s:.1f}s before recovering")
            time.sleep(decision.delay_s)
        return Recovering(generation=generation, failure=failure)

    def _on_recovering(self, state: Recovering) -> State:
        """Kill what failed, let the survivors leave their world (keeping their processes)."""
        self.display.log(f"recovering from: {state.failure.message.strip().splitlines()[-1]}")
        self._phases = {"detected": state.failure.detected_at}
        self.group.remove(state.failure.failed_ranks)
        self._failure_steps, late = self.group.disband()
        self._committed(late)
        self._phases["left"] = time.time()
        self._recovering_from = state.failure
        self._planned = None  # a failure during a planned resize: the recovery replaces it
        return Scheduling(generation=state.generation + 1, since=time.time())

    def _on_resizing(self, state: Resizing) -> State:
        self.group.remove(state.leaving)
        self._committed(self.group.disband()[1])
        return Scheduling(generation=state.generation + 1, since=time.time())

    # ------------------------------------------------------------------ reports

    def _on_step(self, r: StepReport) -> None:
        self.last_step, self.last_loss = r.step, r.loss
        self.hangs.step_time(r.step_time_s)
        self.policy.made_progress()
        if r.val_loss is not None:
            self.last_val_loss = r.val_loss
        if self._pending_recovery is not None:
            failure, from_step, lost = self._pending_recovery
            self._pending_recovery = None
            since = failure.last_seen or failure.detected_at
            marks = [("detect", since), *self._phases.items(), ("first_step", r.time)]
            # Seconds spent in each phase: detect (failure -> noticed), teardown (kill the
            # failed, survivors leave), wait (warm workers), join (process group, model),
            # restore (checkpoint load), first_step.
            names = {"detected": "detect", "left": "teardown", "scheduled": "wait",
                     "joined": "join", "restored": "restore", "first_step": "first_step"}
            phases = {names[b[0]]: round(b[1] - a[1], 3) for a, b in itertools.pairwise(marks)
                      if b[0] in names}
            self.events.emit(ev.Recovered(from_step=from_step, source=self._restored_from,
                             peer_fetches=self._peer_fetches,
                             world_size=self.world_size, lost_steps=lost,
                             recovery_s=round(r.time - since, 3), phases=phases,
                             generation=getattr(self.state, "generation", 0)))
        if self._last_log_time is None:  # first step of a world: its window starts on its clock
            self._last_log_time = r.time - r.step_time_s
        self.train_time_s += r.time - (self._last_step_end or self._last_log_time)
        self._last_step_end = self._unlogged_ends[r.step] = r.time
        self.tokens_total += r.tokens
        self._tokens_since_log += r.tokens
        tokens_per_s = None
        if r.step % self.config.run.log_every == 0 or r.step == self.config.train.steps \
                or r.val_loss is not None:
            elapsed = max(r.time - self._last_log_time, 1e-9)
            tokens_per_s = self._tokens_since_log / elapsed
            row = ev.MetricsRow(step=r.step, loss=r.loss, lr=r.lr,
                                tokens_per_s=round(tokens_per_s, 1), world_size=self.world_size,
                                samples_seen=r.samples_seen, time=r.time,
                                window_s=round(elapsed, 6),
                                steps_in_window=len(self._unlogged_ends), val_loss=r.val_loss)
            self.metrics.write(row)
            self._last_log_time, self._tokens_since_log = r.time, 0
            self._unlogged_ends = {}
        self.display.update(r, tokens_per_s)

    def _kept_unlogged(self, kept_up_to: int) -> ev.KeptUnlogged | None:
        """The steps of the world that just ended after its last metrics row, up to the step
        the run goes on from, and their seconds on the workers' clock (a row's window, for
        steps that got no row); None if there are none."""
        kept = [s for s in self._unlogged_ends if s <= kept_up_to]
        if not kept or self._last_log_time is None:
            return None
        return ev.KeptUnlogged(
            first_step=min(kept), last_step=max(kept),
            window_s=round(self._unlogged_ends[max(kept)] - self._last_log_time, 6))

    def _on_damaged_checkpoint(self, step: int, message: str) -> None:
        self.events.emit(ev.CheckpointSkipped(step=step, message=message))
        self.display.log(f"skipping damaged checkpoint: {message}")
