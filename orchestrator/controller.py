"""The controller: a synchronous state machine on the driver that carries out decisions.

Each live state has one handler, found by the state's type, that does the state's work and
returns the next state; `run` checks every change against the transition table
(orchestrator/states.py).

The controller is the only caller of the worker group (orchestrator/group.py). It fetches
the group's frozen views (the pool, a poll, the memory inventory), hands them to the
policies (orchestrator/policies.py) and the failure detector, which are pure and return
decisions as data, and carries the decisions out with the group's commands. Every failure
is built by the classifier (orchestrator/classify.py). Observers keep the accounts and
write the reports (orchestrator/observers.py); no helper calls back into the controller.

Recovery is in place: failed ranks are killed, survivors leave their process group and
keep their processes, the next world forms from survivors, warm spares and new actors (or
shrinks to what the cluster can hold) and restores from the newest complete checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.catalog import CheckpointInfo
from stalwart.checkpointing.storage.signing import CheckpointTrust
from stalwart.core import events as ev
from stalwart.core.ray_log import RAY_LOG, RayLog
from stalwart.orchestrator import classify, reporting
from stalwart.orchestrator.accounting import RecoveryTimer, Throughput
from stalwart.orchestrator.best_metric import BestMetricCheck
from stalwart.orchestrator.clock import Clock
from stalwart.orchestrator.detection import FailureDetector, LastSeen
from stalwart.orchestrator.failure_log import FailureLog
from stalwart.orchestrator.failures import (
    FailDecision,
    FailureKind,
    RetryDecision,
    WorkerFailure,
)
from stalwart.orchestrator.fault_watch import FaultWatch
from stalwart.orchestrator.interrupt import StopAbandoned, StopRequest
from stalwart.orchestrator.ledger import ledger_observers
from stalwart.orchestrator.observers import ControllerObserver, Display, Restored
from stalwart.orchestrator.outcome import Outcome
from stalwart.orchestrator.resize_plan import ResizePlan
from stalwart.orchestrator.scaling import (
    FormDecision,
    GiveUpDecision,
    NeedRoomDecision,
    ResizeDecision,
    WaitDecision,
)
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
from stalwart.orchestrator.storage_restore import StorageRestore

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig
    from stalwart.core.run_logs import EventLog, MetricsLog
    from stalwart.orchestrator.group import Disbanded, WorkerGroup
    from stalwart.orchestrator.policies import Policies
    from stalwart.workers.reports import CommitReport, StepReport, WorkerStatus


class Controller:
    def __init__(self, config: JobConfig, *, storage_url: str, group: WorkerGroup,
                 group_error: type[Exception], events: EventLog, metrics: MetricsLog,
                 display: Display, resume_from: CheckpointInfo | None, policies: Policies,
                 trust: CheckpointTrust,
                 clock: Clock | None = None, poll_interval_s: float = 0.5,
                 collective_grace_s: float = 3.0,
                 observers: Sequence[ControllerObserver] = ()) -> None:
        self.config, self.resume_from = config, resume_from
        self.group, self.group_error = group, group_error
        self.events, self.display = events, display
        self.policy, self.scaling, self.restore = (policies.failure, policies.scaling,
                                                   policies.restore)
        self.clock = clock or Clock()
        # Heartbeats are drained in batches; a poll costs an RPC per worker, so not faster.
        self.poll_interval_s = poll_interval_s
        self.faults = FaultWatch(config, events)
        self.detector = FailureDetector(config, collective_grace_s=collective_grace_s)
        self.stragglers = reporting.StragglerReporter(config, events, display)
        self.throughput = Throughput(config, metrics, display)
        self.commits = reporting.CommitLog(events, resume_from)
        self.storage = StorageRestore(storage_url, trust, events=events, display=display,
                                      commits=self.commits)
        self.failures = FailureLog(self.policy, events)
        self.best_metric = BestMetricCheck(config)
        # In the order their events are written: faults and traces before the commits and
        # steps of the same answer, a recovery's `recovered` before the step's metrics row.
        self.observers: list[ControllerObserver] = [
            self.faults, reporting.ProfileSaver(events), reporting.NumericsLog(events, display),
            reporting.SampleLog(events),
            *ledger_observers(config, events), reporting.TierReporter(config, events),
            self.stragglers, self.detector, RecoveryTimer(events), self.throughput,
            self.best_metric, *observers]
        self.state: State = Scheduling(generation=0, since=self.clock.time())
        self.last_step = resume_from.step if resume_from else 0
        self.last_loss: float | None = None
        self.last_val_loss: float | None = None
        self.world_size = 0
        self.layout: dict[str, int] = {}
        self.workers: list[ev.WorkerPlace] = []
        self.stop = StopRequest(config.failure.stop_timeout_s)  # the first Ctrl-C or SIGTERM
        self._stop_sent = False
        self._stop_heard: int | None = None
        """The last step heard of when the ranks were first asked to stop (None: not yet)."""
        self.resize = ResizePlan(self.scaling, events, display)
        self._started_emitted = False
        self._done: dict[int, WorkerStatus] = {}
        self._trained = False
        # Each live state's handler, found by the state's type; a terminal state has none.
        self._handlers: dict[type[State], Callable[[Any], State]] = {
            Scheduling: self._on_scheduling, Rendezvous: self._on_rendezvous,
            Restoring: self._on_restoring, Running: self._on_running,
            Recovering: self._on_recovering, Resizing: self._on_resizing}

    # ------------------------------------------------------------------ driver loop

    def run(self) -> State:
        # Ray's own paragraphs on the faults handled here (a worker's death, a node marked
        # dead) go to the run dir's ray.log, through the teardown too; the console gets the
        # controller's one line for each.
        with RayLog(self.events.path.parent / RAY_LOG):
            return self._run()

    def _run(self) -> State:
        abandoned: StopAbandoned | None = None
        self.stop.install()
        try:
            while not self.state.terminal:
                try:
                    new = self._handlers[type(self.state)](self.state)
                except self.group_error as exc:
                    new = self._on_failure(exc.failure)  # type: ignore[attr-defined]
                if new is not self.state:  # a handler returning its own state stays (polls)
                    check_transition(self.state, new)
                    self.state = new
        except KeyboardInterrupt as exc:
            if not isinstance(restored := self.stop.restore(exc), StopAbandoned):
                raise  # not the stop's: Tune's, or a signal off the main thread
            abandoned = restored
            self._kill_world()
        finally:
            self.stop.settle()  # the stop's deadline is met (or moot) once the loop ends
            self.group.shutdown(graceful=isinstance(self.state, Finished | Stopped))
            self.stop.uninstall()
            self._notify("on_end", self.state)
        if abandoned is not None:
            raise self._abandoned(abandoned) from None
        if isinstance(self.state, Failed):
            self.storage.log_unreported_commit()
        return self.state

    def _kill_world(self) -> None:
        """An abandoned stop: the world's ranks are killed by PID at once. The teardown's own
        kill (Ray's) returns before the processes are gone, and meanwhile they would train on
        and commit steps that the driver, leaving, never records."""
        try:
            self.group.remove(tuple(range(self.world_size)))
        except Exception as exc:  # noqa: BLE001 - the teardown's kill follows either way
            self.display.log(f"could not kill the workers at once: {exc}")

    def _abandoned(self, abandoned: StopAbandoned) -> StopAbandoned:
        """The abandon as it came out, once the workers are gone. Commits they made that no
        poll reported are logged (`checkpoint_committed`). One past the last step the driver
        had heard of when it asked the ranks to stop is the step in flight's checkpoint (or a
        later one): the run's step is then that one, and the message says it was committed,
        not given up."""
        heard = self.last_step if self._stop_heard is None else self._stop_heard
        try:
            found = self.commits.found_on_storage(self.storage.storage_url,
                                                  self.storage.trust)
        except (OSError, CheckpointError) as exc:
            self.display.log(f"could not list the checkpoints after the stop: {exc}")
            found = []
        if self.commits.newest > heard:
            self.last_step = max(self.last_step, self.commits.newest)
            return abandoned.committed(self.commits.newest, in_flight=True)
        if found:
            return abandoned.committed(found[-1], in_flight=False)
        return abandoned

    def outcome(self) -> Outcome:
        """What the run came to so far: read once `run` has returned, or raised."""
        tp = self.throughput
        return Outcome(step=self.last_step, loss=self.last_loss, val_loss=self.last_val_loss,
                       stop_signal=self.stop.signum if isinstance(self.state, Stopped) else None,
                       tokens_per_s=(tp.tokens_total / tp.train_time_s
                                     if tp.train_time_s > 0 else None))

    # ------------------------------------------------------------------ forming a world

    def _on_scheduling(self, state: Scheduling) -> State:
        """Wait for warm workers: all that Ray has placed, then form the largest valid world."""
        # Only the actors a world needs are asked for here; spares (and a recovery's
        # replacements) once a world has trained a step (_on_running). A spare's start (a Ray
        # worker, torch's import, the model: seconds of CPU) would otherwise slow the first
        # world's start, or a recovery's restore and first step, on a node it shares. A
        # recovery whose warm workers make a world trains on with them
        # (ScalingPolicy.schedule); below the floor it asks at once. (Never more than the
        # ceiling: top_up counts the actors still starting.)
        if state.generation == 0 or self.group.best_world() < self.config.scaling.floor:
            self.group.top_up(spares=False)
        if (failed := self._refresh()) is not None:
            return failed
        pool = self.group.pool_view()
        if pool.best_world < self.scaling.target(self.world_size):
            # actors still warming up
            if (failed := self._refresh(timeout=self.poll_interval_s)) is not None:
                return failed
            pool = self.group.pool_view()
        decision = self.scaling.schedule(pool, generation=state.generation,
                                         world_size=self.world_size,
                                         waited=self.clock.time() - state.since)
        if self.stop.requested:  # between worlds: the newest checkpoint is where a resume starts
            step = self.storage.newest_step()
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
        # The faults each rank carries out are known from the picked places, before the
        # world forms: nothing is asked back while it forms.
        places = self.group.pick(state.world_size, state.generation)
        self.group.form(self.faults.arm(places, self.group.driver_node_id))
        self.workers = places  # the running world's, once it formed
        self._notify("after_form", state.generation, self.workers, self.clock.time())
        self.world_size = state.world_size
        self.layout = self.config.parallel.layout(self.world_size)
        self.resize.formed(old_world=old_world, old_layout=old_layout,
                           new_world=self.world_size, new_layout=self.layout,
                           step=self.last_step, generation=state.generation)
        self.storage.start()
        if state.generation == 0:
            return Restoring(generation=0, checkpoint=self.resume_from)
        checkpoint = self.storage.newest_valid()
        self.commits.found(checkpoint)
        inventory = self.group.memory_inventory() if self.restore.memory_tier else {}
        decision = self.restore.choose(inventory, checkpoint)
        if checkpoint is None and (decision is None or decision.source == "none"):
            lost = self.storage.lost(decision.reason if decision else None)
            if lost is not None:
                return Failed(reason=lost)
        if decision is not None:  # where the world restores from, both candidates and why
            self.events.emit(decision.event(state.generation))
            if decision.source == "none":  # the restore names any other source as it starts
                self.display.log(f"starting from step 0: {decision.reason}")
        return Restoring(generation=state.generation, checkpoint=checkpoint,
                         memory=decision.memory if decision else None)

    def _on_restoring(self, state: Restoring) -> State:
        start_step, source, peer_fetches = 0, "none", 0
        if state.memory is not None:
            self.display.log(reporting.restore_line("memory", state.memory.step, (
                f"storage's newest is step {state.checkpoint.step}" if state.checkpoint
                else "storage has none")))
            try:
                start_step, fetched = self.group.restore_memory(state.memory)
                source, peer_fetches = "memory", sum(len(f) for f in fetched)
            except self.group_error as exc:
                failure = exc.failure  # type: ignore[attr-defined]
                fallback = self.restore.fallback(state.memory, state.checkpoint, failure)
                if fallback is None:
                    raise
                if fallback.source == "none" and (
                        lost := self.storage.lost(fallback.reason)) is not None:
                    return Failed(reason=lost)
                self.events.emit(fallback.event(state.generation))
                self.display.log(f"restoring step {state.memory.step} from memory failed: "
                                 f"{reporting.failure_line(failure, self.workers)}")
                if fallback.source == "none":
                    self.display.log("starting from step 0: storage has no checkpoint")
        if source == "none" and state.checkpoint is not None:
            restored = self._load_storage(state.checkpoint)
            if restored is None:
                lost = self.storage.lost(None)
                assert lost is not None  # a checkpoint was committed: the one that failed
                return Failed(reason=lost)
            start_step, source = restored, "storage"
        kept = self.throughput.kept_unlogged(start_step)
        self._notify("after_restore", Restored(
            generation=state.generation, world_size=self.world_size, start_step=start_step,
            source=source, peer_fetches=peer_fetches, last_step=self.last_step),
            self.clock.time())
        self.last_step = start_step
        # The ranks stage the restored step in this world as they start (older worlds'
        # snapshots are dropped after its first step: see _on_running).
        self.group.launch(restored=source != "none" or state.generation > 0)
        now = self.clock.time()
        self._notify("after_launch", state.generation, self.world_size, now)
        self.scaling.world_started(now)
        self._done, self._stop_sent = {}, False
        self._trained = False
        if not self._started_emitted:  # once, even if the first world never launched
            self._started_emitted = True
            self.events.emit(ev.Started(world_size=self.world_size,
                             steps=self.config.train.steps, start_step=start_step,
                             task=self.config.task.path))
        self.events.emit(ev.WorkersStarted(generation=state.generation,
                         world_size=self.world_size,
                         workers=tuple(self.workers),
                         kept_unlogged=kept))
        return Running(generation=state.generation, start_step=start_step)

    def _load_storage(self, checkpoint: CheckpointInfo) -> int | None:
        """Load `checkpoint` on every rank; one that fails to load is skipped and the next
        older valid one is tried. The step restored, or None when none loads."""
        # The older ones tried after a failed load are named as they are tried.
        self.display.log(reporting.restore_line("storage", checkpoint.step))
        for candidate in self.storage.candidates(checkpoint):
            try:
                return self.group.restore(candidate)
            except CheckpointError as exc:
                self.storage.skip(candidate, str(exc))
        return None

    # ------------------------------------------------------------------ running

    def _on_running(self, state: Running) -> State:
        if self.stop.requested and not self._stop_sent:
            self._stop_sent = True
            if self._stop_heard is None:  # the step in flight is the next one
                self._stop_heard = self.last_step
            self.display.log("stopping after the step in flight and checkpointing it "
                             "(Ctrl-C or SIGTERM again abandons the checkpoint)")
            self.group.request_stop()
        # The group paces the polls: it answers when the interval ends, or at once when a
        # process exits or stops. Every answer costs the workers' actor threads the GIL,
        # taken from the training thread: polled back to back they lose 40% of tokens/s.
        poll = self.group.poll(wait_s=self.poll_interval_s)
        now = self.clock.time()
        for rank, st in poll.answered.items():
            self._absorb(rank, st, now)
        self._notify("after_poll", state, self.last_step, now)
        if self.best_metric.error is not None:
            # The task's rows lack what keep_best ranks by: a wrong config, which no retry
            # mends, so not a failure for the policy to count.
            return Failed(reason=str(self.best_metric.error))
        seen = LastSeen(fault_times=self.faults.fault_times(),
                        last_step_end=self.throughput.last_step_end)
        failure = (self.detector.find(poll, now, seen) or self.stragglers.check(now, seen))
        if failure is not None:
            return self._on_failure(failure)
        if len(self._done) == self.world_size:
            return self._on_all_done(state)
        if not self._trained and self.last_step > state.start_step:
            self._trained = True
            if state.generation > 0:
                # Its first step replicated the restored step: older worlds' snapshots can go.
                self.group.settle()
            self.group.top_up()  # the spares, and the actors a recovery used: see _on_scheduling
        if not self.stop.requested and self.resize.due(now):
            return self._consider_resize(now) or state
        return state

    def _absorb(self, rank: int, st: WorkerStatus, now: float) -> None:
        self._notify("on_status", rank, st, now)
        if st.faults:  # heard: the rank carries them out now
            self.group.ack_faults(rank)
        if rank == 0:  # rank 0 commits for everyone; the loss is the global mean on every rank
            self._committed(st.commits)
            for report in st.steps:
                self._on_step(report)
        if st.done:
            self._done[rank] = st
        if st.preempted and not self.stop.requested:
            self._preempted(rank)

    def _on_step(self, r: StepReport, *, progress: bool = True) -> None:
        self.last_step, self.last_loss = r.step, r.loss
        if progress:
            self.policy.made_progress()
        if r.val_loss is not None:
            self.last_val_loss = r.val_loss
        self._notify("on_step", r)

    def _ended(self, ended: Disbanded) -> WorkerFailure | None:
        """Take in rank 0's steps and commits no poll reported as its world ended (the steps
        came before the failure the policy counted: no progress). A member that did not
        answer at all is a failure of its own (None: every member answered)."""
        for r in (r for r in ended.steps if r.step > self.last_step):
            self._on_step(r, progress=False)
        self._committed(ended.commits)
        if not ended.silent:
            return None
        return classify.silent_members(ended.silent, self.workers, self.clock.time())

    def _committed(self, commits: list[CommitReport]) -> None:
        self.commits.reported(commits)
        if commits:
            self.scaling.checkpoint_committed()
            self._notify("on_commit", max(c.step for c in commits))

    def _on_all_done(self, state: Running) -> State:
        if not any(st.stopped_early for st in self._done.values()):
            self.events.emit(ev.Finished(step=self.last_step, loss=self.last_loss,
                             val_loss=self.last_val_loss))
            return Finished(step=self.last_step)
        if self.stop.requested:
            self.events.emit(ev.Stopped(step=self.last_step,
                             kept_unlogged=self.throughput.kept_unlogged(self.last_step)))
            return Stopped(step=self.last_step)
        for rank, st in self._done.items():  # a preempted rank may stop the world on its own
            if st.preempted:
                self._preempted(rank)
        planned = self.resize.decision
        if planned is None:
            raise ValueError("every rank stopped early with no resize planned")
        return Resizing(generation=state.generation, reason=planned.reason,
                        leaving=planned.leaving)

    # ------------------------------------------------------------------ planned resizes

    def _consider_resize(self, now: float) -> Failed | None:
        """A resize check is due: drain, grow or nothing, as the scaling policy decides from
        the nodes Ray drains and, below the ceiling, the room the cluster has. Failed only
        when a new actor's failed device check spent the failure budget."""
        decision = self.resize.consider(now, world_size=self.world_size, workers=self.workers,
                                        draining=self.group.draining_nodes())
        if isinstance(decision, NeedRoomDecision):
            self.group.top_up()  # actors up to the ceiling: the room is what comes warm
            if (failed := self._refresh()) is not None:
                return failed
            decision = self.resize.room(self.group.pool_view(), world_size=self.world_size)
        if isinstance(decision, ResizeDecision):
            self.group.request_stop()
        return None

    def _preempted(self, rank: int) -> None:
        """A rank got SIGTERM: it leaves at a planned resize (asked of every rank once)."""
        if self.resize.preempted(rank) is not None:
            self.group.request_stop()

    def _on_resizing(self, state: Resizing) -> State:
        self.group.remove(state.leaving)
        silent = self._ended(self.group.disband(after_step=self.last_step))
        if silent is not None:  # a rank that did not answer while the world stopped
            return self._on_failure(silent)
        return Scheduling(generation=state.generation + 1, since=self.clock.time())

    # ------------------------------------------------------------------ failures

    def _refresh(self, timeout: float = 0.0) -> Failed | None:
        """Collect the actors that finished warming up. One whose device failed its health
        check was dropped by the group: a node failure, decided and counted like any other,
        but no world lost anything, so nothing is torn down (Failed: the budget is spent)."""
        self.group.refresh(timeout)
        for failure in self.group.take_unhealthy():
            self.display.log(failure.message)
            decided = self._decide(failure)
            if isinstance(decided, Failed):
                return decided
        return None

    def _decide(self, failure: WorkerFailure) -> RetryDecision | Failed:
        """The failure policy's decision on `failure`, logged; the one path every failure
        takes, whether it starts a recovery or happens within one."""
        decision = self.failures.decide(failure, workers=self.workers,
                                        members=self.group.places(), step=self.last_step)
        if isinstance(decision, FailDecision):
            return Failed(reason=f"{decision.reason}: {failure.message}")
        return decision

    def _on_failure(self, failure: WorkerFailure) -> State:
        decided = self._decide(failure)
        if isinstance(decided, Failed):
            if isinstance(self.state, Running):
                # The run ends here. A rank's error can reach the driver before rank 0's last
                # steps (another node's agent answers later): the world leaves, and rank 0
                # hands over the steps and commits no poll brought. Ranks dead or stuck
                # cannot leave: they are killed first, as in a recovery.
                if failure.kind not in (FailureKind.USER_ERROR, FailureKind.NUMERICS,
                                        FailureKind.COLLECTIVE_ERROR):
                    self.group.remove(failure.failed_ranks)
                self._ended(self.group.disband(after_step=self.last_step))
            return decided
        if isinstance(self.state, Running):
            # The recovery replaces a planned resize still waiting for the ranks to stop (a
            # preempted survivor says so again); one whose ranks left stays, for `resized`.
            self.resize.cancel()
        if decided.delay_s:
            self.display.log(f"backing off {decided.delay_s:.1f}s before recovering")
            self.clock.sleep(decided.delay_s)
        return Recovering(generation=getattr(self.state, "generation", 0), failure=failure)

    def _on_recovering(self, state: Recovering) -> State:
        """Kill what failed, let the survivors leave their world (keeping their processes)."""
        self.display.log(f"recovering from: "
                         f"{reporting.failure_line(state.failure, self.workers)}")
        self._notify("before_recovery", state.failure)
        if state.failure.kind is FailureKind.FAULTY_DEVICE:
            self._exclude_nodes(state.failure.failed_ranks)
        self.group.remove(state.failure.failed_ranks)
        ended = self.group.disband(after_step=self.last_step)
        silent = self._ended(ended)
        self._notify("after_recovery_teardown", ended.survivor_steps, self.clock.time())
        if silent is not None:
            # A survivor that did not answer at all (stopped, or dead meanwhile) was killed
            # and is replaced by the recovery under way: a failure of its own, decided and
            # counted like any other, but neither a second teardown nor a second backoff.
            decided = self._decide(silent)
            if isinstance(decided, Failed):
                return decided
        return Scheduling(generation=state.generation + 1, since=self.clock.time())

    def _exclude_nodes(self, ranks: tuple[int, ...]) -> None:
        """A faulty device: no worker goes on the nodes of these ranks again."""
        places = [self.workers[r] for r in ranks if r < len(self.workers)]
        self.group.exclude_nodes(frozenset(p.node_id for p in places))
        for p in places:
            self.display.log(f"rank {p.rank} on node {p.node_ip} "
                             f"({p.node_id[:reporting.NODE_ID_CHARS]}) differed from its "
                             f"replicas: no worker is placed on that node again")

    def _notify(self, hook: str, *args: Any) -> None:
        for observer in self.observers:
            getattr(observer, hook)(*args)
