"""Recovery: how fast stalwart and Ray Train's TorchTrainer notice and recover from a fault.

The reference task (`examples/gpt/config.toml`) with the tiny model of tests/cli_helpers.py
(seq_len 64, d_model 64, 2 blocks, 2 heads, global batch 8, micro batch 2) on 2 workers,
40 steps, a storage checkpoint every 10 steps, one fault on rank 1 at the start of step 25:

  kill   SIGKILL the worker process
  hang   SIGSTOP the worker process (alive, silent, holding its peer in the all-reduce)
  node   lose a whole node: on a local multi-node cluster (ray.cluster_utils.Cluster: a
         0-CPU head for the driver, one 1-CPU node per worker) the node of rank 1 loses its
         raylet and every process on it at once

Rows, each measured on its own Ray:

  stalwart          `stalwart run examples/gpt/config.toml --set ... --inject FAULT --run-dir DIR`
                    exactly as a user types it, with the in-memory checkpoint tier (the
                    default: a snapshot every step, replicated to a peer; restored first) and
                    no spare (`scaling.spare_workers=0`): the
                    replacement is a cold actor (own embedded Ray with 2 CPUs); everything is
                    read from DIR/events.jsonl (`fault_injected`, `failure`, `recovered`,
                    `resized`, `finished`) and DIR/metrics.jsonl
  stalwart+spare    the same with one warm spare (`scaling.spare_workers=1`; the embedded Ray
                    adds a logical CPU for it, since it idles); kill, hang
  stalwart+spare, storage only
                    the same with the memory tier off (`checkpoint.snapshot_every=0`): it
                    restores from the storage checkpoint (every 10 steps); kill
  stalwart elastic  node only: `--address <cluster>` `--inject kill-node:node=2,step=25`
                    `scaling.min_workers=1 scaling.resize_check_s=2`: it shrinks to the
                    surviving worker at once; a replacement 1-CPU node is added as soon as the
                    GCS reports the lost node dead (the same policy as the Ray Train side), so
                    that it can grow back; and the same with the memory tier off
  ray-train         bench/raytrain_recovery.py `run_raytrain(fault, commit_checkpoints=True,
                    hang_wait_s=60)`: TorchTrainer, FailureConfig(max_failures=3), a checkpoint
                    every 10 steps which rank 0 waits to see registered (else Ray Train loses
                    the newest one to a registration race and restores an older one)

Both sides use Ray's default node health checks (no `_system_config` for them on either
cluster); Ray Train's own worker health check keeps its default (600 s).

Measured per run (seconds, one machine's time.time()):

  detection_s   fault -> the controller decides it is a failure. stalwart: `failure`
                event's detection_s; Ray Train: its controller's FailurePolicy decision
                (controller_failure_s of run_raytrain); a hang Ray Train does not notice
                within 60 s is "not detected"
  restart_s     fault -> the new world is up (stalwart: the next `workers_started`; Ray
                Train: the first train-loop start of a new attempt, run_raytrain's own
                detection_s, an upper bound of its detection)
  recovery_s    fault -> the first step completed after the fault (stalwart: the
                `recovered` event's recovery_s, cross-checked against metrics.jsonl)
  lost_steps    steps completed before the fault - the step restored from

    python bench/recovery.py [--rounds 1] [--faults kill hang node] [--keep]
                             [--out bench/results/recovery.json] [--png bench/results/recovery.png]

Targets (printed with MET / NOT MET): a kill recovered at least 10x faster than Ray Train
(median recovery_s of Ray Train / median of stalwart, for each stalwart row); a hang detected
within 10 s (every round, each stalwart row); zero lost completed steps with the memory tier,
and no more than the steps since the last storage checkpoint due without it (every round,
every stalwart row). The exit code is 0 whether or
not the targets are met; 1 only if a run produced no measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
from raytrain_recovery import TINY, run_raytrain

DEFAULT_OUT = common.ROOT / "bench" / "results" / "recovery.json"
DEFAULT_PNG = common.ROOT / "bench" / "results" / "recovery.png"
FAULTS = ("kill", "hang", "node")
WORKERS = 2
STEPS = 40
FAULT_STEP = 25
PERSIST_EVERY = 10
HANG_WAIT_S = 60.0
TARGET_KILL_RATIO = 10.0
TARGET_HANG_DETECTION_S = 10.0

# Every stalwart run: the tiny model, a storage checkpoint every 10 steps, a metrics row every
# step, no validation, plain log lines, up to 3 recoveries.
STALWART_OVERRIDES = [
    *TINY, f"train.steps={STEPS}", f"checkpoint.persist_every={PERSIST_EVERY}",
    "run.log_every=1", "data.val_every=0", "run.progress=false", "failure.max_failures=3",
    f"scaling.num_workers={WORKERS}",
]
SPARE = ["scaling.spare_workers=1"]
NO_SPARE = ["scaling.spare_workers=0"]  # whatever the config says
ELASTIC = ["scaling.min_workers=1", "scaling.resize_check_s=2", "scaling.spare_workers=0"]
STORAGE_ONLY = ["checkpoint.snapshot_every=0"]  # the in-memory tier off
INJECT = {"kill": f"kill:rank=1,step={FAULT_STEP}", "hang": f"hang:rank=1,step={FAULT_STEP}",
          "node": f"kill-node:node=2,step={FAULT_STEP}"}

# (runner, label) per fault, in the order of a round.
RUNNERS = {
    "kill": [("stalwart", "stalwart"), ("stalwart+spare", "stalwart + warm spare"),
             ("stalwart+spare/storage", "stalwart + spare, storage"), ("ray-train", "Ray Train")],
    "hang": [("stalwart", "stalwart"), ("stalwart+spare", "stalwart + warm spare"),
             ("ray-train", "Ray Train")],
    "node": [("stalwart-elastic", "stalwart (shrink)"),
             ("stalwart-elastic/storage", "stalwart (shrink), storage"),
             ("ray-train", "Ray Train")],
}
NODE_HEAD_ARGS: dict[str, Any] = {"num_cpus": 0, "include_dashboard": False,
                                  "_system_config": {"worker_niceness": 0}}
POLL_S = 0.2  # how often the node run checks the GCS (as run_raytrain does)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat every measurement this many times; medians are reported")
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS),
                   help="faults to measure (default: all)")
    p.add_argument("--config", default=str(common.DEFAULT_CONFIG), help="stalwart TOML config")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON result file")
    p.add_argument("--png", default=str(DEFAULT_PNG), help="bar chart")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per run")
    p.add_argument("--keep", action="store_true", help="keep the temporary run directories")
    args = p.parse_args()
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    args.faults = [f for f in FAULTS if f in args.faults]
    return args


# ----------------------------------------------------------------------------------------------
# stalwart
# ----------------------------------------------------------------------------------------------

def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def run_cli(cmd: list[str], log: Path, timeout: float,
            tick: Callable[[], None] | None = None) -> tuple[int, float]:
    """Run the CLI with output to log, calling tick() every POLL_S; (exit code, wall s).

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
            time.sleep(POLL_S)
        code = proc.returncode if stage == 0 else -1
    return code, time.perf_counter() - t0


