"""The recovery benchmark's runs (bench/recovery.py): one scenario row on its own Ray, as a
user types it (stalwart) or through run_raytrain (Ray Train), with its log kept aside."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import common
from bench.outside_kill import OUTSIDE_KILL, StepRow, measure_kill
from bench.peers.raytrain_recovery import TINY, run_raytrain
from bench.peers.raytrain_worker import STEPS_FILE
from bench.recovery_measure import analyse_stalwart
from bench.recovery_setup import (
    FAULT_STEP,
    HANG_WAIT_S,
    INJECT,
    NODE_FAULTS,
    NODE_HEAD_ARGS,
    OUTSIDE_MODEL,
    PERSIST_EVERY,
    POLL_S,
    STEPS,
    WORKERS,
    stalwart_overrides,
)
from stalwart.core import events as ev
from stalwart.core.events import read_events, read_jsonl


def run_cli(cmd: list[str], log: Path, timeout: float,
            tick: Callable[[], None] | None = None,
            poll_s: float = POLL_S) -> tuple[int, float]:
    """Run the CLI with output to log, calling tick() every poll_s; (exit code, wall s).

    Past the timeout the CLI gets Ctrl-C twice (stop, then abandon the checkpoint), then
    SIGKILL; its own process group only (it is started in a new session).
    """
    t0 = time.perf_counter()
    with log.open("w") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=common.ROOT,
                                env=common.child_env(), start_new_session=True)
        deadline = time.perf_counter() + timeout
        stage = 0
        while proc.poll() is None:
            if tick is not None:
                tick()
            if time.perf_counter() > deadline:
                f.write(f"\n[bench] timed out after {timeout:.0f}s (stage {stage})\n")
                f.flush()
                if stage < 2:
                    proc.send_signal(signal.SIGINT)
                    deadline = time.perf_counter() + 30
                else:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
                stage += 1
            time.sleep(poll_s)
        code = proc.returncode if stage == 0 else -1
    return code, time.perf_counter() - t0


def run_stalwart(runner: str, fault: str, args: argparse.Namespace, work: Path,
                 rnd: int) -> dict[str, Any]:
    tag = f"r{rnd}-{fault}-{runner}"
    run_dir, log = work / tag, work / f"{tag}.log"
    overrides = stalwart_overrides(runner)
    cmd = [*common.stalwart_command(args.config, overrides, run_dir), "--inject", INJECT[fault]]
    result: dict[str, Any] = {"system": "stalwart", "runner": runner, "fault": fault,
                              "round": rnd, "load_before": os.getloadavg()[0],
                              "log": str(log), "run_dir": str(run_dir)}
    try:
        if fault not in NODE_FAULTS:
            result["command"] = cmd
            code, wall = run_cli(cmd, log, args.timeout)
        else:
            code, wall = run_stalwart_node(cmd, run_dir, log, args.timeout, result,
                                           freeze=fault == "freeze")
    except Exception as exc:  # recorded, the other runs go on
        import traceback

        result.update(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc(),
                      completed=False, detected=False, detection_s=None, restart_s=None,
                      recovery_s=None, lost_steps=None, fault_time=None)
        return result
    result.update(exit_code=code, wall_s=wall)
    result.update(analyse_stalwart(run_dir, fault, memory_tier=not runner.endswith("/storage")))
    result["completed"] = code == 0 and result["finished"]
    if code != 0 or result["missing_events"]:
        result["log_tail"] = common.tail(log, 25)
    return result


def run_stalwart_node(cmd: list[str], run_dir: Path, log: Path, timeout: float,
                      result: dict[str, Any], *, freeze: bool = False) -> tuple[int, float]:
    """The node faults: the CLI against a local 3-node cluster; a replacement node is added as
    soon as the GCS reports the lost node dead (run_raytrain's replace_node_after="dead").
    A frozen node's processes (this cluster's) are SIGKILLed at the end."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=NODE_HEAD_ARGS)
    node: dict[str, Any] = {"replace_node_after": "dead"}
    try:
        for _ in range(WORKERS):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")  # to watch the GCS
        cmd = [*cmd, "--address", cluster.address]
        result["command"] = cmd
        events_path = run_dir / "events.jsonl"

        def tick() -> None:
            if "replacement_added" in node:
                return
            if "killed_node_id" not in node:
                events = read_events(events_path)
                fired = next((e for e in events if isinstance(e, ev.FaultInjected)), None)
                started = next((e for e in events if isinstance(e, ev.WorkersStarted)), None)
                if fired is None or started is None:
                    return
                node["fault_time"] = fired.time
                node["killed_node_id"] = started.workers[fired.rank].node_id
            alive = next((bool(n["Alive"]) for n in ray.nodes()
                          if n["NodeID"] == node["killed_node_id"]), None)
            if alive is False:
                node["dead_time"] = time.time()  # the GCS has noticed
                cluster.add_node(num_cpus=1)
                node["replacement_added"] = time.time()

        code, wall = run_cli(cmd, log, timeout, tick)
    finally:
        try:
            ray.shutdown()
            if freeze:
                kill_frozen_nodes(cluster)
        finally:
            cluster.shutdown()
    ft = node.get("fault_time")
    result["node_dead_s"] = node["dead_time"] - ft if "dead_time" in node else None
    result["replacement_added_s"] = (node["replacement_added"] - ft
                                     if "replacement_added" in node else None)
    result["replace_node_after"] = "dead"
    result["cluster"] = {"head": NODE_HEAD_ARGS, "worker_nodes": WORKERS,
                         "cpus_per_node": 1}
    return code, wall


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
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            cluster.remove_node(node, allow_graceful=False)


