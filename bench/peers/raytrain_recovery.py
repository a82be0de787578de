"""Ray Train's side of the recovery benchmark: the reference task under Ray Train's TorchTrainer.

bench/recovery.py compares how stalwart and Ray Train recover from a fault; this module is the
Ray Train half. This file is the harness: bench/peers/raytrain_worker.py is what each worker runs,
bench/peers/raytrain_measure.py reads the result. One call of `run_raytrain(fault, ...)` starts its
own Ray (or, for "node", its own local multi-node cluster), trains the reference task with `TorchTrainer` on 2 workers
(DDP over gloo on CPU), injects one fault on rank 1 at the start of step `fault_step`, lets Ray
Train recover (or not), and returns when and how it recovered. Everything that decides what is
trained comes from stalwart itself, as in bench/peers/torchrun_ddp.py: the JobConfig (the same TOML +
`--set` overrides, by default the tiny model of tests/cli_helpers.py), the GPTTask's model,
init, loss, optimizer and schedule, the same token files and the same global sample order
(GlobalSampler, restored from `samples_seen`).

The train loop is a plain user loop: torch DistributedDataParallel, gradient accumulation with
no_sync(), clip_grad_norm_, AdamW + LR schedule. Every `checkpoint_every` steps (and at the last
step) all ranks call `ray.train.report(...)`, rank 0 with a `Checkpoint` holding model,
optimizer and scheduler state, the step and samples_seen; a (re)started attempt restores from
`ray.train.get_checkpoint()`. Ray Train retries the run up to FailureConfig(max_failures=3).

Faults, injected on rank 1 in the first attempt only (an O_EXCL marker file in workdir):

  kill   the worker process SIGKILLs itself.
  hang   the worker process SIGSTOPs itself. Ray Train's only ways to notice: its controller's
         worker health check (RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S, default 600 s) and the
         torch process-group timeout (TorchConfig.timeout_s, default 1800 s; rank 0 waits that
         long in the all-reduce). If no new attempt starts within `hang_wait_s`, the harness
         records detected=False, writes a stop file (every later attempt returns at once),
         SIGKILLs the stopped pid and lets the run end.
  outside-kill  nothing from inside: the harness SIGKILLs rank 1's process (its pid from
         attempts.jsonl) once rank 0 has logged step `fault_step`, and writes fault.json itself
         with the time read just before the signal (bench/recovery.py's outside-kill rows).
  node   a local cluster (ray.cluster_utils.Cluster): a head node with 0 CPUs (driver and Ray
         Train controller) and one 1-CPU node per worker, so rank 0 and rank 1 are on different
         nodes (checked from the node ids the workers record). Rank 1 checks that its parent is
         its node's raylet, then SIGKILLs the raylet, every other child of that raylet (agents,
         idle workers) and itself: the whole node goes at once, as when a machine dies. Ray
         Train then needs a 1-CPU node again: by default the driver adds a replacement node as
         soon as the GCS reports the killed node dead (`replace_node_after="dead"`: what an
         autoscaler could do at the earliest), or a fixed number of seconds after the fault.

Timestamps (time.time(), one machine, so comparable across processes) go to jsonl files in
workdir: rank 0 appends one line per completed step (steps.jsonl), every rank one line when an
attempt's train loop starts and one when it has restored (attempts.jsonl), rank 1 the fault
(fault.json). From them:

  detection_s     fault -> the first train-loop start of a new attempt on any worker. An upper
                  bound of detection: it includes tearing down the old worker group and starting
                  the new one (actors, process group). None (detected=False) if none started.
  controller_failure_s  fault -> the FailurePolicy decision in Ray Train's controller log: its
                  own detection (it polls the workers every 2 s).
  recovery_s      fault -> the first step completed after the fault.
  lost_steps      steps completed before the fault - the step the new attempt restored from.

Pitfall (Ray Train V2): `ray.train.report(..., checkpoint=...)` writes the checkpoint to storage
at once, but it only counts once the controller's next poll (every 2 s) has taken the report
from the worker's queue; a worker that dies before that poll loses it, and the run restores an
older one. With this tiny model (~50 ms a step) the checkpoint of step 20 is routinely lost at
a fault at step 25. `commit_checkpoints=True` makes rank 0 wait for the registration.

    python -m bench.peers.raytrain_recovery --fault kill [--steps 40 --fault-step 25] [--keep]

prints the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import bench
from bench.common import DEFAULT_CONFIG
from bench.outside_kill import OUTSIDE_KILL, OutsideKill, last_logged, rank_pid
from bench.outside_kill import POLL_S as KILL_POLL_S
from bench.peers.raytrain_measure import analyse, controller_events, read_fault
from bench.peers.raytrain_measure import session_dir as ray_session_dir
from bench.peers.raytrain_worker import (
    ATTEMPTS_FILE,
    FAULT_FILE,
    FAULTS,
    NUM_WORKERS,
    STEPS_FILE,
    STOP_FILE,
    TINY,
    _write_json_atomic,
    train_loop_per_worker,
)
from stalwart.core.config import load_config
from stalwart.core.events import read_jsonl
from stalwart.core.task import build_task

__all__ = ["NUM_WORKERS", "TINY", "run_raytrain", "sigkill", "start_fit"]


def _proc_state(pid: int) -> str | None:
    """The state letter of a live process (R, S, T, Z, ...), None if there is no such pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2]