def analyse_stalwart(run_dir: Path, fault: str, memory_tier: bool) -> dict[str, Any]:
    """The measurements of one stalwart run, from its events.jsonl and metrics.jsonl."""
    events = read_jsonl(run_dir / "events.jsonl")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    kinds = [e["kind"] for e in events]

    def first(kind: str) -> dict[str, Any] | None:
        return next((e for e in events if e["kind"] == kind), None)

    injected, failure, recovered = first("fault_injected"), first("failure"), first("recovered")
    out: dict[str, Any] = {
        "events": events, "event_kinds": kinds,
        "fault_time": None, "detected": failure is not None, "failure_kind": None,
        "detection_s": None, "restart_s": None, "recovery_s": None,
        "recovery_s_from_metrics": None, "lost_steps": None, "restored_from_step": None,
        "source": None, "phases": None, "steps_before_fault": None,
        "last_checkpoint_before_fault": None, "lost_steps_bound": None,
        "resized": [{k: e.get(k) for k in ("old_world_size", "new_world_size", "reason",
                                           "step", "time")} for e in events
                    if e["kind"] == "resized"],
        "world_sizes": sorted({r["world_size"] for r in rows}),
        "final_step": max((r["step"] for r in rows), default=0),
        "finished": bool(kinds) and kinds[-1] == "finished",
        "missing_events": [k for k, e in (("fault_injected", injected), ("failure", failure),
                                          ("recovered", recovered)) if e is None],
    }
    if fault == "node" and not out["resized"]:
        out["missing_events"].append("resized")
    if not kinds or kinds[-1] != "finished":
        out["missing_events"].append("finished (last event: "
                                     f"{kinds[-1] if kinds else 'none'})")
    if injected is None:
        return out
    ft = injected["time"]
    out["fault_time"] = ft
    out["fault_rank"] = injected.get("rank")
    started = [e for e in events if e["kind"] == "workers_started"]
    if fault == "node" and started and injected.get("rank") is not None:
        workers = started[0].get("workers") or []
        if injected["rank"] < len(workers):
            out["killed_node_id"] = workers[injected["rank"]]["node_id"]
        out["first_world_nodes"] = {w["rank"]: w["node_id"] for w in workers}
    committed = [e["step"] for e in events[:events.index(injected)]
                 if e["kind"] == "checkpoint_committed"]
    out["last_checkpoint_before_fault"] = max(committed, default=None)
    if failure is not None:
        out["failure_kind"] = failure["failure_kind"]
        out["detection_s"] = failure.get("detection_s")
        out["steps_before_fault"] = failure["step"]
        # With the memory tier: none (every completed step is in memory); without it, the
        # steps since the last storage checkpoint due (every persist_every steps).
        out["lost_steps_bound"] = 0 if memory_tier else failure["step"] % PERSIST_EVERY
        out["failure"] = {k: v for k, v in failure.items() if k != "message"}
    if kinds and kinds[-1] == "finished":
        out["finished_s"] = events[-1]["time"] - ft
    later_starts = [e["time"] for e in started if e["time"] > ft]
    if later_starts:
        out["restart_s"] = min(later_starts) - ft
    if recovered is not None:
        out["recovery_s"] = recovered["recovery_s"]
        out["lost_steps"] = recovered["lost_steps"]
        out["restored_from_step"] = recovered["from_step"]
        out["source"] = recovered["source"]
        out["phases"] = recovered["phases"]
        out["restore_s"] = recovered["phases"].get("restore")
        out["world_size_after"] = recovered["world_size"]
        # The same from metrics.jsonl: fault -> the first row of the restored step + 1.
        again = [r["time"] for r in rows
                 if r["time"] > ft and r["step"] == recovered["from_step"] + 1]
        if again:
            out["recovery_s_from_metrics"] = min(again) - ft
    return out


