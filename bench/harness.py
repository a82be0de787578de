"""The fault harness of the recovery, goodput, chaos and driver-loss benchmarks: launch a run,
watch its step log, signal a process once a step is logged, time the next world's first step."""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import subprocess
import time
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, NamedTuple

from bench.common import ROOT, child_env
from stalwart.core import events as ev
from stalwart.core.events import read_jsonl

OUTSIDE_KILL = "outside-kill"  # the fault the harness sends from outside, as a user or kernel
POLL_S = 0.05  # how often a step log is read: the kill lands within a step or two


class StepRow(NamedTuple):
    step: int
    time: float  # the step's end: time.time(), one machine's clock, same in every process
    world: Hashable


class Launch:
    """A command in a session of its own (a group kill reaches all it started), output to log."""

    def __init__(self, cmd: list[str], log: Path, *, env: dict[str, str] | None = None,
                 cwd: Path = ROOT) -> None:
        with log.open("a") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            self.time = time.time()  # the launch: a run's wall clock starts here
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                                         env=env or child_env(), start_new_session=True)

    def running(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole session: a stuck run must not outlive its bench."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, sig: int, timeout: float = 120.0) -> int:
        """Stop with sig (SIGINT: Ctrl-C, SIGTERM: preemption), SIGKILL past timeout."""
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return self.proc.returncode


def run_watched(cmd: list[str], log: Path, timeout: float, tick: Callable[[], None] = lambda: None,
                poll_s: float = 0.2) -> tuple[int, float]:
    """Run cmd, tick() every poll_s: (exit code, wall s); past timeout Ctrl-C x2, SIGKILL: -1."""
    t0 = time.perf_counter()
    run = Launch(cmd, log)
    deadline, stage = t0 + timeout, 0
    while run.running():
        tick()
        if time.perf_counter() > deadline:
            with log.open("a") as f:
                f.write(f"\n[bench] timed out after {timeout:.0f}s (stage {stage})\n")
            if stage == 2:
                run.kill()
                break
            run.proc.send_signal(signal.SIGINT)
            deadline, stage = time.perf_counter() + 30, stage + 1
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.proc.wait(timeout=poll_s)  # returns as soon as the run ends
    return (run.proc.returncode if stage == 0 else -1), time.perf_counter() - t0


class SignalAtStep:
    """tick() every poll: once `logged_step()` reaches `after_step`, SIGKILL `pid()` once and
    record when (the clock read just before the signal), the pid and the step logged."""

    def __init__(self, *, after_step: int, logged_step: Callable[[], int | None],
                 pid: Callable[[], int | None]) -> None:
        self.after_step, self.logged_step, self.pid = after_step, logged_step, pid
        self.time: float | None = None
        self.sent_to: int | None = None
        self.step_logged: int | None = None
        self.error: str | None = None

    @property
    def done(self) -> bool:
        return self.time is not None or self.error is not None

    def tick(self) -> None:
        if (self.done or (step := self.logged_step()) is None or step < self.after_step
                or (pid := self.pid()) is None):
            return
        now = time.time()
        if not signal_pid(pid, signal.SIGKILL):
            self.error = f"process {pid} was gone when step {step} was logged"
            return
        self.time, self.sent_to, self.step_logged = now, pid, step

    def record(self) -> dict[str, Any]:
        return {"kill_time": self.time, "killed_pid": self.sent_to,
                "kill_after_step_logged": self.step_logged, "kill_error": self.error}


def measure_kill(rows: list[StepRow], kill_time: float | None) -> dict[str, Any]:
    """kill -> the first step of another world than the one of the last step before the kill
    (its step in flight may end just after); lost_steps: its last step - the step resumed from;
    normal_step_s: the median gap of its consecutive steps before the kill."""
    out: dict[str, Any] = {"steps_before_kill": None, "last_step_of_killed_world": None,
                           "first_step_after": None, "recovery_s": None,
                           "resumed_from": None, "lost_steps": None, "normal_step_s": None,
                           "final_step": max((r.step for r in rows), default=0)}
    before = sorted((r for r in rows if kill_time is not None and r.time <= kill_time),
                    key=lambda r: r.time)
    if not before:
        return out
    killed = before[-1].world
    out["steps_before_kill"] = max(r.step for r in before)
    out["last_step_of_killed_world"] = max(r.step for r in rows if r.world == killed)
    own = [r for r in before if r.world == killed]
    gaps = [b.time - a.time for a, b in zip(own, own[1:], strict=False) if b.step == a.step + 1]
    out["normal_step_s"] = statistics.median(gaps) if gaps else None
    if after := [r for r in rows if r.world != killed and r.time > kill_time]:
        first = min(after, key=lambda r: r.time)
        out.update(first_step_after=first.step, recovery_s=first.time - kill_time,
                   resumed_from=first.step - 1,
                   lost_steps=out["last_step_of_killed_world"] - (first.step - 1))
    return out


def split_worlds(rows: list[tuple[int, float]], world_starts: list[float]) -> list[StepRow]:
    """Rows without a world id, each given as world the count of world_starts before it."""
    return [StepRow(step, t, sum(1 for s in world_starts if s <= t)) for step, t in rows]


def stalwart_steps(run_dir: Path) -> list[StepRow]:
    """A stalwart run's step log: metrics.jsonl, split into worlds at each `workers_started`."""
    events = ev.read_events(run_dir / "events.jsonl")
    return split_worlds([(r.step, r.time) for r in ev.read_metrics(run_dir / "metrics.jsonl")],
                        [e.time for e in events if isinstance(e, ev.WorkersStarted)])


def last_logged(path: Path) -> int | None:
    """The highest step of a step log so far (None before the first)."""
    return max((r["step"] for r in read_jsonl(path)), default=None)


def attempts_pid(path: Path, rank: int, event: str = "start") -> int | None:
    """The pid of `rank` in a peer's newest attempt that logged `event` (not while stopping)."""
    rows = [a for a in read_jsonl(path) if a["event"] == event and a["rank"] == rank
            and not a.get("stopping")]
    return rows[-1]["pid"] if rows else None


def stalwart_rank_pid(run_dir: Path, rank: int) -> int | None:
    """The pid of `rank` in a stalwart run's newest world (its last `workers_started`)."""
    started = [e for e in ev.read_events(run_dir / "events.jsonl")
               if isinstance(e, ev.WorkersStarted)]
    return next((w.pid for w in started[-1].workers if w.rank == rank), None) if started else None


def local_cluster(nodes: int, **head: Any) -> Any:
    """A local ray.cluster_utils.Cluster: a head (`head`: its args) and `nodes` 1-CPU nodes."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"include_dashboard": False, **head})
    for _ in range(nodes):
        cluster.add_node(num_cpus=1)
    if nodes:
        cluster.wait_for_nodes()
    return cluster


def replace_dead_node(cluster: Any, node_id: str, record: dict[str, Any]) -> None:
    """Once the GCS reports node_id dead, add one 1-CPU node; record dead/added times."""
    import ray

    if "replacement_added" not in record and any(
            n["NodeID"] == node_id and not n["Alive"] for n in ray.nodes()):
        record["dead_time"] = time.time()
        cluster.add_node(num_cpus=1)
        record["replacement_added"] = time.time()


def node_times(record: dict[str, Any], fault_time: float) -> dict[str, Any]:
    """A replace_dead_node record in seconds after the fault."""
    at = {k: record[k] - fault_time for k in ("dead_time", "replacement_added") if k in record}
    return {"replace_node_after": "dead", "node_dead_s": at.get("dead_time"),
            "replacement_added_s": at.get("replacement_added")}


def signal_pid(pid: int, sig: int) -> bool:
    """Send sig; False when the process is gone already."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def pid_alive(pid: int) -> bool:
    from stalwart.workers.node_agent import process_state

    return process_state(pid) not in ("gone", "Z")


def _proc_table() -> dict[int, tuple[int, int, str, str]]:
    """pid -> (parent pid, start time in clock ticks, command name, state) of every process."""
    out = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            name, rest = Path(f"/proc/{entry}/stat").read_text().split("(", 1)[1].rsplit(")", 1)
            fields = rest.split()  # the name may hold spaces or ")"
            out[int(entry)] = (int(fields[1]), int(fields[19]), name, fields[0])
    return out


def descendants(root: int) -> dict[int, tuple[int, str]]:
    """pid -> (start time, name) of every process below root (the root included)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, *_) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = {}, [root]
    while todo:
        pid = todo.pop()
        if pid in table and pid not in found:
            found[pid] = (table[pid][1], table[pid][2])
            todo.extend(children.get(pid, []))
    return found


def survivors(tree: dict[int, tuple[int, str]]) -> list[int]:
    """The tree's processes still alive (same pid and start time) and not zombies."""
    table = _proc_table()
    return [pid for pid, (start, _) in tree.items()
            if pid in table and table[pid][1] == start and table[pid][3] != "Z"]


def kill_tree(pgid: int, wait_s: float = 10.0) -> list[str]:
    """SIGKILL a process group, then whatever its leader had started (a daemon that left the
    group) that is alive `wait_s` later; returns those, as 'name:pid'."""
    tree = descendants(pgid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    left: list[int] = []
    # A SIGKILL lands asynchronously: the leftovers are gone before the caller goes on.
    for wait, poll in ((wait_s, 0.2), (5.0, 0.05)):
        deadline = time.monotonic() + wait
        while survivors(tree) and time.monotonic() < deadline:
            time.sleep(poll)
        if not left:
            left = survivors(tree)
            for pid in left:
                signal_pid(pid, signal.SIGKILL)
    return [f"{tree[pid][1]}:{pid}" for pid in left]