@contextlib.contextmanager
def output_to(log: Path):
    """This process's stdout and stderr (file descriptors 1 and 2) go to log: Ray's driver
    prints every worker's and the controller's log lines there."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    try:
        with log.open("a") as f:
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
            try:
                yield
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        os.close(saved[0])
        os.close(saved[1])


def run_ray_train(fault: str, args: argparse.Namespace, work: Path, rnd: int) -> dict[str, Any]:
    workdir = work / f"r{rnd}-{fault}-ray-train"
    log = work / f"r{rnd}-{fault}-ray-train.log"
    load = os.getloadavg()[0]
    try:
        with output_to(log):
            raw = run_raytrain(fault, steps=STEPS, fault_step=FAULT_STEP,
                               checkpoint_every=PERSIST_EVERY, workdir=workdir,
                               timeout_s=args.timeout, hang_wait_s=HANG_WAIT_S,
                               num_cpus=WORKERS, config=args.config,
                               overrides=list(OUTSIDE_MODEL if fault == OUTSIDE_KILL else TINY),
                               replace_node_after="dead", commit_checkpoints=True)
    except Exception as exc:  # recorded, the other runs go on
        import traceback

        return {"system": "ray-train", "runner": "ray-train", "fault": fault, "round": rnd,
                "load_before": load, "log": str(log), "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(), "log_tail": common.tail(log, 25),
                "completed": False, "detected": False, "detection_s": None,
                "restart_s": None, "recovery_s": None, "lost_steps": None, "fault_time": None}
    raw.pop("step_times", None)
    outside = measure_kill([StepRow(r["step"], r["time"], r["pid"])
                            for r in read_jsonl(workdir / STEPS_FILE)],
                           raw.get("fault_time")) if fault == OUTSIDE_KILL else {}
    out: dict[str, Any] = {"system": "ray-train", "runner": "ray-train", "fault": fault,
                           "round": rnd, "load_before": load, "log": str(log), "raw": raw}
    # Ray Train's own detection: its controller's FailurePolicy decision; restart_s: the
    # first train-loop start of the next attempt (run_raytrain's detection_s, an upper bound).
    detection = raw.get("controller_failure_s")
    out.update(
        fault_time=raw.get("fault_time"),
        detected=raw.get("detected", False) and (detection is not None
                                                 or raw.get("detection_s") is not None),
        detection_s=detection if detection is not None else raw.get("detection_s"),
        detection_from=("controller_failure_s" if detection is not None else
                        "detection_s (restart)" if raw.get("detection_s") is not None
                        else None),
        restart_s=raw.get("detection_s"), recovery_s=raw.get("recovery_s"),
        lost_steps=raw.get("lost_steps"), restored_from_step=raw.get("restored_from_step"),
        steps_before_fault=raw.get("steps_before_fault"),
        last_checkpoint_before_fault=raw.get("last_checkpoint_before_fault"),
        completed=raw.get("completed", False),
        node_dead_s=raw.get("node_dead_s"), replacement_added_s=raw.get("replacement_added_s"),
    )
    if out["steps_before_fault"] is not None:
        out["lost_steps_bound"] = out["steps_before_fault"] % PERSIST_EVERY
    if outside:  # the same measure as the other outside-kill rows (worlds: rank 0's pid)
        out.update(outside, restored_from_step=outside["resumed_from"],
                   **raw.get("outside_kill", {}))
    if not out["detected"] and fault == "hang":
        out["not_detected_within_s"] = HANG_WAIT_S
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        out["workdir"] = str(workdir)
    return out
