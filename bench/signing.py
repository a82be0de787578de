"""Signing: what signed checkpoints cost a commit, and what verifying them costs a load.

A load checks every file's sha256 as it reads it (safe_load.VerifiedReader): `load_verified_s`
against `load_plain_s`, the same load through DCP's own reader, checking nothing."""

from __future__ import annotations

import statistics
import sys
import tempfile
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import common
from bench.harness import run_watched

TARGET = 0.01


def _median_time(fn: Callable[[], object], repeat: int) -> float:
    return statistics.median(timeit.repeat(fn, "gc.enable()", number=1, repeat=repeat))


def _load_s(path: str, files: dict, verified: bool, repeat: int) -> float:
    """Median seconds to load every tensor of a checkpoint in one process."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from stalwart.checkpointing.safe_load import SafeLoadPlanner, VerifiedReader

    metadata = VerifiedReader(path, files=files).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items()
             if isinstance(m, TensorStorageMetadata)}

    def load() -> None:
        reader = VerifiedReader(path, files=files) if verified else FsspecReader(path)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)

    return _median_time(load, repeat)


def measure(run_dir: Path, repeat: int) -> list[dict]:
    from stalwart.checkpointing.safe_load import VerifiedReader
    from stalwart.checkpointing.storage import signing
    from stalwart.checkpointing.storage.catalog import read_checkpoint, verify
    from stalwart.core import events as ev

    trust = signing.CheckpointTrust(key=signing.load_key(None))  # the key the run signed with
    commits = {e.step: e for e in ev.read_events(run_dir / "events.jsonl")
               if isinstance(e, ev.CheckpointCommitted)}
    storage = str(run_dir / "checkpoints")
    rows = []
    for step, commit in sorted(commits.items()):
        try:
            info = read_checkpoint(storage, step)
        except Exception:  # removed by retention (keep_last): its commit time still counts
            continue
        manifest = info.manifest
        reader = VerifiedReader(info.path, files=manifest["files"])
        rows.append({
            "step": step, "commit_s": commit.save_s, "files": len(manifest["files"]),
            "bytes": sum(m["size"] for m in manifest["files"].values()),
            "sign_s": _median_time(lambda m=manifest: signing.sign(m, trust.key), repeat),
            "check_s": _median_time(lambda m=manifest: signing.check_signature(m, trust, "x"),
                                    repeat),
            "metadata_s": _median_time(reader.read_metadata, max(1, repeat // 20)),
            "verify_s": _median_time(lambda i=info: verify(i, trust), 3),
            "verify_sizes_s": _median_time(lambda i=info: verify(i, trust, hashes=False), 3),
            "load_plain_s": _load_s(info.path, manifest["files"], False, 5),
            "load_verified_s": _load_s(info.path, manifest["files"], True, 5)})
    return rows


def main() -> int:
    p = common.parser(__doc__, __spec__, "signing.json")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--persist-every", type=int, default=10)
    p.add_argument("--repeat", type=int, default=2000, help="timings per figure (median)")
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="stalwart-bench-signing-") as tmp:
        run_dir, log = Path(tmp) / "run", Path(tmp) / "run.log"
        overrides = [f"train.steps={args.steps}", f"checkpoint.persist_every={args.persist_every}",
                     "checkpoint.keep_last=0", "run.log_every=10"]
        cmd = common.stalwart_command(str(common.DEFAULT_CONFIG), overrides, run_dir)
        code, wall = run_watched(cmd, log, args.timeout)
        if code != 0:
            raise SystemExit(common.tail(log))
        rows = measure(run_dir, args.repeat)
    if not rows:
        raise SystemExit("the run committed no checkpoint")

    summary: dict[str, Any] = {"commits": len(rows), **{
        f"median_{k}": statistics.median(r[k] for r in rows)
        for k in ("commit_s", "sign_s", "check_s", "metadata_s", "verify_s", "verify_sizes_s",
                  "load_plain_s", "load_verified_s")}}
    commit, sign_s = summary["median_commit_s"], summary["median_sign_s"]
    summary.update(sign_share_of_commit=sign_s / commit, met=sign_s / commit < TARGET,
                   target=f"sign < {TARGET:.0%} of a commit", run_wall_s=wall)
    print(f"{'step':>6} {'files':>5} {'MB':>6} {'commit ms':>10} {'sign us':>8} "
          f"{'check us':>9} {'.metadata ms':>12} {'verify ms':>10}")
    for r in rows:
        print(f"{r['step']:>6} {r['files']:>5} {r['bytes'] / 1e6:>6.2f} "
              f"{r['commit_s'] * 1e3:>10.1f} {r['sign_s'] * 1e6:>8.1f} {r['check_s'] * 1e6:>9.1f} "
              f"{r['metadata_s'] * 1e3:>12.2f} {r['verify_s'] * 1e3:>10.1f}")
    plain, checked = summary["median_load_plain_s"], summary["median_load_verified_s"]
    summary["verify_on_read_overhead"] = checked / plain - 1
    print(f"a load that checks every file as it reads: {checked * 1e3:.1f} ms, against "
          f"{plain * 1e3:.1f} ms unchecked ({summary['verify_on_read_overhead']:+.0%}); the "
          f"driver's check before a recovery: {summary['median_verify_sizes_s'] * 1e3:.2f} ms "
          f"(sizes), was {summary['median_verify_s'] * 1e3:.1f} ms (every sha256)")
    print(f"signing is {summary['sign_share_of_commit']:.4%} of a commit's time "
          f"(median {sign_s * 1e6:.0f} us of {commit * 1e3:.0f} ms); target < {TARGET:.0%}: "
          f"{'met' if summary['met'] else 'NOT met'}")
    common.write_json(args.out, {"summary": summary, "commits": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
