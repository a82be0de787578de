"""Commit: rank 0's time from the last shard written to the manifest committed, with each
file's sha256 read back on rank 0 (the old path) against taken from its writer (the new one)."""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Any

import torch

from bench import common

TENSORS_PER_RANK = 8
MIB = 2**20


def parse_args() -> argparse.Namespace:
    p = common.parser(__doc__, __spec__, "commit.json")
    p.add_argument("--worlds", type=common.positive(), nargs="+", default=[1, 2, 4],
                   help="world sizes to measure (default 1 2 4)")
    p.add_argument("--total-mb", type=common.positive(float), default=128.0,
                   help="`fixed` shape: MiB of state over all ranks (default 128)")
    p.add_argument("--shard-mb", type=common.positive(float), default=32.0,
                   help="`per-rank` shape: MiB of state on each rank (default 32)")
    p.add_argument("--rounds", type=common.positive(), default=3, help="saves per path (default 3)")
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="where the checkpoints are written (default the temp dir)")
    return p.parse_args()


def measure_rank(rank: int, world: int, root: str, shapes: dict[str, int], rounds: int
                 ) -> dict[str, list[dict[str, Any]]]:
    """Per shape and round: a plain save + read-back commit, a hashing save + digest commit."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from stalwart.checkpointing.storage.hashing import HashingWriter
    from stalwart.checkpointing.storage.layout import join, step_dir_name
    from stalwart.checkpointing.storage.signing import SigningKey
    from stalwart.checkpointing.storage.writer import write_manifest

    warnings.simplefilter("ignore", UserWarning)  # DCP's, once per save and rank
    key = SigningKey(secret=b"k" * 32, source="bench")
    out: dict[str, list[dict[str, Any]]] = {}
    step = 0
    for shape, shard_bytes in shapes.items():
        gen = torch.Generator().manual_seed(rank)
        numel = max(1, shard_bytes // 4 // TENSORS_PER_RANK)
        state = {"model": {f"rank{rank}.t{i}": torch.randn(numel, generator=gen)
                           for i in range(TENSORS_PER_RANK)}, "step": 1}
        out[shape] = []
        for _ in range(rounds):
            for path in ("old", "new"):
                step += 1
                url = join(root, step_dir_name(step))
                writer = FsspecWriter(url) if path == "old" else HashingWriter(url)
                dist.barrier()
                t0 = time.perf_counter()
                dcp.save(state, storage_writer=writer)
                written = time.perf_counter()
                read_back: list[str] = [] if rank else write_manifest(
                    root, step, {"world_size": world}, key=key, ranks=world,
                    digests=None if path == "old" else writer.digests)
                out[shape].append({"path": path, "write_s": written - t0,
                                   "commit_s": time.perf_counter() - written if rank == 0
                                   else None, "files_read": len(read_back)})
                dist.barrier()
                if rank == 0:  # keep the disk and its write-back queue to one checkpoint
                    shutil.rmtree(url)
    return out


def summarise(shape: str, world: int, shard_bytes: int, per_rank: list[list[dict]]
              ) -> dict[str, Any]:
    row: dict[str, Any] = {"shape": shape, "world": world,
                           "checkpoint_mib": world * shard_bytes / MIB}
    for path in ("old", "new"):
        idx = [i for i, r in enumerate(per_rank[0]) if r["path"] == path]
        commits = [per_rank[0][i]["commit_s"] for i in idx]
        writes = [max(ranks[i]["write_s"] for ranks in per_rank) for i in idx]
        row[path] = {"commit_s": commits, "commit_median_s": statistics.median(commits),
                     "write_s": writes, "write_median_s": statistics.median(writes),
                     "files_read": per_rank[0][idx[0]]["files_read"]}
    return row


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    head = ["shape", "N", "ckpt MiB", "old commit ms", "new commit ms", "old/new",
            "files read old/new", "write s plain", "write s hashing"]
    print(f"commit = rank 0 from its dcp.save returning to manifest.json in place; medians "
          f"of {args.rounds} rounds; write = slowest rank's dcp.save; storage {args.dir}")
    common.print_columns([head] + [[
        r["shape"], str(r["world"]), f"{r['checkpoint_mib']:.0f}",
        f"{r['old']['commit_median_s'] * 1e3:.1f}", f"{r['new']['commit_median_s'] * 1e3:.2f}",
        f"{r['old']['commit_median_s'] / r['new']['commit_median_s']:.0f}x",
        f"{r['old']['files_read']}/{r['new']['files_read']}",
        f"{r['old']['write_median_s']:.2f}", f"{r['new']['write_median_s']:.2f}"]
        for r in rows])


def main() -> int:
    args = parse_args()
    rows = []
    t_start = time.perf_counter()
    for world in args.worlds:
        shapes = {"fixed": int(args.total_mb * MIB / world), "per-rank": int(args.shard_mb * MIB)}
        with tempfile.TemporaryDirectory(prefix="stalwart-commit-", dir=args.dir) as root:
            per_rank = common.gloo_world(measure_rank, world, root, shapes, args.rounds)
        rows += [summarise(shape, world, shard_bytes, [r[shape] for r in per_rank])
                 for shape, shard_bytes in shapes.items()]
    rows.sort(key=lambda r: (r["shape"] != "fixed", r["world"]))
    print_table(rows, args)
    common.write_json(args.out, {
        "method": "rank 0's time from dcp.save returning to the manifest committed; old: "
                  "every file read back and hashed on rank 0; new: digests from the writers",
        "rounds": args.rounds, "storage_dir": args.dir, "results": rows,
        "seconds": time.perf_counter() - t_start, "machine": common.machine(with_ray=False)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
