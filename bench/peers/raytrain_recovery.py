"""Ray Train's side of the recovery benchmark: raytrain_worker.py's loop under TorchTrainer on a
local Ray of its own, one fault on rank 1 (or a kill from outside by the harness), measured."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bench
from bench import common, harness
from bench.peers import raytrain_worker as rw
from stalwart.core.events import read_jsonl


@contextlib.contextmanager
def ray_train(workdir: Path, loop: dict[str, Any], *, name: str, max_failures: int,
              head_cpus: int, worker_nodes: int = 0
              ) -> Iterator[tuple[Any, threading.Thread, dict[str, Any]]]:
    """trainer.fit() on a thread, on a local Cluster that ends with the block: (the cluster, the
    thread, fit_out: "start" when fit began, "error" None or its error). RAY_ADDRESS pins Ray
    Train's PlacementGroupCleaner here: else it picks "the latest" Ray and may remove our group."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cluster = harness.local_cluster(worker_nodes, num_cpus=head_cpus)
    try:
        ray.init(address=cluster.address,
                 runtime_env={"env_vars": {"RAY_ADDRESS": cluster.address}})
        # The train loop and the bench modules it uses travel by value, not by import path.
        ray.cloudpickle.register_pickle_by_value(bench)
        trainer = TorchTrainer(
            rw.train_loop_per_worker, train_loop_config={"workdir": str(workdir), **loop},
            scaling_config=ScalingConfig(num_workers=rw.NUM_WORKERS, use_gpu=False,
                                         resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name=name, storage_path=str(workdir / "storage"),
                                 failure_config=FailureConfig(max_failures=max_failures)))
        fit_out: dict[str, Any] = {}

        def fit() -> None:
            try:
                res = trainer.fit()
                fit_out["error"] = None if res.error is None else repr(res.error)
            except BaseException as e:  # reported, not raised
                fit_out["error"] = repr(e)

        thread = threading.Thread(target=fit, name="raytrain-fit", daemon=True)
        fit_out["start"] = time.time()
        thread.start()
        yield cluster, thread, fit_out
    finally:
        try:
            ray.shutdown()
        finally:
            cluster.shutdown()


def _health_settings() -> dict[str, Any]:
    from ray.train.v2._internal import constants as c

    return {key: float(os.environ.get(getattr(c, f"{name}_ENV_VAR"), getattr(c, f"DEFAULT_{name}")))
            for key, name in (("health_check_interval_s", "HEALTH_CHECK_INTERVAL_S"),
                              ("worker_health_check_timeout_s", "WORKER_HEALTH_CHECK_TIMEOUT_S"),
                              ("worker_group_start_timeout_s", "WORKER_GROUP_START_TIMEOUT_S"))}


def read_fault(workdir: Path) -> dict[str, Any] | None:
    """What rank 1 (or the harness) wrote just before the fault; None before it."""
    try:
        return json.loads((workdir / rw.FAULT_FILE).read_text())
    except (OSError, ValueError):
        return None


class _Watch:
    """The harness during a run: the outside kill, a replacement node, giving up on a hang."""

    def __init__(self, workdir: Path, fault: str, fault_step: int, *, timeout_s: float,
                 hang_wait_s: float) -> None:
        self.workdir, self.fault, self.deadline = workdir, fault, time.time() + timeout_s
        self.timeout_s, self.hang_wait_s = timeout_s, hang_wait_s
        self.cluster: Any = None
        self.node_info: dict[str, Any] = {}  # a lost node's replacement (harness)
        self.aborted: str | None = None
        self.abort_time: float | None = None
        self.killed_pids: list[int] = []
        self.killer = None if fault != harness.OUTSIDE_KILL else harness.SignalAtStep(
            after_step=fault_step, logged_step=lambda: harness.last_logged(workdir / rw.STEPS_FILE),
            pid=lambda: harness.attempts_pid(workdir / rw.ATTEMPTS_FILE, 1))

    def poll(self) -> bool:
        """One look; False once the teardown after an abort is stuck (ray.shutdown ends it)."""
        if self.killer is not None and not self.killer.done:
            self.killer.tick()
            if self.killer.time is not None:  # what the rank writes before an inside fault
                rw.write_json_atomic(self.workdir / rw.FAULT_FILE, {
                    "fault": self.fault, "time": self.killer.time, "pid": self.killer.sent_to,
                    "step_logged": self.killer.step_logged})
        now, info = time.time(), read_fault(self.workdir)
        if info is not None and self.fault == "node":
            harness.replace_dead_node(self.cluster, info["node_id"], self.node_info)
        if (info is not None and self.fault == "hang" and self.aborted is None
                and now > info["time"] + self.hang_wait_s
                and not any(a["event"] == "start" and a["time"] > info["time"]
                            for a in read_jsonl(self.workdir / rw.ATTEMPTS_FILE))):
            self.aborted = f"hang not detected within hang_wait_s={self.hang_wait_s:g}"
        if self.aborted is None and now > self.deadline:
            self.aborted = f"timeout_s={self.timeout_s:g} reached"
        if self.aborted is not None and not (self.workdir / rw.STOP_FILE).exists():
            # Every train loop that sees the stop file returns; the stopped (or stuck) rank
            # gets SIGKILLed so that Ray Train tears the group down.
            from stalwart.workers.node_agent import process_state

            self.abort_time = time.time()
            (self.workdir / rw.STOP_FILE).write_text(json.dumps({"time": self.abort_time,
                                                                 "reason": self.aborted}))
            if (info is not None and process_state(info["pid"]) == "T"
                    and harness.signal_pid(info["pid"], signal.SIGKILL)):
                self.killed_pids.append(info["pid"])
            self.deadline = time.time() + 120  # for the teardown itself
        return self.aborted is None or now <= self.deadline


