"""Accounts kept from the workers' step reports: throughput windows and recovery phases.

Throughput writes metrics.jsonl's rows (tokens/s over a window of steps, timed on the
workers' clock), keeps the steps a world ended with after its last row (`kept_unlogged`),
and the invocation's totals (tokens_total over train_time_s). RecoveryTimer times each
phase of a recovery, from the failure to the first step after it: the `recovered` event.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from stalwart.core import events as ev
from stalwart.orchestrator.observers import ControllerObserver

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig
    from stalwart.core.run_logs import EventLog, MetricsLog
    from stalwart.orchestrator.failures import WorkerFailure
    from stalwart.orchestrator.observers import Display, Restored
    from stalwart.workers.reports import StepReport


class Throughput(ControllerObserver):
    def __init__(self, config: JobConfig, metrics: MetricsLog, display: Display) -> None:
        self.log_every = config.run.log_every
        self.steps = config.train.steps
        self.metrics = metrics
        self.display = display
        self.world_size = 0
        # Metrics windows run on the workers' clock: from the end of the step of the last
        # row (or the start of a world's first step) to the end of the current step.
        self._last_log_time: float | None = None
        self.last_step_end: float | None = None
        self._tokens_since_log = 0
        self._wait_since_log = 0.0
        # End time of each step since the last row: the next row's steps_in_window, and the
        # unlogged steps a world ends with, whose time is reported when they are known to be
        # kept (kept_unlogged; stalwart report counts it as productive time).
        self._unlogged_ends: dict[int, float] = {}
        # Throughput of this invocation: all tokens over the workers' time spent in steps
        # (checkpoint waits included, start-up and recovery excluded).
        self.tokens_total = 0
        self.train_time_s = 0.0

    def after_launch(self, generation: int, world_size: int, now: float) -> None:
        self.world_size = world_size
        self._last_log_time = self.last_step_end = None
        self._tokens_since_log, self._unlogged_ends = 0, {}
        self._wait_since_log = 0.0

    def on_step(self, r: StepReport) -> None:
        if self._last_log_time is None:  # first step of a world: its window starts on its clock
            self._last_log_time = r.time - r.step_time_s
        self.train_time_s += r.time - (self.last_step_end or self._last_log_time)
        self.last_step_end = self._unlogged_ends[r.step] = r.time
        self.tokens_total += r.tokens
        self._tokens_since_log += r.tokens
        self._wait_since_log += r.data_wait_s
        tokens_per_s = None
        if r.step % self.log_every == 0 or r.step == self.steps or r.val_loss is not None:
            elapsed = max(r.time - self._last_log_time, 1e-9)
            tokens_per_s = self._tokens_since_log / elapsed
            self.metrics.write(ev.MetricsRow(
                step=r.step, loss=r.loss, lr=r.lr, tokens_per_s=round(tokens_per_s, 1),
                world_size=self.world_size, samples_seen=r.samples_seen, time=r.time,
                window_s=round(elapsed, 6), steps_in_window=len(self._unlogged_ends),
                val_loss=r.val_loss, data_wait_s=round(self._wait_since_log, 6),
                grad_bytes=r.grad_bytes, task_metrics=r.metrics))
            self._last_log_time, self._tokens_since_log = r.time, 0
            self._wait_since_log = 0.0
            self._unlogged_ends = {}
        self.display.update(r, tokens_per_s)

    def kept_unlogged(self, kept_up_to: int) -> ev.KeptUnlogged | None:
        """The steps of the world that just ended after its last metrics row, up to the step
        the run goes on from, and their seconds on the workers' clock (a row's window, for
        steps that got no row); None if there are none."""
        kept = [s for s in self._unlogged_ends if s <= kept_up_to]
        if not kept or self._last_log_time is None:
            return None
        return ev.KeptUnlogged(
            first_step=min(kept), last_step=max(kept),
            window_s=round(self._unlogged_ends[max(kept)] - self._last_log_time, 6))


# Seconds spent in each phase: detect (failure -> noticed), teardown (kill the failed,
# survivors leave), wait (warm workers), join (process group, model), restore (checkpoint
# load), first_step. Each is named by the mark that ends it.
PHASE_NAMES = {"detected": "detect", "left": "teardown", "scheduled": "wait", "joined": "join",
               "restored": "restore", "first_step": "first_step"}


class RecoveryTimer(ControllerObserver):
    def __init__(self, events: EventLog) -> None:
        self.events = events
        # the controller's time at each phase of the recovery in flight
        self._phases: dict[str, float] = {}
        self._recovering_from: WorkerFailure | None = None
        self._failure_steps: list[int] = []  # engine steps of the survivors of a failure
        # (failure, step restored from, steps lost) until the first step after a recovery
        self._pending: tuple[WorkerFailure, int, int] | None = None
        self._restored: Restored | None = None  # the newest world's restore

    def before_recovery(self, failure: WorkerFailure) -> None:
        self._phases = {"detected": failure.detected_at}
        self._recovering_from = failure

    def after_recovery_teardown(self, survivor_steps: list[int], now: float) -> None:
        self._failure_steps = survivor_steps
        self._phases["left"] = now

    def before_form(self, generation: int, now: float) -> None:
        self._phases["scheduled"] = now

    def after_form(self, generation: int, workers: list[dict], now: float) -> None:
        self._phases["joined"] = now

    def after_restore(self, restored: Restored, now: float) -> None:
        if self._recovering_from is not None:
            failure, self._recovering_from = self._recovering_from, None
            done = max([restored.last_step, *self._failure_steps])
            self._pending = (failure, restored.start_step,
                             max(0, done - restored.start_step))
        self._restored = restored
        self._phases["restored"] = now

    def on_step(self, r: StepReport) -> None:
        if self._pending is None or self._restored is None:
            return
        (failure, from_step, lost), restored = self._pending, self._restored
        self._pending = None
        since = failure.last_seen or failure.detected_at
        marks = [("detect", since), *self._phases.items(), ("first_step", r.time)]
        phases = {PHASE_NAMES[b[0]]: round(b[1] - a[1], 3)
                  for a, b in itertools.pairwise(marks) if b[0] in PHASE_NAMES}
        self.events.emit(ev.Recovered(
            from_step=from_step, source=restored.source,
            peer_fetches=restored.peer_fetches, world_size=restored.world_size,
            lost_steps=lost, recovery_s=round(r.time - since, 3), phases=phases,
            generation=restored.generation))