def sigkill(pid: int) -> bool:
    """SIGKILL `pid`; False if it is already gone."""
    try:
        os.kill(pid, signal.SIGKILL)
        return True
    except ProcessLookupError:
        return False


def _node_alive(node_id: str) -> bool | None:
    import ray

    for n in ray.nodes():
        if n["NodeID"] == node_id:
            return bool(n["Alive"])
    return None


def _health_settings() -> dict[str, Any]:
    from ray.train.v2._internal import constants as c

    return {
        "health_check_interval_s": float(os.environ.get(
            c.HEALTH_CHECK_INTERVAL_S_ENV_VAR, c.DEFAULT_HEALTH_CHECK_INTERVAL_S)),
        "worker_health_check_timeout_s": float(os.environ.get(
            c.WORKER_HEALTH_CHECK_TIMEOUT_S_ENV_VAR, c.DEFAULT_WORKER_HEALTH_CHECK_TIMEOUT_S)),
        "worker_group_start_timeout_s": float(os.environ.get(
            c.WORKER_GROUP_START_TIMEOUT_S_ENV_VAR, c.DEFAULT_WORKER_GROUP_START_TIMEOUT_S)),
    }


def start_fit(trainer: Any, fit_out: dict[str, Any]) -> threading.Thread:
    """`trainer.fit()` on a thread of its own, so the caller can watch and kill meanwhile;
    its error (None when it succeeded) lands in fit_out["error"] when it returns."""
    def fit() -> None:
        try:
            res = trainer.fit()
            fit_out["error"] = None if res.error is None else repr(res.error)
        except BaseException as e:  # reported, not raised
            fit_out["error"] = repr(e)

    thread = threading.Thread(target=fit, name="raytrain-fit", daemon=True)
    thread.start()
    return thread