def stalwart_overrides(runner: str) -> list[str]:
    base, _, tier = runner.partition("/")
    extra = {"stalwart": NO_SPARE, "stalwart+spare": SPARE, "stalwart-elastic": ELASTIC}[base]
    return [*STALWART_OVERRIDES, *extra, *(STORAGE_ONLY if tier == "storage" else [])]


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
        if fault != "node":
            result["command"] = cmd
            code, wall = run_cli(cmd, log, args.timeout)
        else:
            code, wall = run_stalwart_node(cmd, run_dir, log, args.timeout, result)
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
                      result: dict[str, Any]) -> tuple[int, float]:
    """The node fault: the CLI against a local 3-node cluster; a replacement node is added as
    soon as the GCS reports the lost node dead (run_raytrain's replace_node_after="dead")."""
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
                events = read_jsonl(events_path)
                fired = next((e for e in events if e["kind"] == "fault_injected"), None)
                started = next((e for e in events if e["kind"] == "workers_started"), None)
                if fired is None or started is None:
                    return
                node["fault_time"] = fired["time"]
                node["killed_node_id"] = started["workers"][fired["rank"]]["node_id"]
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


# ----------------------------------------------------------------------------------------------
# Ray Train
# ----------------------------------------------------------------------------------------------

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
                               num_cpus=WORKERS, config=args.config, overrides=list(TINY),
                               replace_node_after="dead", commit_checkpoints=True)
    except Exception as exc:  # recorded, the other runs go on
        import traceback

        return {"system": "ray-train", "runner": "ray-train", "fault": fault, "round": rnd,
                "load_before": load, "log": str(log), "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(), "log_tail": common.tail(log, 25),
                "completed": False, "detected": False, "detection_s": None,
                "restart_s": None, "recovery_s": None, "lost_steps": None, "fault_time": None}
    raw.pop("step_times", None)
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
    if not out["detected"] and fault == "hang":
        out["not_detected_within_s"] = HANG_WAIT_S
    if not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        out["workdir"] = str(workdir)
    return out


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------

