"""The failure classifier: every WorkerFailure is built here, one function per kind of evidence.

The worker group turns what it sees (Ray's errors, the node agents' reports, a late agent)
into per-rank failures with these functions; the failure detector and the straggler reporter
turn a poll's evidence into the one failure the controller acts on; the controller names the
members that went silent as their world ended. So the kind, the ranks to replace and the
message of each failure are decided in one place. Each function is pure: the time is passed
in, and nothing is asked of the group or the cluster.

`last_seen` is the last moment the failed ranks were known to be well (a heartbeat, an
injected fault's time): detected_at - last_seen is the detection latency the log reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from stalwart.core.errors import DeviceUnhealthy
from stalwart.core.task_errors import TaskCodeError
from stalwart.orchestrator.failures import FailureKind, WorkerFailure

if TYPE_CHECKING:
    from stalwart.core.events import WorkerPlace
    from stalwart.orchestrator.health import Hang
    from stalwart.orchestrator.stragglers import Straggler


def _one(kind: FailureKind, rank: int, message: str, now: float, *,
         last_seen: float | None = None, pids: tuple[int, ...] = ()) -> WorkerFailure:
    return WorkerFailure(kind=kind, rank=rank, ranks=(rank,), message=message,
                         detected_at=now, last_seen=last_seen, pids=pids)


# ---------------------------------------------------------------------------- one rank, as the group sees it


def actor_died(rank: int | None, why: str, now: float) -> WorkerFailure:
    """Ray says the rank's actor is dead (a call to it raised Ray's actor error)."""
    return WorkerFailure(kind=FailureKind.WORKER_DIED, rank=rank,
                         ranks=() if rank is None else (rank,),
                         message=f"worker rank {rank} died: {why}".strip(), detected_at=now)


def call_failed(rank: int | None, what: str, now: float, *, kind: FailureKind) -> WorkerFailure:
    """A call to the rank raised (not a death): `kind` is what the call was for, START_ERROR
    while a world forms, COLLECTIVE_ERROR while it restores from memory."""
    return WorkerFailure(kind=kind, rank=rank, ranks=() if rank is None else (rank,),
                         message=f"worker rank {rank}: {what}".strip(), detected_at=now)


def no_answer(rank: int, timeout_s: float, now: float) -> WorkerFailure:
    """A call to the rank was not answered in time."""
    return _one(FailureKind.HANG, rank,
                f"worker rank {rank} did not answer within {timeout_s:.0f}s", now)


def poll_failed(rank: int, message: str, now: float) -> WorkerFailure:
    """The rank's poll raised Ray's error: it died (`message` says how, and names the rank)."""
    return _one(FailureKind.WORKER_DIED, rank, message, now)


def process_exited(rank: int, pid: int, alive_at: float | None, now: float) -> WorkerFailure:
    """Its node's agent saw the rank's process exit."""
    return _one(FailureKind.WORKER_DIED, rank, f"worker rank {rank} (pid {pid}) exited", now,
                last_seen=alive_at, pids=(pid,))


def process_stopped(rank: int, pid: int, since: float, now: float) -> WorkerFailure:
    """Its node's agent saw the rank's process stopped for failure.stopped_timeout_s."""
    return _one(FailureKind.HANG, rank,
                f"worker rank {rank} (pid {pid}) is stopped (SIGSTOP or a frozen process) "
                f"since {now - since:.2f}s: it cannot take part in its world", now,
                last_seen=since, pids=(pid,))


def node_gone(rank: int, node_id: str, now: float) -> WorkerFailure:
    """The rank's node is gone: its agent died and the node is not alive."""
    return _one(FailureKind.WORKER_DIED, rank, f"worker rank {rank} died: its node {node_id} "
                                               f"is gone", now)


def node_silent(rank: int, pid: int, node_id: str, late_s: float, seen_at: float,
                now: float) -> WorkerFailure:
    """The rank's node went silent: its agent is late while the other nodes' agents answer."""
    return _one(FailureKind.HANG, rank,
                f"worker rank {rank} (pid {pid}) is on node {node_id}, which stopped "
                f"answering: its agent is {late_s:.2f}s late while the other nodes' agents "
                f"answer (a frozen, powered-off or cut-off node)", now,
                last_seen=seen_at, pids=(pid,))


def warm_up_failed(cause: BaseException, now: float) -> WorkerFailure:
    """A worker's warm-up raised `cause`. A device that failed its health check is a failure
    of its node (NODE_DIED): the worker is dropped before it joins a world, and the run goes
    on without it. The task's code failing one of its phases (its model, a batch, the forward
    pass, the loss: a TaskCodeError) is an error in the task's code (USER_ERROR), named by
    the phase, with its traceback. Anything else means the task cannot load there
    (START_ERROR), which another worker would not mend."""
    if isinstance(cause, DeviceUnhealthy):
        pid = f", worker pid {cause.pid}" if cause.pid is not None else ""
        return WorkerFailure(
            kind=FailureKind.NODE_DIED, rank=None, detected_at=now,
            pids=() if cause.pid is None else (cause.pid,),
            nodes=(cause.node_ip,) if cause.node_ip else (),
            message=f"device unhealthy on node {cause.node_ip or '(unknown)'} "
                    f"({cause.device}{pid}): {'; '.join(cause.reasons)}; the worker was "
                    f"dropped before it joined a world")
    if isinstance(cause, TaskCodeError):
        return WorkerFailure(kind=FailureKind.USER_ERROR, rank=None, detected_at=now,
                             message=str(cause.where("on a worker, before training")))
    return start_error(f"a worker could not load the task: {cause}", now)


