"""NodeAgent: one Ray actor per node. It polls the ranks on its node and watches their processes.

The driver makes one call per node per interval instead of one per rank, so its work per
interval grows with nodes, not ranks. The agent sits beside its workers, so it sees a process
exit or stop (SIGSTOP, state T) itself: no poll timeout, no Ray health check, and no
dependence on the worker's training thread or GIL. It returns at once when it sees one, and
otherwise when the interval ends: that is what paces the driver's polls.

An exit wakes the agent at once through a pidfd per process (Linux 5.3+), so between checks
it sleeps and costs no CPU; a stop is read from /proc every CHECK_S (at most a fifth of
`stopped_for_s`). Without pidfds the agent reads /proc every FALLBACK_CHECK_S instead.

A rank's poll is answered at once, so a collective that fails after it would wait for the
next interval. Instead the rank leaves a marker file (`mark_failed`), which the agent looks for
at each check: it polls that rank again and answers at once. A failed collective is news: a
peer, or its whole node, may be gone. Other errors wait for the interval, with the other
ranks' reports (the steps a stopping world trained before one rank raised).

A rank whose last poll has not been answered is not asked again: its answer, when it comes,
goes into a later report. A poll carries the generation, so a poll left over from a world
that ended drains nothing from the next one.
"""

from __future__ import annotations

import contextlib
import os
import select
import tempfile
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


def failed_marker(pid: int) -> str:
    """The file that says the training thread of process `pid` has failed."""
    return os.path.join(tempfile.gettempdir(), f"stalwart-failed-{pid}")


def mark_failed() -> None:
    """Tell this node's agent that this process's training thread has failed."""
    with contextlib.suppress(OSError):
        open(failed_marker(os.getpid()), "w").close()


def take_failed_mark(pid: int) -> bool:
    """Whether process `pid` marked a failure since the last look (the mark is removed)."""
    try:
        os.unlink(failed_marker(pid))
    except OSError:
        return False
    return True


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


def collect_polls(polls: dict[int, Any], generation: int, *, timeout: float
                  ) -> tuple[dict[int, WorkerStatus], dict[int, str]]:
    """Take the polls that answered within `timeout` out of `polls` (rank -> ObjectRef):
    the statuses of `generation` (a leftover answer of an ended world is dropped), and the
    ranks whose poll failed, with Ray's error (the worker died)."""
    statuses: dict[int, WorkerStatus] = {}
    errors: dict[int, str] = {}
    if not polls:
        return statuses, errors
    refs = list(polls.values())
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=timeout)[0])
    for rank, ref in list(polls.items()):
        if ref not in ready:
            continue
        del polls[rank]
        try:
            status = ray.get(ref)
        except Exception as exc:  # the worker died: Ray says how
            errors[rank] = f"worker rank {rank} died: {exc}".strip()
            continue
        if status.generation == generation:
            statuses[rank] = status
    return statuses, errors


class NodeAgent:
    # A stop is looked for this often, or five times per `stopped_for_s` if that is more
    # (an exit wakes the agent at once). Each check wakes this process: at 50 a second the
    # checks cost it 2% of a core, taken from training on a small machine.
    CHECK_S = 0.1
    # Without pidfds an exit is seen only by a check: checks this often then.
    FALLBACK_CHECK_S = 0.02

    def __init__(self, stopped_for_s: float = 0.5) -> None:
        # A process stopped this long is reported (failure.stopped_timeout_s). Shorter stops
        # are someone pausing it on purpose and resuming it.
        self.stopped_for_s = stopped_for_s
        self.generation = -1
        self.members: dict[int, tuple[Any, int]] = {}
        self._polls: dict[int, Any] = {}
        self._alive_at: dict[int, float] = {}
        self._stopped_since: dict[int, float] = {}
        self._pidfds: dict[int, int] = {}
        """rank -> a pidfd of its process, readable once the process has exited."""

    def poll(self, generation: int, wait_s: float,
             members: dict[int, tuple[Any, int]] | None = None) -> NodeReport:
        """Poll this node's ranks, watch their processes for `wait_s`, return what was seen.

        `members` (rank -> (actor, pid)) is sent with a world's first poll only.
        """
        if generation != self.generation:
            self.generation, self.members = generation, dict(members or {})
            self._polls, self._stopped_since = {}, {}
            self._alive_at = {rank: time.time() for rank in self.members}
            self._open_pidfds()
        for rank, (actor, _) in self.members.items():
            if rank not in self._polls:
                self._polls[rank] = actor.poll.remote(generation)
        statuses: dict[int, WorkerStatus] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + wait_s
        check_s = (min(self.CHECK_S, self.stopped_for_s / 5) if self._pidfds
                   else self.FALLBACK_CHECK_S)
        while True:
            timeout = max(0.0, min(check_s, deadline - time.monotonic()))
            if self._polls:  # a dead rank's poll fails, which ends this wait too
                self._collect(statuses, errors, timeout=timeout)
            else:
                self._sleep_until_an_exit(timeout)
            exited, stopped = self._watch()
            if self._repoll_failed(generation):
                continue
            failed = any(st.error is not None for st in statuses.values())
            if exited or stopped or errors or failed or time.monotonic() >= deadline:
                return NodeReport(statuses=statuses, errors=errors, exited=exited,
                                  stopped=stopped)

    def close(self) -> None:
        """Close the pidfds (an agent that runs in the driver outlives its runs' worlds)."""
        for fd in self._pidfds.values():
            os.close(fd)
        self._pidfds = {}

    def _open_pidfds(self) -> None:
        """A pidfd for each member's process (closing the last world's)."""
        self.close()
        if not hasattr(os, "pidfd_open"):
            return
        for rank, (_, pid) in self.members.items():
            try:
                self._pidfds[rank] = os.pidfd_open(pid)
            except ProcessLookupError:
                continue  # gone already: /proc says so at the first check
            except OSError:  # no pidfds here (an old kernel, a sandbox): checks find exits
                for fd in self._pidfds.values():
                    os.close(fd)
                self._pidfds = {}
                return

    def _sleep_until_an_exit(self, timeout: float) -> bool:
        """Sleep up to `timeout`, waking at once when a member's process exits (True)."""
        if self._pidfds:
            return bool(select.select(list(self._pidfds.values()), [], [], timeout)[0])
        time.sleep(timeout)
        return False

    def _collect(self, statuses: dict[int, WorkerStatus], errors: dict[int, str], *,
                 timeout: float) -> None:
        answered, failed = collect_polls(self._polls, self.generation, timeout=timeout)
        statuses.update(answered)
        errors.update(failed)

    def _repoll_failed(self, generation: int) -> bool:
        """Poll again the ranks that marked a failure since their poll was answered."""
        again = False
        for rank, (actor, pid) in self.members.items():
            if rank not in self._polls and take_failed_mark(pid):
                self._polls[rank] = actor.poll.remote(generation)
                again = True
        return again

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
