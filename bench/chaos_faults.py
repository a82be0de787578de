"""The chaos soak's faults: which ones a run gets (from one seed), and firing them from outside.

A plan is drawn up front from one `random.Random(seed)` for every run of the soak, so run k
of a soak gets the same layout and faults whether it runs in one invocation or in a chunk
(`--first-run k`). Wall-clock moments are drawn as fractions of the layout's training window
(measured on its failure-free reference run), so one plan fits any machine speed.

Firing is from outside the run, as an operator or the kernel would: signals to a worker's
process (found by the pid its run recorded in `workers_started`), and SIGKILL of the whole
driver process group (`stalwart run` is started with start_new_session=True) plus any process
the driver started that survived it.
"""

from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from stalwart.core import events as ev
from stalwart.core.events import read_events

WORKER_SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
KINDS = (*WORKER_SIGNALS, "driver")
MIN_FAULTS, MAX_FAULTS = 2, 4
MIN_GAP = 0.04
"""Smallest distance between two faults of a run, as a fraction of the training window."""


@dataclass(frozen=True, kw_only=True)
class PlannedFault:
    kind: str
    """kill, stop, term (a signal to a worker process) or driver (SIGKILL of the driver and
    everything it started, then `--resume`)."""
    at: float
    """When, as a fraction of the layout's failure-free training window (0: its first step;
    1: its last)."""
    pick: float
    """In [0, 1): which of the live workers is hit, by index into them in rank order."""


@dataclass(frozen=True, kw_only=True)
class RunPlan:
    index: int
    layout: str
    faults: tuple[PlannedFault, ...]


def plan_soak(seed: int, runs: int, layouts: list[str]) -> list[RunPlan]:
    """Every run's layout and faults, all from one random.Random(seed)."""
    rng = random.Random(seed)
    plans = []
    for index in range(runs):
        layout = rng.choice(layouts)
        n = rng.randint(MIN_FAULTS, MAX_FAULTS)
        kinds = [rng.choice(KINDS) for _ in range(n)]
        plans.append(RunPlan(index=index, layout=layout,
                             faults=tuple(PlannedFault(kind=k, at=a, pick=rng.random())
                                          for k, a in zip(kinds, _moments(rng, n), strict=True))))
    return plans


def _moments(rng: random.Random, n: int) -> list[float]:
    """n sorted moments in [0, 0.9], at least MIN_GAP apart (the last tenth of the window is
    left out: a fault there would mostly land after the end)."""
    while True:
        at = sorted(round(rng.uniform(0.0, 0.9), 4) for _ in range(n))
        if all(b - a >= MIN_GAP for a, b in zip(at, at[1:], strict=False)):
            return at


# ---------------------------------------------------------------------------------- workers


def invocation_events(run_dir: Path, skip: int) -> list[ev.Event]:
    """The events of run_dir written after the first `skip` (those of earlier invocations)."""
    path = run_dir / "events.jsonl"
    return read_events(path)[skip:] if path.exists() else []


def live_workers(events: list[ev.Event], exclude: set[int]) -> list[ev.WorkerPlace]:
    """The newest world's workers whose process is alive, in rank order, without `exclude`
    (processes already hit: a second SIGSTOP of a stopped process is no fault)."""
    started = [e for e in events if isinstance(e, ev.WorkersStarted)]
    if not started:
        return []
    return [w for w in started[-1].workers if w.pid not in exclude and pid_alive(w.pid)]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def signal_worker(pid: int, kind: str) -> bool:
    """Send the kind's signal; False when the process is gone already."""
    try:
        os.kill(pid, WORKER_SIGNALS[kind])
    except ProcessLookupError:
        return False
    return True


# ---------------------------------------------------------------------------------- driver


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, start time in clock ticks, command name) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        out[int(entry)] = (int(fields[1]), int(fields[19]), name)
    return out


def descendants(root: int) -> dict[int, tuple[int, str]]:
    """pid -> (start time, name) of every process below root (the root included)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in found:
            found[pid] = (table[pid][1], table[pid][2])
            todo.extend(children.get(pid, []))
    return found


def kill_driver(pgid: int, wait_s: float = 10.0) -> list[str]:
    """SIGKILL the driver's process group; then SIGKILL every process the driver had started
    (its descendants just before the kill, matched by pid and start time, so a reused pid is
    never hit) that is still alive `wait_s` later. Returns those survivors, as 'name:pid'."""
    tree = descendants(pgid)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if not _survivors(tree):
            return []
        time.sleep(0.2)
    left = _survivors(tree)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    # A SIGKILL lands asynchronously: gone before the resume starts, not a moment after.
    deadline = time.monotonic() + 5.0
    while _survivors(tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [f"{tree[pid][1]}:{pid}" for pid in left]


def _survivors(tree: dict[int, tuple[int, str]]) -> list[int]:
    table = _proc_table()
    return [pid for pid, (start, _) in tree.items()
            if pid in table and table[pid][1] == start and not _is_zombie(pid)]
