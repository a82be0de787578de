"""NodeAgent: one Ray actor per node. It polls the ranks on its node and watches their processes.

The driver makes one call per node per interval instead of one per rank, so its work per
interval grows with nodes, not ranks. The agent sits beside its workers, so it sees a process
exit or stop (SIGSTOP, state T) from /proc within CHECK_S: no poll timeout, no Ray health
check, and no dependence on the worker's training thread or GIL. It returns at once when it
sees one, and otherwise when the interval ends: that is what paces the driver's polls.

A rank whose last poll has not been answered is not asked again: its answer, when it comes,
goes into a later report. A poll carries the generation, so a poll left over from a world
that ended drains nothing from the next one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import ray

from stalwart.workers.reports import WorkerStatus


@dataclass(frozen=True, kw_only=True)
class NodeReport:
    """What one node has to say since its last report."""

    statuses: dict[int, WorkerStatus] = field(default_factory=dict)
    """The ranks that answered their poll."""
    errors: dict[int, str] = field(default_factory=dict)
    """Ranks whose poll failed: Ray's error (the actor died)."""
    exited: dict[int, float] = field(default_factory=dict)
    """Ranks whose process is gone (or a zombie): the last time it was seen alive."""
    stopped: dict[int, float] = field(default_factory=dict)
    """Ranks whose process has been stopped (SIGSTOP) for `stopped_for_s`: since when."""


def process_state(pid: int) -> str | None:
    """The one-letter state of a process from /proc ("R", "S", "T", "Z", ...), "gone" when it
    does not exist, None where there is no /proc to ask (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return "gone"
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces or ")": the state follows the
    # last ")".
    return stat[stat.rfind(b")") + 2:][:1].decode()


class NodeAgent:
    # /proc is read this often while a poll waits: a few microseconds per rank.
    CHECK_S = 0.02
    def __init__(self, stopped_for_s: float = 0.5) -> None:
        # A process stopped this long is reported (failure.stopped_timeout_s). Shorter stops
        # are someone pausing it on purpose and resuming it.
        self.stopped_for_s = stopped_for_s
        self.generation = -1
        self.members: dict[int, tuple[Any, int]] = {}
        self._polls: dict[int, Any] = {}
        self._alive_at: dict[int, float] = {}
        self._stopped_since: dict[int, float] = {}

    def poll(self, generation: int, wait_s: float,
             members: dict[int, tuple[Any, int]] | None = None) -> NodeReport:
        """Poll this node's ranks, watch their processes for `wait_s`, return what was seen.

        `members` (rank -> (actor, pid)) is sent with a world's first poll only.
        """
        if generation != self.generation:
            self.generation, self.members = generation, dict(members or {})
            self._polls, self._stopped_since = {}, {}
            self._alive_at = {rank: time.time() for rank in self.members}
        for rank, (actor, _) in self.members.items():
            if rank not in self._polls:
                self._polls[rank] = actor.poll.remote(generation)
        statuses: dict[int, WorkerStatus] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + wait_s
        while True:
            self._collect(statuses, errors, timeout=self.CHECK_S)
            exited, stopped = self._watch()
            if exited or stopped or errors or time.monotonic() >= deadline:
                return NodeReport(statuses=statuses, errors=errors, exited=exited,
                                  stopped=stopped)

    def _collect(self, statuses: dict[int, WorkerStatus], errors: dict[int, str], *,
                 timeout: float) -> None:
        if not self._polls:
            time.sleep(timeout)
            return
        refs = list(self._polls.values())
        ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout)[0])
        for rank, ref in list(self._polls.items()):
            if ref not in ready:
                continue
            del self._polls[rank]
            try:
                status = ray.get(ref)
            except Exception as exc:  # the worker died: Ray says how
                errors[rank] = f"worker rank {rank} died: {exc}".strip()
                continue
            if status.generation == self.generation:
                statuses[rank] = status

    def _watch(self) -> tuple[dict[int, float], dict[int, float]]:
        """Ranks whose process is gone, and ranks stopped for `stopped_for_s`."""
        now = time.time()
        exited, stopped = {}, {}
        for rank, (_, pid) in self.members.items():
            state = process_state(pid)
            if state in ("gone", "Z", "X"):
                exited[rank] = self._alive_at[rank]
                continue
            self._alive_at[rank] = now
            if state == "T":
                since = self._stopped_since.setdefault(rank, now)
                if now - since >= self.stopped_for_s:
                    stopped[rank] = since
            else:
                self._stopped_since.pop(rank, None)
        return exited, stopped
