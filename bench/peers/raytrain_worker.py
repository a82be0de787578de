"""Ray Train's side of the benchmarks, the worker half: what each TorchTrainer worker runs
(`train_loop_per_worker`), the fault it injects on itself, and the files it leaves in workdir.
bench/peers/raytrain_recovery.py starts it and measures it."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.common import append_jsonl, write_atomic
from bench.harness import signal_pid
from bench.peers.ddp_step import DDPSetup, build_ddp
from stalwart.core.config import load_config

NUM_WORKERS = 2

# Files in workdir; every time is time.time() of one machine, comparable across processes.
STEPS_FILE = "steps.jsonl"        # rank 0: {"step", "time", "loss", "pid"} per completed step
ATTEMPTS_FILE = "attempts.jsonl"  # every rank: {"event": "start"|"ready", "time", "rank", ...}
FAULT_FILE = "fault.json"         # rank 1: {"fault", "time", "pid", ...}, written before the fault
MARKER_FILE = "fault.injected"    # created with O_EXCL: a restarted attempt injects nothing
STOP_FILE = "stop"                # harness: every train loop that sees it returns at once
CHECKPOINTS_FILE = "checkpoints.jsonl"  # rank 0: {"step", "time", "pid"} after report()
STATE_FILE = "state.pt"           # inside each Ray Train checkpoint


def write_json_atomic(path: Path, row: dict[str, Any]) -> None:
    write_atomic(path, lambda f: json.dump(row, f))  # the harness reads it meanwhile


def _pg_timeout_s() -> float | None:
    """The timeout of the default process group Ray Train set up (best effort)."""
    try:
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except Exception:
        return None


def _inject(fault: str, workdir: Path) -> None:
    """Rank 1, first attempt, start of step fault_step: record the time, then the fault."""
    import ray

    from stalwart.workers.faults import children_of, raylet_pid

    me = os.getpid()
    row: dict[str, Any] = {"fault": fault, "pid": me,
                           "node_id": ray.get_runtime_context().get_node_id()}
    if fault == "node":  # the whole node at once, as when a machine dies
        raylet = raylet_pid()  # the worker's parent, checked by name
        # Listed now: once the raylet is gone they are reparented.
        row.update(raylet_pid=raylet, other_node_pids=[p for p in children_of(raylet) if p != me])
    row["time"] = time.time()
    write_json_atomic(workdir / FAULT_FILE, row)
    if fault == "hang":
        os.kill(me, signal.SIGSTOP)
        return
    for pid in filter(None, [row.get("raylet_pid"), *row.get("other_node_pids", []), me]):
        signal_pid(pid, signal.SIGKILL)


def _maybe_inject(cfg: dict[str, Any], rank: int, step: int, workdir: Path) -> None:
    if step + 1 != cfg["fault_step"] or rank != 1 or (workdir / FAULT_FILE).exists():
        return
    try:
        os.close(os.open(workdir / MARKER_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # injected by an earlier attempt
    _inject(cfg["fault"], workdir)


def _report(run: DDPSetup, rank: int, loss: float, workdir: Path) -> None:
    """ray.train.report on every rank, rank 0 with the checkpoint."""
    import ray.train
    from ray.train import Checkpoint, CheckpointConsistencyMode

    metrics = {"step": run.step, "loss": loss}
    if rank != 0:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="raytrain-ckpt-") as tmp:
        torch.save(run.state_dict(), Path(tmp) / STATE_FILE)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
    # A reported checkpoint counts only once the controller's next poll (every 2 s) takes it
    # from this worker's queue; until then it dies with the worker.
    ray.train.get_all_reported_checkpoints(consistency_mode=CheckpointConsistencyMode.COMMITTED)
    append_jsonl(workdir / CHECKPOINTS_FILE, {"step": run.step, "time": time.time(),
                                              "pid": os.getpid()})


def train_loop_per_worker(cfg: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker: the reference task, as bench/peers/torchrun_ddp.py."""
    import ray.train

    torch.set_num_threads(1)
    workdir = Path(cfg["workdir"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    node_id = ray.get_runtime_context().get_node_id()
    stopping = (workdir / STOP_FILE).exists()
    append_jsonl(workdir / ATTEMPTS_FILE, {
        "event": "start", "time": time.time(), "rank": rank, "world": world, "pid": os.getpid(),
        "ppid": os.getppid(), "node_id": node_id, "stopping": stopping})
    if stopping:
        return
    config = load_config(cfg["config"], cfg["overrides"])
    t = config.train
    run = build_ddp(config, world)
    if (checkpoint := ray.train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            run.load(torch.load(Path(d) / STATE_FILE, weights_only=False))
    append_jsonl(workdir / ATTEMPTS_FILE, {
        "event": "ready", "time": time.time(), "rank": rank, "pid": os.getpid(),
        "node_id": node_id, "restored_from": run.step if checkpoint is not None else None,
        "pg_timeout_s": _pg_timeout_s()})
    while run.step < t.steps and not (workdir / STOP_FILE).exists():
        _maybe_inject(cfg, rank, run.step, workdir)
        loss_sum, _ = run.rank_step(rank, world)
        if rank == 0:
            append_jsonl(workdir / STEPS_FILE, {"step": run.step, "time": time.time(),
                                                "loss": loss_sum / world, "pid": os.getpid()})
        if run.step % cfg["checkpoint_every"] == 0 or run.step == t.steps:
            _report(run, rank, loss_sum / world, workdir)
