"""The baseline of bench/throughput.py: the reference task trained by hand with torch DDP."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

from bench.common import add_config_args, append_jsonl, parser
from bench.peers.ddp_step import torchrun_setup


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, __spec__)
    add_config_args(p)
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (train.steps)")
    p.add_argument("--exclude", type=int, default=10,
                   help="warm-up steps left out of the measured window")
    p.add_argument("--out", required=True, help="JSON-lines file that rank 0 appends to")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    rank, world, run = torchrun_setup(args.config, args.overrides, args.steps)
    t = run.train
    if not 0 <= args.exclude < t.steps:
        raise SystemExit(f"--exclude={args.exclude} must be in [0, train.steps={t.steps})")
    losses: list[float] = []
    dist.barrier()
    ends = [time.time()]  # wall time at the end of each step (index 0: before step 1)
    for _step in range(1, t.steps + 1):
        loss_sum, tokens = run.rank_step(rank, world)
        losses.append(loss_sum / world)
        tokens_per_step = tokens * world
        ends.append(time.time())
    window_s = ends[-1] - ends[args.exclude]
    measured = t.steps - args.exclude
    if rank == 0:
        gaps = [b - a for a, b in zip(ends[args.exclude:-1], ends[args.exclude + 1:], strict=True)]
        row = {"runner": "torchrun-ddp", "world_size": world, "steps": t.steps,
               "excluded_steps": args.exclude, "tokens_per_step": tokens_per_step,
               "window_s": window_s, "tokens_per_s": measured * tokens_per_step / window_s,
               "step_time_s_median": sorted(gaps)[measured // 2],
               "loss_by_step": {str(i + 1): v for i, v in enumerate(losses)},
               "grad_accum": run.accum, "threads": torch.get_num_threads(),
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        append_jsonl(Path(args.out), row)
        print(f"torchrun DDP: {row['tokens_per_s']:,.0f} tokens/s over steps "
              f"{args.exclude + 1}..{t.steps}, final loss {losses[-1]:.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
