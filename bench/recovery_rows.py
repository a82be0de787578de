"""The recovery benchmark's scenario and rows (bench/recovery.py): each row is one run on its own
Ray (stalwart's CLI, Ray Train and torchrun through bench/peers/), measured from its records."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import statistics
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from bench import common, harness
from bench.harness import OUTSIDE_KILL, POLL_S, SignalAtStep, StepRow, measure_kill
from bench.peers import raytrain_worker, torchrun_recovery
from bench.peers.raytrain_recovery import run_raytrain
from stalwart.core import events as ev
from stalwart.core.events import read_events, read_jsonl, read_metrics

FAULTS = ("kill", "hang", "node", "freeze", OUTSIDE_KILL)
NODE_FAULTS = ("node", "freeze")  # on a multi-node cluster: a node is lost or frozen
WORKERS, STEPS, FAULT_STEP, PERSIST_EVERY = 2, 40, 25, 10
HANG_WAIT_S = 60.0
TARGET_KILL_RATIO = 10.0
TARGET_HANG_DETECTION_S = 10.0
TARGET_FREEZE_DETECTION_S = 1.0
TARGET_NEXT_STEP_SLACK_S = 0.25
# The first step after an outside kill (its restored step staged, a new world's first
# iteration) against a normal step of the same run.
TARGET_FIRST_STEP_RATIO = 1.2
TARGET_OUTSIDE_RATIOS = {"ray-train": 20.0, "torchrun": 10.0}
# A lost node: fault -> the next completed step within this much more than a normal step.
TARGET_NODE_SLACK_S = {"stalwart-elastic": 2.0, "stalwart-elastic+spare": 1.0}
# Node faults run on one 1-CPU node per worker plus one: the room a replacement (or a spare)
# finds on another node, as on a real cluster with a free machine.
NODE_WORKER_NODES = WORKERS + 1

RUN = [f"train.steps={STEPS}", f"checkpoint.persist_every={PERSIST_EVERY}", "run.log_every=1",
       "data.val_every=0", "run.progress=false", "failure.max_failures=3",
       f"scaling.num_workers={WORKERS}"]
STALWART_OVERRIDES = [*common.TINY, *RUN]
SPARE = ["scaling.spare_workers=1"]
NO_SPARE = ["scaling.spare_workers=0"]  # whatever the config says
ELASTIC = ["scaling.min_workers=1", "scaling.resize_check_s=2", "scaling.spare_workers=0"]
ELASTIC_SPARE = [*ELASTIC[:-1], "scaling.spare_workers=1", "scaling.placement_strategy=SPREAD"]
STORAGE_ONLY = ["checkpoint.snapshot_every=0"]  # the in-memory tier off
OUTSIDE_STALWART = [*RUN, *SPARE]  # outside-kill: the reference config's own model, every side
INJECT = {"kill": f"kill:rank=1,step={FAULT_STEP}", "hang": f"hang:rank=1,step={FAULT_STEP}",
          "node": f"kill-node:node=2,step={FAULT_STEP}",
          "freeze": f"freeze-node:node=2,step={FAULT_STEP}"}
# (runner, label) per fault, in the order of a round.
RUNNERS = {
    "kill": [("stalwart", "stalwart"), ("stalwart+spare", "stalwart + warm spare"),
             ("stalwart+spare/storage", "stalwart + spare, storage"), ("ray-train", "Ray Train")],
    "hang": [("stalwart", "stalwart"), ("stalwart+spare", "stalwart + warm spare"),
             ("ray-train", "Ray Train")],
    "node": [("stalwart-elastic", "stalwart (shrink)"),
             ("stalwart-elastic+spare", "stalwart + spare on another node"),
             ("stalwart-elastic/storage", "stalwart (shrink), storage"),
             ("ray-train", "Ray Train")],
    # stalwart only: Ray Train has no freeze of its own; it waits for Ray's node health check
    # (tens of seconds) as it does for a lost node.
    "freeze": [("stalwart-elastic", "stalwart (shrink)")],
    OUTSIDE_KILL: [("stalwart+spare", "stalwart (memory tier, spare)"),
                   ("ray-train", "Ray Train"), ("torchrun", "torchrun --max-restarts")],
}
NODE_HEAD_ARGS: dict[str, Any] = {"num_cpus": 0, "include_dashboard": False,
                                  "_system_config": {"worker_niceness": 0}}
E = TypeVar("E", bound=ev.Event)


def stalwart_overrides(runner: str) -> list[str]:
    base, _, tier = runner.partition("/")
    extra = {"stalwart": NO_SPARE, "stalwart+spare": SPARE, "stalwart-elastic": ELASTIC,
             "stalwart-elastic+spare": ELASTIC_SPARE}[base]
    return [*STALWART_OVERRIDES, *extra, *(STORAGE_ONLY if tier == "storage" else [])]


def settings(args: argparse.Namespace, tps: int, health: dict[str, Any]) -> dict[str, Any]:
    """The scenario as the report records it."""
    return {
        "rounds": args.rounds, "faults": args.faults, "steps": STEPS, "fault_step": FAULT_STEP,
        "persist_every": PERSIST_EVERY, "workers": WORKERS, "tokens_per_step": tps,
        "config": args.config, "stalwart_overrides": STALWART_OVERRIDES, "stalwart_spare": SPARE,
        "stalwart_elastic": ELASTIC, "stalwart_elastic_spare": ELASTIC_SPARE,
        "node_worker_nodes": NODE_WORKER_NODES, "inject": INJECT, "hang_wait_s": HANG_WAIT_S,
        OUTSIDE_KILL: {"kill_after_step_logged": FAULT_STEP, "poll_s": POLL_S,
                       "stalwart_overrides": OUTSIDE_STALWART, "model_overrides": [],
                       "torchrun": {"max_restarts": torchrun_recovery.MAX_RESTARTS,
                                    "checkpoint_every": PERSIST_EVERY},
                       "targets": {"next_step_slack_s": TARGET_NEXT_STEP_SLACK_S,
                                   "ratios": TARGET_OUTSIDE_RATIOS}},
        "raytrain": {"commit_checkpoints": True, "hang_wait_s": HANG_WAIT_S,
                     "replace_node_after": "dead", "overrides": common.TINY,
                     "checkpoint_every": PERSIST_EVERY},
        "ray_node_health_checks": health}


def run_row(runner: str, fault: str, args: argparse.Namespace, work: Path,
            rnd: int) -> dict[str, Any]:
    tag = f"r{rnd}-{fault}-{runner}".replace("/", "-")  # one file name, not a folder
    system = runner if runner in ("ray-train", "torchrun") else "stalwart"
    result: dict[str, Any] = {"system": system, "runner": runner, "fault": fault, "round": rnd,
                              "load_before": os.getloadavg()[0], "log": str(work / f"{tag}.log")}
    try:
        if system == "ray-train":
            return run_ray_train(result, args, work / tag)
        if system == "torchrun":
            return run_torchrun_outside(result, args, work / tag)
        return run_stalwart(result, args, work / tag)
    except Exception as exc:  # recorded, the other runs go on
        if system == "ray-train":
            result["log_tail"] = common.tail(Path(result["log"]), 25)
        result.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return result | {
            "completed": False, "detected": False, "detection_s": None, "restart_s": None,
            "recovery_s": None, "lost_steps": None, "fault_time": None}


def run_stalwart(result: dict[str, Any], args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    """`stalwart run` with --inject FAULT, or killed by the harness for outside-kill."""
    fault = result["fault"]
    result["run_dir"] = str(run_dir)
    if fault == OUTSIDE_KILL:
        cmd = common.stalwart_command(args.config, OUTSIDE_STALWART, run_dir)
        kill_time = _run_killed(result, cmd, args.timeout, run_dir / "metrics.jsonl",
                                lambda: harness.stalwart_rank_pid(run_dir, 1))
        result.update(analyse_stalwart_outside(run_dir, kill_time))
    else:
        cmd = [*common.stalwart_command(args.config, stalwart_overrides(result["runner"]),
                                        run_dir), "--inject", INJECT[fault]]
        if fault in NODE_FAULTS:
            run_stalwart_node(cmd, run_dir, args.timeout, result)
        else:
            _run(result, cmd, args.timeout)
        result.update(analyse_stalwart(run_dir, fault,
                                       memory_tier=not result["runner"].endswith("/storage"),
                                       spare="+spare" in result["runner"]))
    result["completed"] = result["exit_code"] == 0 and result["finished"]
    if result["exit_code"] != 0 or result["missing_events"]:
        result["log_tail"] = common.tail(Path(result["log"]), 25)
    return result


def _run(result: dict[str, Any], cmd: list[str], timeout: float, *watch: Any) -> None:
    result["command"] = cmd
    code, wall = harness.run_watched(cmd, Path(result["log"]), timeout, *watch)
    result.update(exit_code=code, wall_s=wall)


def _run_killed(result: dict[str, Any], cmd: list[str], timeout: float, step_log: Path,
                pid: Callable[[], int | None]) -> float | None:
    """_run, SIGKILLing pid() once FAULT_STEP is in step_log; the kill's time."""
    killer = SignalAtStep(after_step=FAULT_STEP, logged_step=lambda: harness.last_logged(step_log),
                          pid=pid)
    _run(result, cmd, timeout, killer.tick, POLL_S)
    result.update(killer.record())
    return killer.time


