"""Ray Train's side of the recovery benchmark, the worker half: what each TorchTrainer worker
runs (`train_loop_per_worker`), the fault it injects, and the files it leaves in workdir.

bench/peers/raytrain_recovery.py is the harness that starts it and measures it; its docstring says
what is trained, the faults and the files.
"""

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

from bench.common import append_jsonl
from bench.peers.ddp_step import build_ddp
from stalwart.core.config import load_config
from stalwart.workers.sampler import rank_slice

FAULTS = ("kill", "hang", "node")
NUM_WORKERS = 2

# The tiny GPT of tests/cli_helpers.py TINY (seconds per run on 2 CPU cores).
TINY = [
    "task.args.seq_len=64", "task.args.d_model=64", "task.args.n_layers=2",
    "task.args.n_heads=2", "train.global_batch_size=8", "train.micro_batch_size=2",
    "train.warmup_steps=5", "data.val_batches=1",
]

# Files in workdir.
STEPS_FILE = "steps.jsonl"        # rank 0: {"step", "time", "loss", "pid"} per completed step
ATTEMPTS_FILE = "attempts.jsonl"  # every rank: {"event": "start"|"ready", "time", "rank", ...}
FAULT_FILE = "fault.json"         # rank 1: {"fault", "time", "pid", ...}, written before the fault
MARKER_FILE = "fault.injected"    # created with O_EXCL: a restarted attempt injects nothing
STOP_FILE = "stop"                # harness: every train loop that sees it returns at once
CHECKPOINTS_FILE = "checkpoints.jsonl"  # rank 0: {"step", "time", "pid"} after report()
STATE_FILE = "state.pt"           # inside each Ray Train checkpoint


# ----------------------------------------------------------------------------------------------
# Worker side
# ----------------------------------------------------------------------------------------------

def _write_json_atomic(path: Path, row: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(row, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _ppid_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2:].split()[1])  # fields after "(comm)": state ppid ...


def _children_of(ppid: int) -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit() and _ppid_of(int(d)) == ppid]


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

    me = os.getpid()
    row: dict[str, Any] = {"fault": fault, "pid": me,
                           "node_id": ray.get_runtime_context().get_node_id()}
    if fault == "node":
        raylet = os.getppid()
        comm = Path(f"/proc/{raylet}/comm").read_text().strip()
        if comm != "raylet":
            raise RuntimeError(f"the worker's parent {raylet} is {comm!r}, not the raylet")
        # Snapshot the node's processes now: once the raylet is gone they are reparented.
        victims = [p for p in _children_of(raylet) if p != me]
        row.update(raylet_pid=raylet, other_node_pids=victims)
    row["time"] = time.time()
    _write_json_atomic(workdir / FAULT_FILE, row)
    if fault == "kill":
        os.kill(me, signal.SIGKILL)
    elif fault == "hang":
        os.kill(me, signal.SIGSTOP)
    elif fault == "node":
        os.kill(row["raylet_pid"], signal.SIGKILL)
        for pid in row["other_node_pids"]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(me, signal.SIGKILL)
    else:
        raise ValueError(f"unknown fault {fault!r}")


def train_loop_per_worker(cfg: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker: the reference task, as bench/peers/torchrun_ddp.py."""
    import ray.train
    from ray.train import Checkpoint

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

    step, samples_seen = 0, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / STATE_FILE, weights_only=False)
        step, samples_seen = run.load(state)
    append_jsonl(workdir / ATTEMPTS_FILE, {
        "event": "ready", "time": time.time(), "rank": rank, "pid": os.getpid(),
        "node_id": node_id, "restored_from": step if checkpoint is not None else None,
        "pg_timeout_s": _pg_timeout_s()})

    while step < t.steps:
        if (workdir / STOP_FILE).exists():
            return
        if (step + 1 == cfg["fault_step"] and rank == 1
                and not (workdir / FAULT_FILE).exists()):
            try:
                os.close(os.open(workdir / MARKER_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass  # injected by an earlier attempt
            else:
                _inject(cfg["fault"], workdir)
        start, count = rank_slice(samples_seen, t.global_batch_size, rank, world)
        items = run.sampler.items(start, count)
        loss_sum, _ = run.step(items)
        step += 1
        samples_seen += t.global_batch_size
        loss_value = loss_sum / world
        if rank == 0:
            append_jsonl(workdir / STEPS_FILE, {"step": step, "time": time.time(),
                                                 "loss": loss_value, "pid": os.getpid()})
        if step % cfg["checkpoint_every"] == 0 or step == t.steps:
            metrics = {"step": step, "loss": loss_value}
            if rank == 0:
                with tempfile.TemporaryDirectory(prefix="raytrain-ckpt-") as tmp:
                    torch.save(run.state_dict(step, samples_seen), Path(tmp) / STATE_FILE)
                    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))
                if cfg["commit_checkpoints"]:
                    # Block until the controller has registered it (see run_raytrain).
                    from ray.train import CheckpointConsistencyMode

                    ray.train.get_all_reported_checkpoints(
                        consistency_mode=CheckpointConsistencyMode.COMMITTED)
                append_jsonl(workdir / CHECKPOINTS_FILE, {"step": step, "time": time.time(),
                                                            "pid": os.getpid()})
            else:
                ray.train.report(metrics)