def run_raytrain(fault: str, *, steps: int, fault_step: int, checkpoint_every: int,
                 workdir: Path, timeout_s: float, hang_wait_s: float, config: str | Path,
                 overrides: list[str]) -> dict[str, Any]:
    """One Ray Train run with one fault on rank 1 at the start of `fault_step`, measured."""
    import ray
    from ray.train.torch import TorchConfig
    from ray.train.v2._internal.constants import is_v2_enabled

    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    overrides = [*overrides, f"train.steps={steps}", f"scaling.num_workers={rw.NUM_WORKERS}"]
    common.tokens_per_step(str(config), overrides)  # tokenizes the data outside the clock
    result: dict[str, Any] = {
        "fault": fault, "ray_train_version": ray.__version__, "v2": is_v2_enabled(),
        "ray_train_v2_enabled_env": os.environ.get("RAY_TRAIN_V2_ENABLED"),  # None: default
        "steps": steps, "fault_step": fault_step, "checkpoint_every": checkpoint_every,
        "num_workers": rw.NUM_WORKERS, "overrides": overrides, "commit_checkpoints": True,
        "torch_config_timeout_s": TorchConfig().timeout_s, "torch_backend": "gloo",  # defaults
        **_health_settings()}
    loop = {"config": str(config), "overrides": overrides, "fault": fault,
            # outside-kill: the workers inject nothing (no step is step 0)
            "fault_step": 0 if fault == harness.OUTSIDE_KILL else fault_step,
            "checkpoint_every": checkpoint_every}
    t_start = time.time()
    watch = _Watch(workdir, fault, fault_step, timeout_s=timeout_s, hang_wait_s=hang_wait_s)
    node = fault == "node"
    with ray_train(workdir, loop, name=f"raytrain-{fault}", max_failures=3,
                   head_cpus=0 if node else rw.NUM_WORKERS,
                   # one node more than workers: room for a replacement, as stalwart's rows
                   worker_nodes=rw.NUM_WORKERS + 1 if node else 0
                   ) as (watch.cluster, thread, fit_out):
        while thread.is_alive() and watch.poll():
            thread.join(0.2 if watch.killer is None else harness.POLL_S)
        try:  # Ray's session folder: its controller's log is there
            session_dir = ray._private.worker._global_node.get_session_dir_path()
        except Exception:
            session_dir = None
    result.update(fit_error=fit_out.get("error", "fit did not return"),
                  aborted=watch.aborted, harness_killed_pids=watch.killed_pids)
    if watch.killer is not None:
        result["outside_kill"] = watch.killer.record()
    result["wall_s"] = time.time() - t_start
    return _measure(result, watch, steps, session_dir)


def _measure(result: dict[str, Any], watch: _Watch, steps: int,
             session_dir: str | None) -> dict[str, Any]:
    """Kill what outlived the run; its measurements from the workers' files and Ray's log."""
    workdir, fault = watch.workdir, watch.fault
    attempts = read_jsonl(workdir / rw.ATTEMPTS_FILE)
    info = read_fault(workdir)
    pids = {a["pid"] for a in attempts} | set((info or {}).get("other_node_pids", []))
    time.sleep(1.0)
    leftover = sorted(p for p in pids if harness.pid_alive(p))  # a stopped process outlives
    for p in leftover:
        harness.signal_pid(p, signal.SIGKILL)
    result["leftover_pids_killed"] = leftover
    result.update(analyse(workdir, attempts, info, fault, watch.node_info))
    result.update(controller_events(session_dir, info["time"] if info else None, watch.abort_time))
    result["abort_s"] = (None if watch.abort_time is None or info is None
                         else watch.abort_time - info["time"])
    if fault == "hang":
        result["notes"].append(
            "hang: Ray Train has no hang detection besides its controller's worker health check "
            f"({result['worker_health_check_timeout_s']:g} s; the stopped actor cannot answer) and "
            f"the torch process-group timeout ({result['torch_pg_timeout_s']} s, rank 0 waits that "
            f"long in the all-reduce); the harness waited hang_wait_s={watch.hang_wait_s:g} s.")
    if fault == "node":
        result["notes"].append(
            "node: rank 1 SIGKILLed its raylet, the raylet's other children and itself; the "
            "driver added a replacement 1-CPU node once the GCS reported the node dead.")
    lost_ckpt, restored = result.get("last_checkpoint_before_fault"), result["restored_from_step"]
    if None not in (restored, lost_ckpt) and restored < lost_ckpt:
        result["notes"].append(
            f"the checkpoint of step {lost_ckpt} was reported (and written to storage) before "
            f"the fault but never registered: the controller had not yet polled it from the "
            f"worker's queue (poll every {result['health_check_interval_s']:g} s), so the run "
            f"restored from step {result['restored_from_step']}.")
    result["detected"] = result["detection_s"] is not None
    result["completed"] = (result["fit_error"] is None and result["aborted"] is None
                           and result["final_step"] == steps)
    return result


