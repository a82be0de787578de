"""Run a function on N real gloo ranks in processes of their own and collect each rank's
result."""

from __future__ import annotations

import gc
import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from stalwart.parallel.distributed import destroy_process_group

# The threads of a process group (gloo's workers and event loops) and of the store it was
# formed through: none may outlive the world. One alive when the process exits runs on
# while the interpreter is torn down, and a thread that needs the interpreter then is
# ended by it mid-stack, which aborts the process ("terminate called without an active
# exception").
GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")


def group_threads() -> list[str]:
    """Names of this process's threads that belong to a process group or its store."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
        except OSError:
            continue  # the thread ended meanwhile
        if name in GROUP_THREADS:
            names.append(name)
    return sorted(names)


def _entry(rank: int, fn: Callable[..., Any], world_size: int, out_dir: str,
           args: tuple[Any, ...]) -> None:
    import torch
    import torch._dynamo  # noqa: F401 (before the world: see below)
    import torch.distributed as dist

    # First imported while a group exists, torch._dynamo keeps that group alive past
    # destroy_process_group (torch 2.13; an optimizer's first step imports it). A worker has
    # it, through the engine, before it joins a world; so do these ranks.
    torch.set_num_threads(1)
    # A file store in this call's own directory: no port to pick, so none another test's
    # world can take between the pick and the bind.
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                            world_size=world_size)
    try:
        result: Any = fn(rank, world_size, *args)
        status = "ok"
    except BaseException:
        result, status = traceback.format_exc(), "error"
    finally:
        # Leave the world as a worker does (DTensor's caches forgotten), and let what fn
        # built go: its model and optimizer hold the groups too, in reference cycles.
        destroy_process_group()
        gc.collect()
    if status == "ok" and os.path.isdir("/proc/self/task") and (left := group_threads()):
        result, status = f"the world's groups outlived it: threads {left} still run", "error"
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps((status, result)))


# Ranks are forked from a fork server that imported these once: a rank starts in a tenth of
# a second instead of importing torch and stalwart for seconds. The server has run no torch
# op and holds no thread of torch's, so forking it is as clean as a fresh process.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "stalwart.workers.engine",
           "stalwart.parallel.pipeline",
           "stalwart.checkpointing.memory.tier", "stalwart.checkpointing.storage.writer",
           "tests.dist.launcher"]


def start_forked(entry: Callable[..., Any], args: tuple[Any, ...], nprocs: int, *,
                 join: bool = True) -> Any:
    """mp.start_processes from the fork server: entry(i, *args) in each of nprocs processes."""
    mp.set_forkserver_preload(PRELOAD)  # read when the server starts: the first call
    return mp.start_processes(entry, args=args, nprocs=nprocs, join=join,
                              start_method="forkserver")


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """fn(rank, world_size, *args) on each rank; returns results by rank, raising rank errors."""
    with tempfile.TemporaryDirectory() as out_dir:
        start_forked(_entry, (fn, world_size, out_dir, args), world_size)
        results = []
        for rank in range(world_size):
            status, value = pickle.loads(Path(out_dir, f"{rank}.pkl").read_bytes())
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results


os.environ.setdefault("OMP_NUM_THREADS", "1")
# torch.compile's kernels are built in this rank's own process: inductor's default, a pool
# of compile processes, has each of them import torch, which on 2 cores costs more CPU than
# the pool saves (a compiled 2-rank run: 51 CPU-s instead of 65).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