def one_line(r: dict[str, Any]) -> str:
    def s(x: Any, spec: str = "6.2f") -> str:
        return common.fmt(x, spec)

    tag = f"r{r['round']}-{r['fault']}-{r['runner']}"
    if r.get("error"):
        return f"  {tag}: FAILED ({r['error']})"
    extra = ""
    if r["system"] == "ray-train" and r["fault"] == "hang" and not r["detected"]:
        extra = f"  (not detected within {HANG_WAIT_S:g} s)"
    if r.get("resized"):
        extra += "  resized " + ", ".join(f"{e['old_world_size']}->{e['new_world_size']} "
                                          f"({e['reason']})" for e in r["resized"])
    if r.get("missing_events"):
        extra += f"  MISSING EVENTS: {', '.join(r['missing_events'])}"
    if not r.get("completed"):
        extra += "  NOT COMPLETED"
    return (f"  {tag}: detection {s(r['detection_s'])} s, recovery {s(r['recovery_s'])} s, "
            f"lost {common.fmt(r['lost_steps'], '3d')} steps, load "
            f"{r['load_before']:.2f}{extra}")


def median(vals: list[float | int | None]) -> float | None:
    xs = [v for v in vals if v is not None]
    return statistics.median(xs) if xs else None


def summarise(results: list[dict[str, Any]], faults: list[str]) -> dict[str, Any]:
    """Medians per fault and runner."""
    out: dict[str, Any] = {}
    for fault in faults:
        out[fault] = {}
        for runner, label in RUNNERS[fault]:
            rs = [r for r in results if r["fault"] == fault and r["runner"] == runner]
            out[fault][runner] = {
                "label": label, "runs": len(rs),
                "detected": sum(bool(r.get("detected")) for r in rs),
                "completed": sum(bool(r.get("completed")) for r in rs),
                **{k: median([r.get(k) for r in rs])
                   for k in ("detection_s", "restart_s", "recovery_s", "restore_s", "lost_steps",
                             "restored_from_step", "lost_steps_bound")},
                "sources": sorted({str(r.get("source")) for r in rs}),
                "max_detection_s": max((r["detection_s"] for r in rs
                                        if r.get("detection_s") is not None), default=None),
            }
    return out


