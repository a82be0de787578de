"""Run a function on N real gloo ranks in spawned processes and collect each rank's result."""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from stalwart.parallel.distributed import free_port


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str,
           args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        result: Any = fn(rank, world_size, *args)
        status = "ok"
    except BaseException:
        result, status = traceback.format_exc(), "error"
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"{rank}.pkl").write_bytes(pickle.dumps((status, result)))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """fn(rank, world_size, *args) on each rank; returns results by rank, raising rank errors."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args),
                           nprocs=world_size, join=True, start_method="spawn")
        results = []
        for rank in range(world_size):
            status, value = pickle.loads(Path(out_dir, f"{rank}.pkl").read_bytes())
            if status != "ok":
                raise AssertionError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results


os.environ.setdefault("OMP_NUM_THREADS", "1")
