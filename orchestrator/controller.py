"""The controller: a synchronous state machine on the driver that carries out decisions.

Each `_on_<state>` handler does that state's work and returns the next state; `run` checks
every change against the transition table (orchestrator/states.py). Policies decide (failure:
retry or fail; scaling: form, wait, resize or give up; restore: memory or storage) and are
passed in (orchestrator/policies.py builds the defaults); observers keep the accounts and
write the reports (orchestrator/observers.py); the worker group is an abstract base class
(orchestrator/group.py), so tests drive the controller with a fake group and a fake clock.

Recovery is in place: failed ranks are killed, survivors leave their process group and
keep their processes, the next world forms from survivors, warm spares and new actors (or
shrinks to what the cluster can hold) and restores from the newest complete checkpoint.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from stalwart import events as ev
from stalwart.checkpointing.storage.catalog import CheckpointInfo, newest_valid
from stalwart.orchestrator.accounting import RecoveryTimer, Throughput
from stalwart.orchestrator.detection import FailureDetector
from stalwart.orchestrator.failures import FailDecision, WorkerFailure
from stalwart.orchestrator.fault_watch import FaultWatch
from stalwart.orchestrator.observers import Clock, ControllerObserver, Display, Restored
from stalwart.orchestrator.reporting import ProfileSaver, StragglerReporter, TierReporter
from stalwart.orchestrator.restore import RestoreDecision
from stalwart.orchestrator.scaling import FormDecision, GiveUpDecision, ResizeDecision, WaitDecision
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

if TYPE_CHECKING:
    from stalwart.config import JobConfig
    from stalwart.orchestrator.group import WorkerGroup
    from stalwart.orchestrator.policies import Policies
    from stalwart.run_dir import EventLog, MetricsLog
    from stalwart.workers.reports import CommitReport, StepReport, WorkerStatus


class Controller:
    def __init__(self, config: JobConfig, *, storage_url: str, group: WorkerGroup,
                 group_error: type[Exception], events: EventLog, metrics: MetricsLog,
                 display: Display, resume_from: CheckpointInfo | None, policies: Policies,
                 clock: Clock | None = None, poll_interval_s: float = 0.5,
                 collective_grace_s: float = 3.0,
                 observers: Sequence[ControllerObserver] = ()) -> None:
        self.config, self.storage_url, self.resume_from = config, storage_url, resume_from
        self.group, self.group_error = group, group_error
        self.events, self.display = events, display
        self.policy, self.scaling, self.restore = (policies.failure, policies.scaling,
                                                   policies.restore)
        self.clock = clock or Clock()
        # Heartbeats are drained in batches; a poll costs an RPC per worker, so not faster.
        self.poll_interval_s = poll_interval_s
        self.faults = FaultWatch(config, events, group)
        self.detector = FailureDetector(config, collective_grace_s=collective_grace_s,
                                        nodes_alive=group.nodes_alive)
        self.stragglers = StragglerReporter(config, events, display)
        self.throughput = Throughput(config, metrics, display)
        # In the order their events are written: faults and traces before the commits and
        # steps of the same answer, a recovery's `recovered` before the step's metrics row.
        self.observers: list[ControllerObserver] = [
            self.faults, ProfileSaver(events), TierReporter(config, events), self.stragglers,
            self.detector, RecoveryTimer(events), self.throughput, *observers]
        self.state: State = Scheduling(generation=0, since=self.clock.time())
        self.last_step = resume_from.step if resume_from else 0
        # The newest step logged as checkpoint_committed (a resume's own step was logged by
        # the run that wrote it).
        self._newest_commit_logged = resume_from.step if resume_from else -1
        self.last_loss: float | None = None
        self.last_val_loss: float | None = None
        self.world_size = 0
        self.layout: dict[str, int] = {}
        self.workers: list[dict[str, Any]] = []
        self._stop_requested = False  # set by the SIGINT handler
        self._stop_sent = False
        self._planned: ResizeDecision | None = None  # waiting for every rank to stop
        self._started_emitted = False
        self._done: dict[int, WorkerStatus] = {}

    @property
    def tokens_total(self) -> int:
        return self.throughput.tokens_total

    @property
    def train_time_s(self) -> float:
        return self.throughput.train_time_s

    # ------------------------------------------------------------------ driver loop

    def run(self) -> State:
        previous_handler = self._install_interrupt_handler()
        try:
            while not self.state.terminal:
                try:
                    new = self._handle(self.state)
                except self.group_error as exc:
                    new = self._on_failure(exc.failure)  # type: ignore[attr-defined]
                if new is not self.state:  # a handler returning its own state stays (polls)
                    check_transition(self.state, new)
                    self.state = new
        finally:
            self.group.shutdown(graceful=isinstance(self.state, Finished | Stopped))
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

    def _handle(self, state: State) -> State:
        handlers = {Scheduling: self._on_scheduling, Rendezvous: self._on_rendezvous,
                    Restoring: self._on_restoring, Running: self._on_running,
                    Recovering: self._on_recovering, Resizing: self._on_resizing}
        handler = handlers.get(type(state))
        if handler is None:
            raise ValueError(f"unexpected state {state!r}")
        return handler(state)  # type: ignore[operator]

    # ------------------------------------------------------------------ forming a world

    def _on_scheduling(self, state: Scheduling) -> State:
        """Wait for warm workers: all that Ray has placed, then form the largest valid world."""
        self.group.top_up()
        self.group.refresh()
        if self.group.best_world() < self.scaling.target(self.world_size):
            self.group.refresh(timeout=self.poll_interval_s)  # actors still warming up
        decision = self.scaling.schedule(self.group, generation=state.generation,
                                         world_size=self.world_size,
                                         waited=self.clock.time() - state.since)
        if self._stop_requested:  # between worlds: the newest checkpoint is where a resume starts
            newest = newest_valid(self.storage_url)
            step = newest.step if newest else 0
            self.events.emit(ev.Stopped(step=step,
                             kept_unlogged=self.throughput.kept_unlogged(step)))
            return Stopped(step=step)
        if isinstance(decision, FormDecision):
            return Rendezvous(generation=state.generation, world_size=decision.world_size)
        if isinstance(decision, GiveUpDecision):
            return Failed(reason=decision.reason)
        if isinstance(decision, WaitDecision):
            return state
        raise ValueError(f"unexpected decision {decision!r}")

    def _on_rendezvous(self, state: Rendezvous) -> State:
        old_world, old_layout = self.world_size, self.layout
        self._notify("before_form", state.generation, self.clock.time())
        self.workers = self.group.form(state.world_size, state.generation, self.faults.arm)
        self._notify("after_form", state.generation, self.workers, self.clock.time())
        self.world_size = state.world_size
        replicate, shard = self.config.parallel.degrees(self.world_size)
        self.layout = {"dp_replicate": replicate, "dp_shard": shard,
                       "tp": self.config.parallel.tp, "pp": self.config.parallel.pp}
        reason = self.scaling.resize_reason(old_world, self.world_size, self._planned)
        if reason is not None:
            self.events.emit(ev.Resized(old_world_size=old_world, new_world_size=self.world_size,
                             old_layout=old_layout, new_layout=self.layout, reason=reason,
                             step=self.last_step, generation=state.generation))
            self.display.log(f"world resized {old_world} -> {self.world_size} ({reason})")
        self._planned = None
        if state.generation == 0:
            return Restoring(generation=0, checkpoint=self.resume_from)
        checkpoint = newest_valid(self.storage_url, on_skip=self._on_damaged_checkpoint)
        self._found_commit(checkpoint)
        decision = self.restore.choose(self.group.memory_inventory, checkpoint)
        if decision is not None:
            self._chosen(decision, state.generation)
        return Restoring(generation=state.generation, checkpoint=checkpoint,
                         memory=decision.memory if decision else None)

    def _chosen(self, decision: RestoreDecision, generation: int) -> None:
        """Log where a world restores from, with both candidates and why."""
        self.events.emit(ev.CheckpointChosen(source=decision.source, step=decision.step,
                         memory_step=decision.memory_step, storage_step=decision.storage_step,
                         reason=decision.reason, generation=generation))
        self.display.log(f"restoring from {decision.source}: {decision.reason}")

    def _on_restoring(self, state: Restoring) -> State:
        start_step, source, peer_fetches = 0, "none", 0
        if state.memory is not None:
            try:
                start_step, fetched = self.group.restore_memory(state.memory)
                source, peer_fetches = "memory", sum(len(f) for f in fetched)
            except self.group_error as exc:
                fallback = self.restore.fallback(state.memory, state.checkpoint,
                                                 exc.failure)  # type: ignore[attr-defined]
                if fallback is None:
                    raise
                self._chosen(fallback, state.generation)
        if source == "none" and state.checkpoint is not None:
            start_step, source = self.group.restore(state.checkpoint.path), "storage"
        if source != "none" or state.generation > 0:
            # The restored step is staged and replicated in this world; older worlds'
            # snapshots are dropped everywhere.
            self.group.finish_restore()
        kept = self.throughput.kept_unlogged(start_step)
        self._notify("after_restore", Restored(
            generation=state.generation, world_size=self.world_size, start_step=start_step,
            source=source, peer_fetches=peer_fetches, last_step=self.last_step),
            self.clock.time())
        self.last_step = start_step
        self.group.launch()
        now = self.clock.time()
        self._notify("after_launch", state.generation, self.world_size, now)
        self.scaling.world_started(now)
        self._done, self._stop_sent = {}, False
        if not self._started_emitted:  # once, even if the first world never launched
            self._started_emitted = True
            self.events.emit(ev.Started(world_size=self.world_size,
                             steps=self.config.train.steps, start_step=start_step,
                             task=self.config.task.path))
        self.events.emit(ev.WorkersStarted(generation=state.generation,
                         world_size=self.world_size,
                         workers=tuple(ev.WorkerPlace(**w) for w in self.workers),
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
        self.clock.sleep(self.poll_interval_s)
        answered, dead = self.group.poll(wait_s=self.poll_interval_s)
        now = self.clock.time()
        for rank, st in answered.items():
            self._absorb(rank, st, now)
        self._notify("after_poll", state, self.last_step, now)
        failure = (self.detector.find(answered, dead, now, self._last_seen)
                   or self.stragglers.check(now, self._last_seen))
        if failure is not None:
            return self._on_failure(failure)
        if len(self._done) == self.world_size:
            return self._on_all_done(state)
        if self._planned is None and not self._stop_requested:
            decision = self.scaling.make_decision(now, world_size=self.world_size,
                                                  workers=self.workers, room=self._room)
            if isinstance(decision, ResizeDecision):
                self._plan(decision)
        return state

    def _absorb(self, rank: int, st: WorkerStatus, now: float) -> None:
        self._notify("on_status", rank, st, now)
        if rank == 0:  # rank 0 commits for everyone; the loss is the global mean on every rank
            self._committed(st.commits)
            for report in st.steps:
                self._on_step(report)
        if st.done:
            self._done[rank] = st
        if st.preempted and not self._stop_requested:
            self._preempted(rank)

    def _on_step(self, r: StepReport) -> None:
        self.last_step, self.last_loss = r.step, r.loss
        self.policy.made_progress()
        if r.val_loss is not None:
            self.last_val_loss = r.val_loss
        self._notify("on_step", r)

    def _committed(self, commits: list[CommitReport]) -> None:
        for commit in commits:
            self.events.emit(ev.CheckpointCommitted(step=commit.step, path=commit.path,
                             save_s=round(commit.save_s, 3)))
            self._newest_commit_logged = max(self._newest_commit_logged, commit.step)
            self.scaling.checkpoint_committed()

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

    def _last_seen(self, ranks: tuple[int, ...], heartbeat: float | None = None) -> float | None:
        """The moment the failure happened, as well as we know it: an injected fault's own
        time, else the last heartbeat, else the end of the newest step."""
        fired = self.faults.fired_at(ranks)
        if fired is not None:
            return fired
        return heartbeat if heartbeat is not None else self.throughput.last_step_end

    def _on_all_done(self, state: Running) -> State:
        if not any(st.stopped_early for st in self._done.values()):
            self.events.emit(ev.Finished(step=self.last_step, loss=self.last_loss,
                             val_loss=self.last_val_loss))
            return Finished(step=self.last_step)
        if self._stop_requested:
            self.events.emit(ev.Stopped(step=self.last_step,
                             kept_unlogged=self.throughput.kept_unlogged(self.last_step)))
            return Stopped(step=self.last_step)
        for rank, st in self._done.items():  # a preempted rank may stop the world on its own
            if st.preempted:
                self._preempted(rank)
        if self._planned is None:
            raise ValueError("every rank stopped early with no resize planned")
        return Resizing(generation=state.generation, reason=self._planned.reason,
                        leaving=self._planned.leaving)

    # ------------------------------------------------------------------ planned resizes

    def _room(self) -> int:
        """Ask for actors up to the ceiling; the best world the warm ones make."""
        self.group.top_up()
        self.group.refresh()
        return self.group.best_world()

    def _preempted(self, rank: int) -> None:
        decision = self.scaling.preempted(self._planned, rank)
        if self._planned is None:
            self._plan(decision)
        self._planned = decision

    def _plan(self, decision: ResizeDecision) -> None:
        """Stop every rank after the same step, checkpoint it, then form a new world."""
        self._planned = decision
        self.display.log(decision.message)
        self.group.request_stop()

    def _on_resizing(self, state: Resizing) -> State:
        self.group.remove(state.leaving)
        self._committed(self.group.disband()[1])
        return Scheduling(generation=state.generation + 1, since=self.clock.time())

    # ------------------------------------------------------------------ failures

    def _on_failure(self, failure: WorkerFailure) -> State:
        decision = self.policy.make_decision(failure)
        detection = (None if failure.last_seen is None else
                     round(max(0.0, failure.detected_at - failure.last_seen), 3))
        nodes = sorted({self.workers[r]["node_ip"] for r in failure.failed_ranks
                        if r < len(self.workers)})
        self.events.emit(ev.Failure(failure_kind=failure.kind.value, rank=failure.rank,
                         ranks=list(failure.failed_ranks), nodes=nodes,
                         message=failure.message, step=self.last_step,
                         retry=not isinstance(decision, FailDecision),
                         detection_s=detection, attempt=self.policy.failures))
        if isinstance(decision, FailDecision):
            return Failed(reason=f"{decision.reason}: {failure.message}")
        if decision.delay_s:
            self.display.log(f"backing off {decision.delay_s:.1f}s before recovering")
            self.clock.sleep(decision.delay_s)
        return Recovering(generation=getattr(self.state, "generation", 0), failure=failure)

    def _on_recovering(self, state: Recovering) -> State:
        """Kill what failed, let the survivors leave their world (keeping their processes)."""
        self.display.log(f"recovering from: {state.failure.message.strip().splitlines()[-1]}")
        self._notify("before_recovery", state.failure)
        self.group.remove(state.failure.failed_ranks)
        survivor_steps, late = self.group.disband()
        self._committed(late)
        self._notify("after_recovery_teardown", survivor_steps, self.clock.time())
        self._planned = None  # a failure during a planned resize: the recovery replaces it
        return Scheduling(generation=state.generation + 1, since=self.clock.time())

    def _on_damaged_checkpoint(self, step: int, message: str) -> None:
        self.events.emit(ev.CheckpointSkipped(step=step, message=message))
        self.display.log(f"skipping damaged checkpoint: {message}")

    def _notify(self, hook: str, *args: Any) -> None:
        for observer in self.observers:
            getattr(observer, hook)(*args)