def start_error(message: str, now: float) -> WorkerFailure:
    """Workers could not be started or set up, with no rank to blame."""
    return WorkerFailure(kind=FailureKind.START_ERROR, rank=None, message=message,
                         detected_at=now)


# ---------------------------------------------------------------------------- a poll's verdict


def deaths(died: Sequence[WorkerFailure], node_ids: set[str], lost_nodes: frozenset[str],
           now: float, last_seen: float | None) -> WorkerFailure:
    """Ranks found dead in one poll (`node_ids`: their nodes): a node death when one of those
    nodes is gone, else a worker death. Every dead rank is replaced."""
    ranks = tuple(sorted({r for f in died for r in f.failed_ranks}))
    first = died[0]
    return WorkerFailure(
        kind=FailureKind.NODE_DIED if node_ids & lost_nodes else FailureKind.WORKER_DIED,
        rank=ranks[0], ranks=ranks, message=first.message if len(died) == 1 else
        f"worker ranks {list(ranks)} died (node(s) {sorted(node_ids)}): {first.message}",
        detected_at=now, last_seen=last_seen)


def stopped(found: Sequence[WorkerFailure], now: float,
            last_seen: float | None) -> WorkerFailure:
    """Ranks whose processes are stopped or whose node is silent, found in one poll."""
    ranks = tuple(sorted({r for f in found for r in f.failed_ranks}))
    return WorkerFailure(
        kind=FailureKind.HANG, rank=ranks[0], ranks=ranks,
        message=found[0].message if len(found) == 1 else
        f"worker ranks {list(ranks)} are stopped: {found[0].message}",
        detected_at=now, last_seen=last_seen)


def hang(found: Hang, now: float, last_seen: float | None,
         records: Mapping[int, str] | None = None) -> WorkerFailure:
    """No heartbeat past the hang limit: the silent ranks are replaced; when every rank
    answers but none progresses, none can be blamed. `records`: what the answering ranks'
    flight recorders say (the collective each waits in, or none), in rank order."""
    blame = () if found.answering else found.ranks
    what = ("no rank completed a step" if found.answering else
            f"worker rank(s) {list(found.ranks)} stopped answering")
    recorded = "; ".join(records[r] for r in sorted(records or {}))
    return WorkerFailure(
        kind=FailureKind.HANG, rank=blame[0] if blame else None, ranks=blame,
        message=f"hang: {what} for {found.silent_s:.1f}s (limit {found.limit_s:.1f}s = "
                f"max(failure.hang_timeout_floor_s, failure.hang_factor x median step time))"
                + (f"; flight recorder: {recorded}" if recorded else ""),
        detected_at=now, last_seen=last_seen)


def exception(rank: int, traceback: str, now: float, last_seen: float | None) -> WorkerFailure:
    """The task's code raised on this rank. It is replaced: its peers are stuck in the next
    collective waiting for it, and only its exit releases them."""
    return _one(FailureKind.USER_ERROR, rank, traceback, now, last_seen=last_seen)


def numerical(rank: int, message: str, evict: tuple[int, ...], now: float,
              last_seen: float | None) -> WorkerFailure:
    """Every rank stopped on the same numerical decision (`message`, as rank `rank` said it):
    `evict` names the ranks found faulty (FAULTY_DEVICE: replaced, their nodes excluded);
    none means the run cannot go on (NUMERICS)."""
    if evict:
        return WorkerFailure(kind=FailureKind.FAULTY_DEVICE, rank=evict[0], ranks=evict,
                             message=message, detected_at=now, last_seen=last_seen)
    return WorkerFailure(kind=FailureKind.NUMERICS, rank=None, message=message,
                         detected_at=now, last_seen=last_seen)


def collective_failed(rank: int, error: str, now: float,
                      last_seen: float | None) -> WorkerFailure:
    """A collective failed on this rank, and no dead, silent or raising rank explains it."""
    return WorkerFailure(kind=FailureKind.COLLECTIVE_ERROR, rank=None,
                         message=f"worker rank {rank}: a collective failed with no rank to "
                                 f"blame:\n{error}",
                         detected_at=now, last_seen=last_seen)


def straggler(found: Straggler, factor: float, now: float,
              last_seen: float | None) -> WorkerFailure:
    """A rank that stayed slower than its peers, to be replaced (failure.replace_stragglers)."""
    return _one(FailureKind.STRAGGLER, found.rank,
                f"rank {found.rank} took {found.ratio:.1f}x its peers' median local time per "
                f"step for {found.steps} steps (failure.straggler_factor={factor:g}, "
                f"failure.replace_stragglers=true)", now, last_seen=last_seen)


def silent_members(pids: Sequence[int], workers: Sequence[WorkerPlace],
                   now: float) -> WorkerFailure:
    """Members that did not answer at all while their world was torn down (stopped or
    dead); the group killed them."""
    ranks = tuple(w.rank for w in workers if w.pid in pids)
    return WorkerFailure(
        kind=FailureKind.HANG, rank=ranks[0] if ranks else None, ranks=ranks,
        pids=tuple(pids), detected_at=now, last_seen=None,
        message=f"worker rank(s) {list(ranks)} (pid {', '.join(map(str, pids))}) did not "
                f"answer while the world was torn down (stopped or dead); replaced")
