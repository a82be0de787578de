"""torchrun's side of the recovery benchmark: the reference task under `torchrun --max-restarts`,
checkpointing (an atomic torch.save every --checkpoint-every steps) and resuming by hand."""

# The start time is taken before the imports, which take seconds.
# ruff: noqa: E402
from __future__ import annotations

import time

START = time.time()

import argparse
import os
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from bench.common import add_config_args, append_jsonl, parser, set_args, torchrun, write_atomic
from bench.peers.ddp_step import torchrun_setup

STEPS_FILE = "steps.jsonl"
ATTEMPTS_FILE = "attempts.jsonl"
CHECKPOINT_DIR = "checkpoints"
MAX_RESTARTS = 3


def torchrun_command(workdir: Path, *, nproc: int, steps: int, checkpoint_every: int,
                     config: str | Path, overrides: list[str]) -> list[str]:
    """The command line a user types: torchrun with --max-restarts over this module."""
    return torchrun("bench.peers.torchrun_recovery", nproc, [
        "--workdir", str(workdir), "--steps", str(steps), "--checkpoint-every",
        str(checkpoint_every), "--config", str(config), *set_args(overrides)],
        max_restarts=MAX_RESTARTS)


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, __spec__)
    p.add_argument("--workdir", required=True, help="step log, attempts and checkpoints")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (train.steps)")
    p.add_argument("--checkpoint-every", type=int, default=10)
    add_config_args(p)
    return p.parse_args()


class Resumed(NamedTuple):
    """One torchrun attempt, set up and resumed."""

    attempt: int
    rank: int
    world: int
    run: Any
    folder: Path
    """Where rank 0 writes its checkpoints."""


def resume_attempt(workdir: Path, config: str, overrides: list[str], steps: int,
                   started: float) -> Resumed:
    """Start one torchrun attempt as every rank does: log its start (at `started`, before
    the imports), set up the rank, resume from the newest complete checkpoint (a temporary
    one's name starts with a dot: torchrun stopped the whole old group first, so every rank
    sees the same files), and log that it is ready."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    append_jsonl(workdir / ATTEMPTS_FILE, {"event": "start", "time": started, "rank": rank,
                                           "attempt": attempt, "pid": os.getpid()})
    _, world, run = torchrun_setup(config, overrides, steps)
    folder = workdir / CHECKPOINT_DIR
    if (newest := max(folder.glob("step-*.pt"), default=None)) is not None:
        run.load(torch.load(newest, weights_only=True))
    append_jsonl(workdir / ATTEMPTS_FILE, {
        "event": "ready", "time": time.time(), "rank": rank, "attempt": attempt,
        "pid": os.getpid(), "restored_from": run.step if newest is not None else None})
    return Resumed(attempt, rank, world, run, folder)


def main() -> None:
    args = parse_args()
    workdir = Path(args.workdir)
    attempt, rank, world, run, folder = resume_attempt(workdir, args.config, args.overrides,
                                                       args.steps, START)
    t = run.train
    while run.step < t.steps:
        loss_sum, _ = run.rank_step(rank, world)
        step = run.step
        if rank == 0:
            append_jsonl(workdir / STEPS_FILE, {"step": step, "time": time.time(),
                                                "loss": loss_sum / world, "attempt": attempt,
                                                "pid": os.getpid()})
            if step % args.checkpoint_every == 0 or step == t.steps:
                folder.mkdir(parents=True, exist_ok=True)
                write_atomic(folder / f"step-{step:06d}.pt",
                             partial(torch.save, run.state_dict()), "wb")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
