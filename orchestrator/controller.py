"""The controller: a synchronous state machine on the driver that carries out decisions.

Each `_on_<state>` handler does that state's work and returns the next state; `run` checks
every change against the transition table (orchestrator/states.py) and logs it. The worker
group is behind a small interface, so tests can drive the controller with a fake group.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from stalwart.checkpointing.catalog import CheckpointInfo, newest_valid
from stalwart.orchestrator.failures import FailDecision, FailurePolicy, WorkerFailure
from stalwart.orchestrator.states import (
    Failed,
    Finished,
    Recovering,
    Rendezvous,
    Restoring,
    Running,
    Scheduling,
    State,
    Stopped,
    check_transition,
)

if TYPE_CHECKING:
    from stalwart.config import JobConfig
    from stalwart.run_dir import EventLog, JsonlWriter
    from stalwart.workers.reports import StepReport, WorkerStatus


class WorkerGroup(Protocol):
    def start(self) -> None: ...
    def rendezvous(self) -> None: ...
    def restore(self, path: str) -> int: ...
    def launch(self) -> None: ...
    def describe(self) -> list[dict[str, Any]]: ...
    def poll(self, timeout: float) -> list[WorkerStatus]: ...
    def request_stop(self) -> None: ...
    def shutdown(self, *, graceful: bool) -> None: ...


class GroupError(Protocol):
    failure: WorkerFailure


class Display(Protocol):
    def update(self, report: StepReport, tokens_per_s: float | None) -> None: ...
    def log(self, message: str) -> None: ...


class Controller:
    # Heartbeats are drained in batches; a poll costs an RPC per worker, so not faster.
    POLL_INTERVAL_S = 0.5

    def __init__(self, config: JobConfig, *, storage_url: str,
                 group_factory: Callable[[int], WorkerGroup], group_error: type[Exception],
                 events: EventLog, metrics: JsonlWriter, display: Display,
                 resume_from: CheckpointInfo | None) -> None:
        self.config = config
        self.storage_url = storage_url
        self.group_factory = group_factory
        self.group_error = group_error
        self.events = events
        self.metrics = metrics
        self.display = display
        self.resume_from = resume_from
        self.policy = FailurePolicy(config.failure.max_failures)
        self.group: WorkerGroup | None = None
        self.state: State = Scheduling(generation=0)
        self.last_step = resume_from.step if resume_from else 0
        self.last_loss: float | None = None
        self.last_val_loss: float | None = None
        # Metrics windows run on the workers' clock: from the end of the step of the last
        # row (or the start of a group's first step) to the end of the current step.
        self._last_log_time: float | None = None
        self._last_step_end: float | None = None
        self._tokens_since_log = 0
        # Throughput of this invocation: all tokens over the workers' time spent in steps
        # (checkpoint waits included, start-up and recovery excluded).
        self.tokens_total = 0
        self.train_time_s = 0.0
        # (failure, step restored from, steps lost) until the first step after a recovery
        self._pending_recovery: tuple[WorkerFailure, int, int] | None = None
        self._stop_requested = False  # set by the SIGINT handler
        self._stop_sent = False
        self._started_emitted = False

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
            if self.group is not None:
                graceful = isinstance(self.state, Finished | Stopped)
                self.group.shutdown(graceful=graceful)
                self.group = None
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
        raise ValueError(f"unexpected state {state!r}")

    # ------------------------------------------------------------------ states

    def _on_scheduling(self, state: Scheduling) -> State:
        self.group = self.group_factory(state.generation)
        self.group.start()
        return Rendezvous(generation=state.generation)

    def _on_rendezvous(self, state: Rendezvous) -> State:
        assert self.group is not None
        self.group.rendezvous()
        checkpoint = self.resume_from if state.generation == 0 else newest_valid(
            self.storage_url, on_skip=self._on_damaged_checkpoint)
        return Restoring(generation=state.generation, checkpoint=checkpoint)

    def _on_restoring(self, state: Restoring) -> State:
        assert self.group is not None
        start_step = 0
        if state.checkpoint is not None:
            start_step = self.group.restore(state.checkpoint.path)
        self.last_step = start_step
        self.group.launch()
        self._last_log_time = self._last_step_end = None
        self._tokens_since_log = 0
        if not self._started_emitted:  # once, even if the first group never launched
            self._started_emitted = True
            self.events.emit("started", world_size=self.config.scaling.num_workers,
                             steps=self.config.train.steps, start_step=start_step,
                             task=self.config.task.path)
        self.events.emit("workers_started", generation=state.generation,
                         workers=self.group.describe())
        return Running(generation=state.generation, start_step=start_step)

    def _on_running(self, state: Running) -> State:
        assert self.group is not None
        if self._stop_requested and not self._stop_sent:
            self._stop_sent = True
            self.display.log("stopping after the step in flight and checkpointing it "
                             "(Ctrl-C again to abandon the checkpoint)")
            self.group.request_stop()
        time.sleep(self.POLL_INTERVAL_S)
        statuses = self.group.poll(timeout=self.config.scaling.start_timeout_s)
        self._absorb(statuses)
        if all(st.done for st in statuses):
            if any(st.stopped_early for st in statuses):
                self.events.emit("stopped", step=self.last_step)
                return Stopped(step=self.last_step)
            self.events.emit("finished", step=self.last_step, loss=self.last_loss,
                             val_loss=self.last_val_loss)
            return Finished(step=self.last_step)
        return state

    def _on_failure(self, failure: WorkerFailure) -> State:
        decision = self.policy.make_decision(failure)
        self.events.emit("failure", failure_kind=failure.kind.value, rank=failure.rank,
                         message=failure.message, step=self.last_step,
                         retry=not isinstance(decision, FailDecision))
        if isinstance(decision, FailDecision):
            return Failed(reason=f"{decision.reason}: {failure.message}")
        generation = getattr(self.state, "generation", 0)
        return Recovering(generation=generation, failure=failure)

    def _on_recovering(self, state: Recovering) -> State:
        # The skeleton's recovery: replace the whole group and restore from storage.
        self.display.log(f"recovering from: {state.failure.message.splitlines()[-1]}")
        if self.group is not None:  # None when creating the group itself failed
            self.group.shutdown(graceful=False)
            self.group = None
        restored = newest_valid(self.storage_url)
        from_step = restored.step if restored else 0
        self._pending_recovery = (state.failure, from_step, self.last_step - from_step)
        return Scheduling(generation=state.generation + 1)

    # ------------------------------------------------------------------ reports

    def _absorb(self, statuses: list[WorkerStatus]) -> None:
        for commit in statuses[0].commits:  # rank 0 commits for everyone
            self.events.emit("checkpoint_committed", step=commit.step, path=commit.path,
                             save_s=round(commit.save_s, 3))
        for report in statuses[0].steps:  # the loss is already the global mean on every rank
            self._on_step(report)

    def _on_step(self, r: StepReport) -> None:
        self.last_step, self.last_loss = r.step, r.loss
        if r.val_loss is not None:
            self.last_val_loss = r.val_loss
        if self._pending_recovery is not None:
            failure, from_step, lost = self._pending_recovery
            self._pending_recovery = None
            self.events.emit("recovered", from_step=from_step, source="storage",
                             world_size=self.config.scaling.num_workers, lost_steps=lost,
                             recovery_s=round(r.time - failure.detected_at, 3))
        if self._last_log_time is None:  # first step of a group: its window starts on its clock
            self._last_log_time = r.time - r.step_time_s
        self.train_time_s += r.time - (self._last_step_end or self._last_log_time)
        self._last_step_end = r.time
        self.tokens_total += r.tokens
        self._tokens_since_log += r.tokens
        tokens_per_s = None
        if r.step % self.config.run.log_every == 0 or r.step == self.config.train.steps \
                or r.val_loss is not None:
            elapsed = max(r.time - self._last_log_time, 1e-9)
            tokens_per_s = self._tokens_since_log / elapsed
            row: dict[str, Any] = {"step": r.step, "loss": r.loss, "lr": r.lr,
                                   "tokens_per_s": round(tokens_per_s, 1),
                                   "world_size": self.config.scaling.num_workers,
                                   "time": r.time}
            if r.val_loss is not None:
                row["val_loss"] = r.val_loss
            self.metrics.write(row)
            self._last_log_time, self._tokens_since_log = r.time, 0
        self.display.update(r, tokens_per_s)

    def _on_damaged_checkpoint(self, step: int, message: str) -> None:
        self.events.emit("checkpoint_skipped", step=step, message=message)
        self.display.log(f"skipping damaged checkpoint: {message}")