def run_raytrain(fault: str, *, steps: int, fault_step: int, checkpoint_every: int = 10,
                 workdir: Path, timeout_s: float, hang_wait_s: float = 120,
                 num_cpus: int = NUM_WORKERS, config: str | Path = DEFAULT_CONFIG,
                 overrides: list[str] | None = None,
                 replace_node_after: str | float = "dead",
                 health_check_timeout_s: float | None = None,
                 commit_checkpoints: bool = False) -> dict[str, Any]:
    """One Ray Train run of `steps` steps with one fault on rank 1 at the start of `fault_step`.

    workdir must not exist or be empty; it holds Ray Train's storage (workdir/storage) and the
    timestamp files. num_cpus: the CPUs of the local Ray started for "kill" and "hang" (the
    controller takes 0, each worker 1); "node" ignores it (head 0 CPUs, 1 per worker node).
    overrides: `--set` overrides of config (default TINY); train.steps and
    scaling.num_workers are added. replace_node_after ("node" only): "dead" adds the
    replacement node once the GCS reports the killed node dead, a number that many seconds
    after the fault. health_check_timeout_s: sets RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S for
    this run (default: Ray Train's own, 600 s). commit_checkpoints: after each checkpoint
    report rank 0 also waits in `ray.train.get_all_reported_checkpoints(COMMITTED)` until the
    controller has registered it. Without it (the default, the plain loop of Ray Train's
    docs) a checkpoint counts only once the controller's next poll of the workers (every
    health_check_interval_s = 2 s) has taken it from the worker's queue: a worker that dies
    before that poll loses it, though its files are already in storage.
    """
    if fault not in (*FAULTS, OUTSIDE_KILL):
        raise ValueError(f"fault must be one of {(*FAULTS, OUTSIDE_KILL)}, got {fault!r}")
    if not 1 <= fault_step <= steps:
        raise ValueError(f"fault_step={fault_step} must be in [1, steps={steps}]")
    if checkpoint_every < 1:
        raise ValueError("checkpoint_every must be >= 1")
    if replace_node_after != "dead" and not isinstance(replace_node_after, int | float):
        raise ValueError('replace_node_after must be "dead" or a number of seconds')

    import ray
    import ray.cloudpickle
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.train.v2._internal.constants import is_v2_enabled

    if ray.is_initialized():
        raise RuntimeError("run_raytrain starts its own Ray: call it with no Ray initialised")
    workdir = Path(workdir).resolve()
    if workdir.exists() and any(workdir.iterdir()):
        raise ValueError(f"workdir {workdir} is not empty")
    workdir.mkdir(parents=True, exist_ok=True)

    overrides = list(TINY if overrides is None else overrides)
    overrides += [f"train.steps={steps}", f"scaling.num_workers={NUM_WORKERS}"]
    job = load_config(config, overrides)
    task = build_task(job.task.path, job.task.args)
    task.prepare_data(job)  # tokenize once here, not in the timed run
    torch_config = TorchConfig()  # Ray Train's defaults: gloo on CPU, timeout_s=1800

    saved_env = os.environ.get("RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S")
    if health_check_timeout_s is not None:
        os.environ["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"] = str(health_check_timeout_s)
    v2 = is_v2_enabled()
    result: dict[str, Any] = {
        "fault": fault, "ray_train_version": ray.__version__, "v2": v2,
        "ray_train_v2_enabled_env": os.environ.get("RAY_TRAIN_V2_ENABLED"),  # None: default
        "steps": steps, "fault_step": fault_step, "checkpoint_every": checkpoint_every,
        "num_workers": NUM_WORKERS, "overrides": overrides,
        "commit_checkpoints": commit_checkpoints,
        "torch_config_timeout_s": torch_config.timeout_s, "torch_backend": "gloo",
        **_health_settings(),
    }

    # The train loop and the bench modules it uses travel by value: a worker need not have
    # the repository on its path.
    ray.cloudpickle.register_pickle_by_value(bench)

    cluster = None
    session_dir: str | None = None
    abort_time: float | None = None
    node_info: dict[str, Any] = {}
    fit_out: dict[str, Any] = {}
    t_start = time.time()
    try:
        # A Cluster for every fault, so that the address is known before ray.init: Ray Train's
        # PlacementGroupCleaner queries the State API with no address, which otherwise picks
        # "the latest" of all Ray instances on the machine (another test's, say) and removes
        # this run's placement group if the controller is not found there. RAY_ADDRESS in the
        # job's runtime env pins it to this cluster (no dashboard: the query fails, harmlessly).
        from ray.cluster_utils import Cluster

        head_cpus = 0 if fault == "node" else num_cpus
        cluster = Cluster(initialize_head=True,
                          head_node_args={"num_cpus": head_cpus, "include_dashboard": False})
        if fault == "node":
            for _ in range(NUM_WORKERS):
                cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
            node_info["replace_node_after"] = replace_node_after
        ray.init(address=cluster.address,
                 runtime_env={"env_vars": {"RAY_ADDRESS": cluster.address}})

        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={
                "workdir": str(workdir), "config": str(config), "overrides": overrides,
                # outside-kill: the workers inject nothing (no step is step 0)
                "fault": fault, "fault_step": 0 if fault == OUTSIDE_KILL else fault_step,
                "checkpoint_every": checkpoint_every,
                "commit_checkpoints": commit_checkpoints,
            },
            torch_config=torch_config,
            scaling_config=ScalingConfig(num_workers=NUM_WORKERS, use_gpu=False,
                                         resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name=f"raytrain-{fault}", storage_path=str(workdir / "storage"),
                                 failure_config=FailureConfig(max_failures=3)),
        )

        thread = start_fit(trainer, fit_out)
        deadline = t_start + timeout_s
        aborted: str | None = None
        killed_pids: list[int] = []
        killer = None
        if fault == OUTSIDE_KILL:
            killer = OutsideKill(
                after_step=fault_step,
                logged_step=lambda: last_logged(read_jsonl(workdir / STEPS_FILE)),
                rank_pid=lambda: rank_pid(read_jsonl(workdir / ATTEMPTS_FILE), 1))
        while thread.is_alive():
            thread.join(0.2 if killer is None else KILL_POLL_S)
            if killer is not None and not killer.done:
                killer.tick()
                if killer.time is not None:  # what the rank writes before an inside fault
                    _write_json_atomic(workdir / FAULT_FILE, {
                        "fault": fault, "time": killer.time, "pid": killer.pid,
                        "step_logged": killer.step_logged})
            now = time.time()
            info = read_fault(workdir)
            if info is not None and fault == "node":
                if "dead_time" not in node_info and _node_alive(info["node_id"]) is False:
                    node_info["dead_time"] = time.time()  # the GCS has noticed
                due = ("dead_time" in node_info if replace_node_after == "dead"
                       else now >= info["time"] + float(replace_node_after))
                if due and "replacement_added" not in node_info:
                    cluster.add_node(num_cpus=1)
                    node_info["replacement_added"] = time.time()
            if info is not None and fault == "hang" and now > info["time"] + hang_wait_s:
                restarted = any(a["event"] == "start" and a["time"] > info["time"]
                                for a in read_jsonl(workdir / ATTEMPTS_FILE))
                if not restarted and aborted is None:
                    aborted = f"hang not detected within hang_wait_s={hang_wait_s:g}"
            if aborted is None and now > deadline:
                aborted = f"timeout_s={timeout_s:g} reached"
            if aborted is not None and not (workdir / STOP_FILE).exists():
                # Stop the run: every train loop that sees the stop file returns; the stopped
                # (or stuck) rank gets SIGKILLed so that Ray Train tears the group down.
                abort_time = time.time()
                (workdir / STOP_FILE).write_text(json.dumps({"time": abort_time,
                                                             "reason": aborted}))
                if info is not None and _proc_state(info["pid"]) == "T":
                    if sigkill(info["pid"]):
                        killed_pids.append(info["pid"])
                deadline = time.time() + 120  # for the teardown itself
            elif aborted is not None and now > deadline:
                break  # teardown stuck: ray.shutdown() below ends it
        session_dir = ray_session_dir()
        result["fit_error"] = fit_out.get("error", "fit did not return")
        result["aborted"] = aborted
        result["harness_killed_pids"] = killed_pids
        if killer is not None:
            result["outside_kill"] = killer.record()
    finally:
        try:
            ray.shutdown()
        finally:
            if cluster is not None:
                cluster.shutdown()
            if health_check_timeout_s is not None:
                if saved_env is None:
                    os.environ.pop("RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S", None)
                else:
                    os.environ["RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S"] = saved_env
    result["wall_s"] = time.time() - t_start

    # Any process the run started that outlived the shutdown (a stopped one would): kill it.
    attempts = read_jsonl(workdir / ATTEMPTS_FILE)
    info = read_fault(workdir)
    pids = {a["pid"] for a in attempts} | set((info or {}).get("other_node_pids", []))
    time.sleep(1.0)
    leftover = sorted(p for p in pids if _proc_state(p) not in (None, "Z"))
    for p in leftover:
        sigkill(p)
    result["leftover_pids_killed"] = leftover

    result.update(analyse(workdir, attempts, info, fault, steps, node_info))
    result.update(controller_events(session_dir, info["time"] if info else None,
                                     abort_time))
    result["abort_s"] = None if abort_time is None or info is None else abort_time - info["time"]
    if fault == "hang":
        result["notes"].append(
            f"hang: Ray Train has no hang detection besides its controller's worker health "
            f"check ({result['worker_health_check_timeout_s']:g} s; the stopped actor cannot "
            f"answer) and the torch process-group timeout ({result['torch_pg_timeout_s']} s, "
            f"rank 0 waits that long in the all-reduce); the harness waited "
            f"hang_wait_s={hang_wait_s:g} s.")
    if fault == "node":
        result["notes"].append(
            "node: rank 1 SIGKILLed its raylet, the raylet's other children and itself; the "
            "driver added a replacement 1-CPU node "
            + ("once the GCS reported the node dead." if replace_node_after == "dead"
               else f"{float(replace_node_after):g} s after the fault."))
    lost_ckpt = result.get("last_checkpoint_before_fault")
    if (result["restored_from_step"] is not None and lost_ckpt is not None
            and result["restored_from_step"] < lost_ckpt):
        result["notes"].append(
            f"the checkpoint of step {lost_ckpt} was reported (and written to storage) before "
            f"the fault but never registered: the controller had not yet polled it from the "
            f"worker's queue (poll every {result['health_check_interval_s']:g} s), so the run "
            f"restored from step {result['restored_from_step']}.")
    result["detected"] = result["detection_s"] is not None
    result["completed"] = (result["fit_error"] is None and result["aborted"] is None
                           and result["final_step"] == steps)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fault", choices=(*FAULTS, OUTSIDE_KILL), required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--fault-step", type=int, default=25)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds allowed for the run")
    p.add_argument("--hang-wait", type=float, default=120.0,
                   help="hang: seconds to wait for Ray Train to notice before giving up")
    p.add_argument("--num-cpus", type=int, default=NUM_WORKERS)
    p.add_argument("--replace-node-after", default="dead",
                   help='node: "dead" (when the GCS reports the node dead) or seconds')
    p.add_argument("--health-check-timeout", type=float, default=None,
                   help="RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S for this run (default 600)")
    p.add_argument("--commit-checkpoints", action="store_true",
                   help="rank 0 waits until each checkpoint is registered (see run_raytrain)")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="stalwart TOML config")
    p.add_argument("--set", dest="overrides", action="append", default=None,
                   metavar="KEY=VALUE", help="config override (repeatable; default: TINY)")
    p.add_argument("--workdir", default=None, help="default: a fresh temporary folder")
    p.add_argument("--keep", action="store_true", help="keep the temporary workdir")
    p.add_argument("--step-times", action="store_true", help="keep step_times in the output")
    p.add_argument("--out", default=None,
                   help="also write the JSON here (stdout carries Ray's worker logs too)")
    args = p.parse_args()
    replace = args.replace_node_after
    replace = replace if replace == "dead" else float(replace)
    tmp = None
    if args.workdir is None:
        tmp = tempfile.mkdtemp(prefix=f"raytrain-{args.fault}-")
    workdir = Path(args.workdir or tmp)
    try:
        out = run_raytrain(args.fault, steps=args.steps, fault_step=args.fault_step,
                           checkpoint_every=args.checkpoint_every, workdir=workdir,
                           timeout_s=args.timeout, hang_wait_s=args.hang_wait,
                           num_cpus=args.num_cpus, config=args.config,
                           overrides=args.overrides, replace_node_after=replace,
                           health_check_timeout_s=args.health_check_timeout,
                           commit_checkpoints=args.commit_checkpoints)
    finally:
        if tmp is not None and not args.keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    if not args.step_times:
        out.pop("step_times", None)
    out["workdir"] = str(workdir) if (args.keep or args.workdir) else None
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