def run_stalwart_node(cmd: list[str], run_dir: Path, timeout: float,
                      result: dict[str, Any]) -> None:
    """Node faults on a local cluster; a dead node is replaced, a frozen one killed."""
    import ray

    cluster = harness.local_cluster(NODE_WORKER_NODES, **NODE_HEAD_ARGS)
    node: dict[str, Any] = {}
    try:
        ray.init(address=cluster.address, logging_level="WARNING")  # to watch the GCS

        def tick() -> None:
            if "killed_node_id" not in node:
                events = read_events(run_dir / "events.jsonl")
                fired = next((e for e in events if isinstance(e, ev.FaultInjected)), None)
                started = next((e for e in events if isinstance(e, ev.WorkersStarted)), None)
                if fired is None or started is None:
                    return
                node["fault_time"] = fired.time
                node["killed_node_id"] = started.workers[fired.rank].node_id
            harness.replace_dead_node(cluster, node["killed_node_id"], node)

        _run(result, [*cmd, "--address", cluster.address], timeout, tick)
    finally:
        try:
            ray.shutdown()
            if result["fault"] == "freeze":
                kill_frozen_nodes(cluster)
        finally:
            cluster.shutdown()
    result.update(harness.node_times(node, node.get("fault_time", 0.0)),
                  cluster={"head": NODE_HEAD_ARGS, "worker_nodes": NODE_WORKER_NODES,
                           "cpus_per_node": 1})