def controller_events(session_dir: str | None, fault_time: float | None,
                      abort_time: float | None) -> dict[str, Any]:
    """Ray Train's own detection (its FailurePolicy decision) and later controller lines."""
    out: dict[str, Any] = {"controller_failure_s": None, "controller_events": []}
    if session_dir is None or fault_time is None:
        return out
    for log in sorted(Path(session_dir, "logs", "train").glob("ray-train-sys-controller-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
                t = row["timestamp_ns"] / 1e9
            except (ValueError, KeyError, TypeError):
                continue
            if t < fault_time:
                continue
            first = " ".join(m.strip() for m in row.get("message", "").splitlines()[:2])
            out["controller_events"].append([round(t - fault_time, 3), first[:140]])
            if (out["controller_failure_s"] is None and first.startswith("[FailurePolicy]")
                    and (abort_time is None or t < abort_time)):
                out["controller_failure_s"] = t - fault_time
    out["controller_events"].sort()
    return out


def analyse(workdir: Path, attempts: list[dict[str, Any]], info: dict[str, Any] | None,
            fault: str, node_info: dict[str, Any]) -> dict[str, Any]:
    """detection_s, recovery_s and lost_steps from the workers' files."""
    rows = read_jsonl(workdir / rw.STEPS_FILE)
    starts = [a for a in attempts if a["event"] == "start" and not a["stopping"]]
    readies = [a for a in attempts if a["event"] == "ready"]
    out: dict[str, Any] = {
        "fault_time": None, "detection_s": None, "recovery_s": None, "lost_steps": None,
        "restored_from_step": None, "steps_before_fault": None,
        "final_step": max((r["step"] for r in rows), default=0),
        "attempt_starts": sorted({round(a["time"], 3) for a in starts}),
        "torch_pg_timeout_s": next((a["pg_timeout_s"] for a in readies), None),
        "notes": ["detection_s is an upper bound of detection: fault -> the first train-loop "
                  "start of a new attempt, so it includes tearing down the old worker group "
                  "and starting the new one (actors and process group).",
                  "recovery_s: fault -> the first step completed after the fault (rank 0)."]}
    ft = info["time"] if info is not None else float("inf")
    # Before/after the fault by process, not by clock: rank 0 of the faulty attempt may log
    # its last step a few ms after rank 1 has already started the next one and faulted.
    old = {a["pid"] for a in starts if a["time"] < ft}
    out["first_attempt_nodes"] = first_nodes = {a["rank"]: a["node_id"] for a in starts
                                                if a["pid"] in old}
    if info is None:
        out["notes"].append("the fault was never injected")
        return out
    out["fault_time"] = ft
    out["steps_before_fault"] = max((r["step"] for r in rows if r["pid"] in old), default=0)
    out["last_checkpoint_before_fault"] = max(
        (c["step"] for c in read_jsonl(workdir / rw.CHECKPOINTS_FILE) if c["pid"] in old),
        default=None)
    if later := [a for a in starts if a["pid"] not in old]:
        out["detection_s"] = min(a["time"] for a in later) - ft
    if restored := [a for a in readies if a["pid"] not in old and a["rank"] == 0]:
        out["restored_from_step"] = min(restored, key=lambda a: a["time"])["restored_from"] or 0
        out["lost_steps"] = out["steps_before_fault"] - out["restored_from_step"]
    if after := [r for r in rows if r["pid"] not in old]:
        first_row = min(after, key=lambda r: r["time"])
        out.update(recovery_s=first_row["time"] - ft, first_step_after_fault=first_row["step"])
    if fault == "node":
        out.update(ranks_on_distinct_nodes=len(set(first_nodes.values())) == len(first_nodes) > 1,
                   killed_node_id=info.get("node_id"), **harness.node_times(node_info, ft))
    return out