def verdicts(results: list[dict[str, Any]], med: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    if "kill" in med:
        rt = med["kill"]["ray-train"]["recovery_s"]
        for runner in ("stalwart", "stalwart+spare", "stalwart+spare/storage"):
            st = med["kill"][runner]["recovery_s"]
            ratio = rt / st if rt is not None and st else None
            out.append({
                "target": f"kill: Ray Train recovery_s / {runner} recovery_s >= "
                          f"{TARGET_KILL_RATIO:g} (medians)",
                "value": ratio, "met": ratio is not None and ratio >= TARGET_KILL_RATIO,
                "detail": f"Ray Train {common.fmt(rt, '.2f')} s, {runner} "
                          f"{common.fmt(st, '.2f')} s"})
    if "hang" in med:
        for runner in ("stalwart", "stalwart+spare"):
            rs = [r for r in results if r["fault"] == "hang" and r["runner"] == runner]
            worst = (max(r["detection_s"] for r in rs) if rs and all(
                r.get("detection_s") is not None for r in rs) else None)
            out.append({
                "target": f"hang: {runner} detects the hang within "
                          f"{TARGET_HANG_DETECTION_S:g} s (every round)",
                "value": worst,
                "met": worst is not None and worst <= TARGET_HANG_DETECTION_S,
                "detail": f"worst detection {common.fmt(worst, '.2f')} s over {len(rs)} "
                          f"round(s); Ray Train: " + (
                              "not detected within "
                              f"{HANG_WAIT_S:g} s" if not med["hang"]["ray-train"]["detected"]
                              else f"{common.fmt(med['hang']['ray-train']['detection_s'], '.2f')}"
                                   " s")})
    stalwart = [r for r in results if r["system"] == "stalwart"]
    bad = [r for r in stalwart if r.get("lost_steps") is None or r.get("lost_steps_bound") is None
           or r["lost_steps"] > r["lost_steps_bound"]]
    out.append({
        "target": "lost steps: 0 with the memory tier, <= steps since the last storage "
                  f"checkpoint due (checkpoint.persist_every={PERSIST_EVERY}) without; every "
                  "stalwart run",
        "value": max((r["lost_steps"] for r in stalwart if r.get("lost_steps") is not None),
                     default=None),
        "met": bool(stalwart) and not bad,
        "detail": "; ".join(f"r{r['round']}-{r['fault']}-{r['runner']}: lost "
                            f"{r.get('lost_steps')} > bound {r.get('lost_steps_bound')}"
                            for r in bad) or
                  ", ".join(f"{r['fault']}/{r['runner']} {r['lost_steps']}<={r['lost_steps_bound']}"
                            for r in stalwart)})
    return out


def print_table(med: dict[str, Any]) -> None:
    head = (f"{'fault':<5} | {'system':<26} | {'detect s':>8} | {'restart s':>9} | "
            f"{'restore s':>9} | {'recover s':>9} | {'lost':>4} | {'from':>4} | {'bound':>5} | "
            f"{'source':<8} | {'ok':>5}")
    print("\nrecovery (medians)\n" + head + "\n" + "-" * len(head))
    for fault, rows in med.items():
        for runner, m in rows.items():
            detect = common.fmt(m["detection_s"], "8.2f")
            if runner == "ray-train" and fault == "hang" and not m["detected"]:
                detect = f">{HANG_WAIT_S:g} n/d".rjust(8)
            source = ",".join(x for x in m.get("sources", []) if x != "None") or "-"
            print(f"{fault:<5} | {m['label']:<26} | {detect} | "
                  f"{common.fmt(m['restart_s'], '9.2f')} | {common.fmt(m.get('restore_s'), '9.2f')} | "
                  f"{common.fmt(m['recovery_s'], '9.2f')} | "
                  f"{common.fmt(m['lost_steps'], '4.0f')} | "
                  f"{common.fmt(m['restored_from_step'], '4.0f')} | "
                  f"{common.fmt(m['lost_steps_bound'], '5.0f')} | {source:<8} | "
                  f"{m['completed']}/{m['runs']:<3}")
    print("-" * len(head))
    print("detect: fault -> the controller decides it is a failure (n/d: not detected); "
          "restart: fault -> the new world is up;\nrestore: the load of the checkpoint "
          "(memory or storage); recover: fault -> the first step completed after it;\n"
          "lost: steps trained again; from: step restored from; bound: the most lost steps "
          f"allowed (0 with the memory tier, else steps since the last storage checkpoint due, "
          f"every {PERSIST_EVERY});\nsource: where the restore came from; ok: runs that "
          f"completed all {STEPS} steps")


def plot(png: str, med: dict[str, Any]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no chart")
        return None
    faults = list(med)
    colors = {"stalwart": "#1f77b4", "stalwart+spare": "#6baed6",
              "stalwart+spare/storage": "#9e9ac8", "stalwart-elastic": "#08519c",
              "stalwart-elastic/storage": "#756bb1", "ray-train": "#ff7f0e"}
    labels = {"stalwart": "stalwart (memory tier)",
              "stalwart+spare": "stalwart + warm spare (memory tier)",
              "stalwart+spare/storage": "stalwart + warm spare, storage only",
              "stalwart-elastic": "stalwart, shrinks on node loss (memory tier)",
              "stalwart-elastic/storage": "stalwart, shrinks, storage only",
              "ray-train": "Ray Train TorchTrainer"}
    width = 0.8 / max(len(med[f]) for f in faults)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, title in ((axes[0], "detection_s", "detection (fault -> failure decided)"),
                           (axes[1], "recovery_s", "recovery (fault -> first step after)")):
        labelled: set[str] = set()
        for j, fault in enumerate(faults):
            runners = list(med[fault])
            for i, runner in enumerate(runners):
                m, color = med[fault][runner], colors[runner]
                x = j - width * len(runners) / 2 + width * (i + 0.5)
                value = m[key]
                if value is None:
                    # Not detected / not recovered within the harness's wait: a hollow bar.
                    ax.bar(x, HANG_WAIT_S, width, color="none", edgecolor=color, hatch="//")
                    what = "detected" if key == "detection_s" else "recovered"
                    ax.text(x, HANG_WAIT_S * 1.1, f"not {what}\nwithin {HANG_WAIT_S:g} s",
                            ha="center", va="bottom", fontsize=7)
                    continue
                ax.bar(x, max(value, 1e-3), width, color=color,
                       label=None if runner in labelled else labels[runner])
                labelled.add(runner)
                ax.text(x, max(value, 1e-3) * 1.1, f"{value:.2g}", ha="center", va="bottom",
                        fontsize=7)
        ax.set_yscale("log")
        ax.set_ylim(1e-2, HANG_WAIT_S * 8)
        ax.set_xticks(range(len(faults)), [{"kill": "kill (SIGKILL)", "hang": "hang (SIGSTOP)",
                                            "node": "node loss"}[f] for f in faults])
        ax.set_ylabel("seconds (log scale)")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3, which="both")
    # Each target as a line over its own group of bars.
    if "kill" in med and med["kill"]["ray-train"]["recovery_s"]:
        j = faults.index("kill")
        axes[1].hlines(med["kill"]["ray-train"]["recovery_s"] / TARGET_KILL_RATIO, j - 0.45,
                       j + 0.45, color="black", ls=":", lw=1.2,
                       label=f"kill target: Ray Train / {TARGET_KILL_RATIO:g}")
    if "hang" in med:
        j = faults.index("hang")
        axes[0].hlines(TARGET_HANG_DETECTION_S, j - 0.45, j + 0.45, color="black", ls="--",
                       lw=1.2, label=f"hang target: {TARGET_HANG_DETECTION_S:g} s")
    legend: dict[str, Any] = {}  # one legend for both panels, below them
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center",
               ncol=min(4, len(legend)), fontsize=8, frameon=False)
    fig.suptitle(f"Recovery on the reference task (tiny GPT, {WORKERS} workers, fault on rank 1 "
                 f"at step {FAULT_STEP}), medians", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def git_revision() -> dict[str, Any]:
    """The commit the runs used (stalwart is installed in editable mode) and tracked changes."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=common.ROOT, capture_output=True,
                              text=True).stdout.rstrip("\n")

    return {"commit": git("rev-parse", "HEAD").strip() or None,
            "modified": sorted(line[3:] for line in git(
                "status", "--porcelain", "--untracked-files=no").splitlines())}


def main() -> int:
    args = parse_args()
    t_start = time.time()
    revision = git_revision()
    import ray
    import ray._raylet

    # Tokenize once up front (both sides read the same token files).
    tps, _ = common.tokens_per_step(args.config, stalwart_overrides("stalwart"))
    work = Path(tempfile.mkdtemp(prefix="stalwart-recovery-"))
    print(f"recovery: {args.rounds} round(s) x faults {args.faults}, {STEPS} steps, fault on "
          f"rank 1 at step {FAULT_STEP}, checkpoint every {PERSIST_EVERY}, {WORKERS} workers, "
          f"{os.cpu_count()} CPUs; runs in {work}", flush=True)

    results: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for fault in args.faults:
            runners = [r for r, _ in RUNNERS[fault]]
            # The order flips every round, so a drift in machine load favours no side.
            order = runners if rnd % 2 == 0 else runners[::-1]
            print(f"round {rnd + 1}/{args.rounds}, {fault}: {' -> '.join(order)}", flush=True)
            for runner in order:
                if runner == "ray-train":
                    r = run_ray_train(fault, args, work, rnd)
                else:
                    r = run_stalwart(runner, fault, args, work, rnd)
                results.append(r)
                print(one_line(r), flush=True)
                if r.get("log_tail"):
                    print(f"    last lines of {r['log']}:\n" + "\n".join(
                        "      " + line for line in r["log_tail"].splitlines()), flush=True)

    med = summarise(results, args.faults)
    print_table(med)
    checks = verdicts(results, med)
    print()
    for v in checks:
        print(f"target {v['target']}: {'MET' if v['met'] else 'NOT MET'} "
              f"(value {common.fmt(v['value'], '.2f')}; {v['detail']})")
    notes = [
        "Ray Train runs with commit_checkpoints=True: rank 0 waits until each checkpoint is "
        "registered by the controller, so that Ray Train restores from its newest checkpoint "
        "(the plain loop of its docs loses the step-20 checkpoint to a registration race "
        "when the fault comes before the controller's next 2 s poll).",
        "Ray Train detection_s is its controller's FailurePolicy decision (controller_failure_s); "
        "restart_s is the first train-loop start of a new attempt (run_raytrain's detection_s).",
        f"Ray Train does not detect the hang: its worker health check times out after "
        f"600 s by default and the torch process group after 1800 s; the harness waited "
        f"{HANG_WAIT_S:g} s, then stopped the run.",
        "Node loss: both sides on a local ray.cluster_utils.Cluster (a 0-CPU head, one 1-CPU "
        "node per worker) with Ray's default node health checks (health_check_period_ms="
        f"{ray._raylet.Config.health_check_period_ms()}, failure_threshold="
        f"{ray._raylet.Config.health_check_failure_threshold()}); the stalwart cluster also "
        "sets worker_niceness=0. A replacement 1-CPU node is added as soon as the GCS reports "
        "the lost node dead, on both sides.",
        "stalwart's fault time is the controller's acknowledgement of the fault (the worker "
        "carries it out right after); Ray Train's is written by the worker just before it.",
    ]
    for r in results:
        if (r["runner"] == "stalwart-elastic" and r.get("completed")
                and not any(e["reason"] == "grow" for e in r.get("resized", []))):
            if r.get("replacement_added_s") is None:
                why = ("before the GCS reported the lost node dead (Ray's default node health "
                       "checks), so no replacement node was added")
            else:
                why = (f"though a replacement node was added {r['replacement_added_s']:.1f} s "
                       "after the fault")
            notes.append(
                f"round {r['round'] + 1}, node: stalwart detected the loss by probing the "
                f"raylet, shrank to 1 worker and finished the run "
                f"{common.fmt(r.get('finished_s'), '.1f')} s after the fault on the surviving "
                f"worker, {why}: it did not grow back (the grow path is what "
                "tests/ray/test_cli_node_loss.py covers, on a longer run).")
    end_revision = git_revision()
    if end_revision != revision:  # someone committed or edited files while it ran
        changed = sorted(set(revision["modified"]) ^ set(end_revision["modified"]))
        notes.append(
            "the checkout changed during the benchmark: " + "; ".join(filter(None, [
                f"commit {revision['commit']} -> {end_revision['commit']}"
                if revision["commit"] != end_revision["commit"] else "",
                f"files modified or reverted: {', '.join(changed)}" if changed else ""]))
            + " (runs after the change may have used different code)")
    print("\nnotes:\n" + "\n".join(f"- {n}" for n in notes))

    png = plot(args.png, med)
    if png:
        print(f"wrote {png}")
    # Runs that went wrong (Ray Train not noticing the hang is the measurement, not a failure).
    failed = [r for r in results if r.get("error") or r.get("missing_events") or (
        not r.get("completed") and not (r["system"] == "ray-train" and r["fault"] == "hang"
                                        and not r.get("detected")))]
    wall = time.time() - t_start
    import importlib.metadata

    import matplotlib
    import torch

    report = {
        "bench": "recovery",
        "time": t_start,
        "wall_s": wall,
        "targets": checks,
        "all_targets_met": all(v["met"] for v in checks),
        "medians": med,
        "notes": notes,
        "settings": {
            "rounds": args.rounds, "faults": args.faults, "steps": STEPS,
            "fault_step": FAULT_STEP, "persist_every": PERSIST_EVERY, "workers": WORKERS,
            "tokens_per_step": tps, "config": args.config,
            "stalwart_overrides": STALWART_OVERRIDES, "stalwart_spare": SPARE,
            "stalwart_elastic": ELASTIC, "inject": INJECT, "hang_wait_s": HANG_WAIT_S,
            "raytrain": {"commit_checkpoints": True, "hang_wait_s": HANG_WAIT_S,
                         "replace_node_after": "dead", "overrides": TINY,
                         "checkpoint_every": PERSIST_EVERY},
            "ray_node_health_checks": {
                "health_check_period_ms": ray._raylet.Config.health_check_period_ms(),
                "health_check_failure_threshold":
                    ray._raylet.Config.health_check_failure_threshold(),
                "health_check_initial_delay_ms":
                    ray._raylet.Config.health_check_initial_delay_ms(),
                "health_check_timeout_ms": ray._raylet.Config.health_check_timeout_ms()},
        },
        "git": {"at_start": revision, "at_end": end_revision},
        "versions": {"stalwart": importlib.metadata.version("stalwart"),
                     "torch": torch.__version__, "ray": ray.__version__,
                     "matplotlib": matplotlib.__version__},
        "png": png,
    }
    if not args.keep and not failed:
        shutil.rmtree(work, ignore_errors=True)
        for r in results:
            r.pop("log", None)
            r.pop("run_dir", None)
    elif failed:
        print(f"kept {work}: {len(failed)} run(s) did not complete or missed events")
    common.write_report(args.out, report, results)
    print(f"whole benchmark: {wall / 60:.1f} min")
    return 1 if any(r.get("error") or r.get("fault_time") is None for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