def kill_frozen_nodes(cluster: Any) -> None:
    """SIGKILL the raylet of each node a freeze-node fault stopped, and every process it
    started: a stopped process takes SIGKILL at once, where the cluster's shutdown would wait."""
    from ray._private import ray_constants

    from stalwart.workers.faults import children_of
    from stalwart.workers.node_agent import process_state

    for node in list(cluster.worker_nodes):
        raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process
        if raylet.poll() is None and process_state(raylet.pid) == "T":
            for pid in [raylet.pid, *children_of(raylet.pid)]:
                harness.signal_pid(pid, signal.SIGKILL)
            cluster.remove_node(node, allow_graceful=False)


def _first(events: list[ev.Event], cls: type[E], after: float = float("-inf")) -> E | None:
    return next((e for e in events if isinstance(e, cls) and e.time > after), None)


def _unfinished(kinds: list[str]) -> list[str]:
    """[] when the run's last event is `finished`; else that event, named as missing."""
    last = kinds[-1] if kinds else "none"
    return [] if last == "finished" else [f"finished (last event: {last})"]


def analyse_stalwart(run_dir: Path, fault: str, memory_tier: bool,
                     spare: bool = False) -> dict[str, Any]:
    """The measurements of one --inject run, from its events.jsonl and metrics.jsonl. A node
    fault shrinks the world, unless a spare keeps its size."""
    events = read_events(run_dir / "events.jsonl")
    rows = read_metrics(run_dir / "metrics.jsonl")
    kinds = [e.kind for e in events]
    injected, failure = _first(events, ev.FaultInjected), _first(events, ev.Failure)
    recovered = _first(events, ev.Recovered)
    not_finished = _unfinished(kinds)
    resized = [{"old_world_size": e.old_world_size, "new_world_size": e.new_world_size,
                "reason": e.reason, "step": e.step, "time": e.time}
               for e in events if isinstance(e, ev.Resized)]
    out: dict[str, Any] = {
        "events": [e.to_row() for e in events], "event_kinds": kinds,
        "fault_time": None, "detected": failure is not None, "failure_kind": None,
        "detection_s": None, "restart_s": None, "recovery_s": None,
        "recovery_s_from_metrics": None, "lost_steps": None, "restored_from_step": None,
        "source": None, "phases": None, "steps_before_fault": None,
        "last_checkpoint_before_fault": None, "lost_steps_bound": None, "resized": resized,
        "world_sizes": sorted({r.world_size for r in rows}),
        "normal_step_s": normal_step_s(rows, before=None),
        "final_step": max((r.step for r in rows), default=0), "finished": not not_finished,
        "missing_events": [k for k, e in (("fault_injected", injected), ("failure", failure),
                                          ("recovered", recovered)) if e is None]
        + (["resized"] if fault in NODE_FAULTS and not spare and not resized else [])
        + not_finished}
    if injected is None:
        return out
    ft = out["fault_time"] = injected.time
    out["fault_rank"] = injected.rank
    out["normal_step_s"] = normal_step_s(rows, before=ft)
    started = [e for e in events if isinstance(e, ev.WorkersStarted)]
    if fault in NODE_FAULTS and started:
        workers = started[0].workers
        if injected.rank < len(workers):
            out["killed_node_id"] = workers[injected.rank].node_id
        out["first_world_nodes"] = {w.rank: w.node_id for w in workers}
    out["last_checkpoint_before_fault"] = max(
        (e.step for e in events[:events.index(injected)]
         if isinstance(e, ev.CheckpointCommitted)), default=None)
    if failure is not None:
        # With the memory tier no completed step is lost; without it, the steps since the
        # last storage checkpoint due.
        out.update(failure_kind=failure.failure_kind, detection_s=failure.detection_s,
                   steps_before_fault=failure.step,
                   lost_steps_bound=0 if memory_tier else failure.step % PERSIST_EVERY,
                   failure={k: v for k, v in failure.to_row().items() if k != "message"})
    if not not_finished:
        out["finished_s"] = events[-1].time - ft
    if later_starts := [e.time for e in started if e.time > ft]:
        out["restart_s"] = min(later_starts) - ft
    if recovered is not None:
        out.update(recovery_s=recovered.recovery_s, lost_steps=recovered.lost_steps,
                   restored_from_step=recovered.from_step, source=recovered.source,
                   phases=recovered.phases, restore_s=recovered.phases.get("restore"),
                   world_size_after=recovered.world_size)
        # The same from metrics.jsonl: fault -> the first row of the restored step + 1.
        if again := [r.time for r in rows if r.time > ft and r.step == recovered.from_step + 1]:
            out["recovery_s_from_metrics"] = min(again) - ft
    return out


