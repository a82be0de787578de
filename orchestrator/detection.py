"""Finding the failure to act on in a poll's answers: deaths, hangs, exceptions, collectives.

An observer of the controller (it keeps the hang detector's heartbeats) that the controller
asks once per poll. A dead rank outranks a stopped one (its node's agent saw it in /proc),
which outranks a silent one, which outranks an exception, which outranks a failed collective
(that is a symptom of the others).

It is pure: it is given what the poll said (orchestrator/group.py's PollView, the group's
word on which nodes are gone), the time, and when the ranks were last seen well (LastSeen),
and returns the failure as data, built by the classifier.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stalwart.orchestrator import classify
from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.orchestrator.health import HangDetector
from stalwart.orchestrator.observers import ControllerObserver

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig
    from stalwart.core.events import WorkerPlace
    from stalwart.orchestrator.group import PollView
    from stalwart.workers.reports import StepReport, WorkerStatus


@dataclass(frozen=True, kw_only=True)
class LastSeen:
    """When ranks were last known to be well, as the controller knows it at a poll: the
    moment a failure began, which bounds its detection latency."""

    fault_times: Mapping[int, float] = field(default_factory=dict)
    """Rank -> when an injected fault hit it in this world: the fault's own time wins."""
    last_step_end: float | None = None
    """The end of the newest step, when nothing closer is known."""

    def at(self, ranks: tuple[int, ...], heartbeat: float | None = None) -> float | None:
        """An injected fault's time, else the ranks' last heartbeat, else the newest step's end."""
        fired = [self.fault_times[r] for r in ranks if r in self.fault_times]
        if fired:
            return max(fired)
        return heartbeat if heartbeat is not None else self.last_step_end


class FailureDetector(ControllerObserver):
    def __init__(self, config: JobConfig, *, collective_grace_s: float) -> None:
        fc = config.failure
        self.hangs = HangDetector(floor_s=fc.hang_timeout_floor_s, factor=fc.hang_factor,
                                  start_timeout_s=config.scaling.start_timeout_s)
        # A failed collective means some peer failed: give its death this long to show up,
        # so the rank that died is blamed (and replaced) rather than the ranks that noticed.
        self.collective_grace_s = collective_grace_s
        self.workers: list[WorkerPlace] = []
        self._collective_error_since: float | None = None

    def after_form(self, generation: int, workers: list[WorkerPlace], now: float) -> None:
        self.workers = workers

    def after_launch(self, generation: int, world_size: int, now: float) -> None:
        self.hangs.reset(range(world_size), now)
        self._collective_error_since = None

    def on_step(self, report: StepReport) -> None:
        self.hangs.step_time(report.step_time_s)

    def on_status(self, rank: int, status: WorkerStatus, now: float) -> None:
        self.hangs.answered(rank, now, progressed=bool(status.steps or status.commits),
                            busy=status.busy is not None)
        if status.done:
            self.hangs.finished(rank)  # done ranks wait for their peers: not a stall

    def find(self, poll: PollView, now: float, seen: LastSeen) -> WorkerFailure | None:
        """The failure to act on in what one poll said, if any."""
        dead = list(poll.dead)
        died = [f for f in dead if f.kind != FailureKind.HANG]
        if died:
            ranks = tuple(sorted({r for f in died for r in f.failed_ranks}))
            node_ids = {self.workers[r].node_id for r in ranks if r < len(self.workers)}
            return classify.deaths(died, node_ids, poll.lost_nodes, now,
                                   seen.at(ranks, _newest_seen(died)))
        if dead:  # stopped processes, seen by their node's agent
            ranks = tuple(sorted({r for f in dead for r in f.failed_ranks}))
            return classify.stopped(dead, now, seen.at(ranks, _newest_seen(dead)))
        hang = self.hangs.check(now)
        if hang is not None:
            records = {r: st.flight_record for r, st in poll.answered.items()
                       if st.flight_record is not None}
            return classify.hang(hang, now, seen.at(hang.ranks, hang.last_heartbeat), records)
        errors = {r: st for r, st in poll.answered.items() if st.error is not None}
        numerical = {r: st for r, st in errors.items() if st.error_kind == "numerics"}
        if numerical:  # every rank took the same decision: rank 0's (or the lowest's) says it
            rank, st = min(numerical.items())
            return classify.numerical(rank, st.error or "", st.evict, now,
                                      seen.at(st.evict or (rank,)))
        user = {r: st for r, st in errors.items() if st.error_kind != "collective"}
        if user:
            rank, st = min(user.items())
            return classify.exception(rank, st.error or "", now, seen.at((rank,)))
        if errors:
            self._collective_error_since = self._collective_error_since or now
            if now - self._collective_error_since >= self.collective_grace_s:
                rank, st = min(errors.items())
                return classify.collective_failed(rank, st.error or "", now, seen.at(()))
        return None


def _newest_seen(failures: list[WorkerFailure]) -> float | None:
    """The last moment any of these ranks was seen well, when their reports say."""
    seen = [f.last_seen for f in failures if f.last_seen is not None]
    return max(seen) if seen else None