def normal_step_s(rows: list[Any], before: float | None) -> float | None:
    """The median gap between consecutive steps of the first world, before `before`."""
    first = [r for r in rows if before is None or r.time <= before]
    gaps = [b.time - a.time for a, b in zip(first, first[1:], strict=False)
            if b.step == a.step + 1 and b.world_size == a.world_size]
    return statistics.median(gaps) if gaps else None


def analyse_stalwart_outside(run_dir: Path, kill_time: float | None) -> dict[str, Any]:
    """The outside-kill measure, and stalwart's own account from its events after the kill."""
    events = read_events(run_dir / "events.jsonl")
    out = measure_kill(harness.stalwart_steps(run_dir), kill_time)
    kinds = [e.kind for e in events]
    not_finished = _unfinished(kinds)
    out.update(fault_time=kill_time, event_kinds=kinds, detected=False, detection_s=None,
               restart_s=None, restored_from_step=out["resumed_from"], lost_steps_bound=0,
               finished=not not_finished, missing_events=[])
    if kill_time is None:
        out["missing_events"].append("no kill")
        return out
    failure, recovered, start = (_first(events, cls, kill_time)
                                 for cls in (ev.Failure, ev.Recovered, ev.WorkersStarted))
    if failure is not None:  # kill -> the controller decides it is a failure, from outside
        out.update(detected=True, detection_s=failure.time - kill_time,
                   failure={k: v for k, v in failure.to_row().items() if k != "message"})
    if start is not None:
        out["restart_s"] = start.time - kill_time
    if recovered is not None:
        first, normal = recovered.phases.get("first_step"), out.get("normal_step_s")
        out.update(source=recovered.source, phases=recovered.phases,
                   restore_s=recovered.phases.get("restore"),
                   first_step_ratio=first / normal if first is not None and normal else None,
                   stalwart_recovery_s=recovered.recovery_s, stalwart_from_step=recovered.from_step,
                   stalwart_lost_steps=recovered.lost_steps)
    out["missing_events"] = [k for k, e in (("failure", failure), ("recovered", recovered))
                             if e is None] + not_finished
    return out


def run_torchrun_outside(result: dict[str, Any], args: argparse.Namespace,
                         workdir: Path) -> dict[str, Any]:
    """`torchrun --max-restarts 3` of torchrun_recovery.py, killed once FAULT_STEP is logged."""
    workdir.mkdir(parents=True)
    cmd = torchrun_recovery.torchrun_command(
        workdir, nproc=WORKERS, steps=STEPS, checkpoint_every=PERSIST_EVERY,
        config=args.config, overrides=[])
    kill_time = _run_killed(
        result, cmd, args.timeout, workdir / torchrun_recovery.STEPS_FILE,
        lambda: harness.attempts_pid(workdir / torchrun_recovery.ATTEMPTS_FILE, 1))
    result.update(analyse_torchrun(workdir, kill_time))
    result["completed"] = result["exit_code"] == 0 and result["final_step"] == STEPS
    if not result["completed"] or result["recovery_s"] is None:
        result["log_tail"] = common.tail(Path(result["log"]), 25)
    _drop_or_keep(result, workdir, args.keep)
    return result


def _drop_or_keep(result: dict[str, Any], workdir: Path, keep: bool) -> None:
    if keep:
        result["workdir"] = str(workdir)
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def analyse_torchrun(workdir: Path, kill_time: float | None) -> dict[str, Any]:
    """The outside-kill measure (worlds: torchrun's restarts) and the restarts' times."""
    steps = read_jsonl(workdir / torchrun_recovery.STEPS_FILE)
    attempts = read_jsonl(workdir / torchrun_recovery.ATTEMPTS_FILE)
    out = measure_kill([StepRow(r["step"], r["time"], r["attempt"]) for r in steps], kill_time)
    out.update(fault_time=kill_time, restored_from_step=out["resumed_from"],
               attempts=sorted({a["attempt"] for a in attempts}),
               restarts=max((a["attempt"] for a in attempts), default=0), detected=False,
               detection_s=None, restart_s=None, ready_s=None)
    if kill_time is None:
        return out
    killed = max((a["attempt"] for a in attempts if a["time"] <= kill_time), default=None)
    later = [a for a in attempts if killed is not None and a["attempt"] > killed]
    starts = [a["time"] for a in later if a["event"] == "start"]
    readies = [a for a in later if a["event"] == "ready"]
    if starts:
        # kill -> the restarted processes exist: the agent noticed, stopped the group, ran
        # the rendezvous and spawned them. An upper bound of its detection.
        out.update(detected=True, restart_s=min(starts) - kill_time)
    if readies:
        out["ready_s"] = min(a["time"] for a in readies) - kill_time  # imported, restored
        out["restored_from_checkpoint"] = readies[0]["restored_from"]
    return out


@contextlib.contextmanager
def output_to(log: Path) -> Iterator[None]:
    """This process's fds 1 and 2 go to log (Ray's driver prints the workers' logs there)."""
    saved = []
    try:
        with log.open("a") as f:
            for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
                stream.flush()
                saved.append(os.dup(fd))
                os.dup2(f.fileno(), fd)
            yield
    finally:
        for fd, old in enumerate(saved, start=1):
            (sys.stdout, sys.stderr)[fd - 1].flush()
            os.dup2(old, fd)
            os.close(old)


def run_ray_train(result: dict[str, Any], args: argparse.Namespace,
                  workdir: Path) -> dict[str, Any]:
    fault = result["fault"]
    with output_to(Path(result["log"])):
        raw = run_raytrain(fault, steps=STEPS, fault_step=FAULT_STEP,
                           checkpoint_every=PERSIST_EVERY, workdir=workdir,
                           timeout_s=args.timeout, hang_wait_s=HANG_WAIT_S, config=args.config,
                           overrides=[] if fault == OUTSIDE_KILL else common.TINY)
    detection, restart = raw.get("controller_failure_s"), raw.get("detection_s")
    result.update(
        raw=raw, restart_s=restart, completed=raw.get("completed", False),
        detected=raw.get("detected", False) and (detection is not None or restart is not None),
        detection_s=detection if detection is not None else restart,
        detection_from=("controller_failure_s" if detection is not None else
                        "detection_s (restart)" if restart is not None else None),
        **{k: raw.get(k) for k in ("fault_time", "recovery_s", "lost_steps", "restored_from_step",
                                   "steps_before_fault", "last_checkpoint_before_fault",
                                   "node_dead_s", "replacement_added_s")})
    if result["steps_before_fault"] is not None:
        result["lost_steps_bound"] = result["steps_before_fault"] % PERSIST_EVERY
    if fault == OUTSIDE_KILL:  # the same measure as the other outside-kill rows
        rows = read_jsonl(workdir / raytrain_worker.STEPS_FILE)
        outside = measure_kill([StepRow(r["step"], r["time"], r["pid"]) for r in rows],
                               raw.get("fault_time"))
        result.update(outside, restored_from_step=outside["resumed_from"],
                      **raw.get("outside_kill", {}))
    if not result["detected"] and fault == "hang":
        result["not_detected_within_s"] = HANG_WAIT_S
    _drop_or_keep(result, workdir, args.keep)
    return result
