"""Data: samples/s of stalwart's parquet stream read as the engine reads it, against a raw
pyarrow scan of the same files (the ceiling), Ray Data and a torch DataLoader; the stream's
resume latency near the start and deep in the dataset, its index time, and its memory.

One generated parquet dataset (`id`, `features` of --features float32, `label`, as
examples/stream/make_data.py writes) under --dir, reused while its parameters are unchanged,
and read once before timing so that every reader finds it in the page cache. Every reader
reads the `features` and `label` columns into torch tensors of --global-batch rows, and the
"step" touches one element of each tensor. The stream is read as the engine reads it:
`bind(seed, global_batch, cache_dir)`, then a `Feeder` (depth --prefetch, as data.prefetch)
over rank 0 of dp=1's micro-batch ranges, `take` before the step and `check_ahead` of the
next step inside it. A slow step (--step-ms) shows the wait when training is slower than
reading, at --prefetch and at DEEP_PREFETCH. The stream alone shuffles (units per epoch,
rows in windows); the others read in file order.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch.utils.data

from bench import common
from bench.common import fmt, ratio

GOAL_RAW = 0.9  # stream samples/s >= 0.9 x the raw scan's
GOAL_WAIT = 0.01  # a step slower than reading waits for data <= 1% of the time
GOAL_RESUME = 1.25  # resume deep <= 1.25 x resume near, the fastest of the repeats each
GOAL_MEMORY = 3.0  # the dataset on disk >= 3 x the stream's peak RSS
# The slow step again with this many steps read ahead: enough to cover the burst of reads
# when every lane of the stream starts a new window at the same step.
DEEP_PREFETCH = 32
COLUMNS = ["features", "label"]
CLASSES = 4
META = "_bench_data.json"  # a leading _: the stream, pyarrow and Ray all skip it
MIB = 2**20
FULL = {"size_mb": 2048, "files": 16, "row_group_mb": 8.0, "rounds": 2, "resume_reps": 7}
QUICK = {"size_mb": 50, "files": 4, "row_group_mb": 1.0, "rounds": 1, "resume_reps": 3}


# ---------------------------------------------------------------------- the dataset


def dataset_params(args: argparse.Namespace) -> dict[str, Any]:
    """What the files hold; a dataset on disk is reused only if its parameters are these."""
    row_bytes = args.features * 4 + 16  # features, id and label
    rows = int(args.size_mb * MIB) // row_bytes
    # No dictionary for the random floats: it would make them 1.5x larger and slower to decode.
    return {"rows": rows, "files": args.files, "features": args.features, "classes": CLASSES,
            "row_group_rows": max(1, int(args.row_group_mb * MIB) // row_bytes), "seed": 0,
            "dictionary": ["id", "label"]}


def _write_file(path: str, rows: int, first: int, params: dict[str, Any]) -> int:
    import pyarrow.parquet as pq

    from stalwart.examples.stream.make_data import make_table

    table = make_table(rows, params["features"], params["classes"], params["seed"], first)
    pq.write_table(table, path, row_group_size=params["row_group_rows"],
                   use_dictionary=params["dictionary"])
    return os.path.getsize(path)


def make_dataset(directory: Path, params: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The dataset's description (its parameters, file names and sizes), and whether it was
    written now: an existing one with the same parameters and intact files is kept."""
    meta_path = directory / META
    if meta_path.exists():
        meta = json.loads(meta_path.read_text())
        if meta["params"] == params and all(
                (directory / name).is_file() and (directory / name).stat().st_size == size
                for name, size in meta["sizes"].items()):
            return meta, False
        for name in meta["sizes"]:  # only the files this bench wrote
            (directory / name).unlink(missing_ok=True)
        meta_path.unlink()
    elif directory.exists() and any(directory.glob("*.parquet")):
        raise SystemExit(f"{directory} holds parquet files that this bench did not write (no "
                         f"{META}); give --dir an empty or new directory")
    directory.mkdir(parents=True, exist_ok=True)
    per_file = -(-params["rows"] // params["files"])
    jobs = [(str(directory / f"part-{i:05d}.parquet"),
             min(per_file, params["rows"] - i * per_file), i * per_file)
            for i in range(params["files"]) if params["rows"] > i * per_file]
    # Child processes: the tables built for writing never count in this process's RSS.
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        sizes = list(pool.map(_write_file, *zip(*jobs, strict=True), [params] * len(jobs)))
    meta = {"params": params, "sizes": {Path(p).name: s for (p, _, _), s in
                                        zip(jobs, sizes, strict=True)}}
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")  # last: a half-written set is redone
    return meta, True


def warm_page_cache(directory: Path, meta: dict[str, Any]) -> None:
    for name in meta["sizes"]:
        with open(directory / name, "rb") as f:
            while f.read(16 * MIB):
                pass


def drop_page_cache(directory: Path, meta: dict[str, Any]) -> bool:
    """Evicts the files' pages (posix_fadvise DONTNEED needs no privilege); False where the
    platform has no fadvise."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for name in meta["sizes"]:
        fd = os.open(directory / name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


# ---------------------------------------------------------------------- the readers


def touch(batch: dict[str, Any]) -> float:
    """The whole of the fake step's compute: one element of each tensor."""
    return sum(float(t.reshape(-1)[0]) for t in batch.values())


def plan_of(args: argparse.Namespace) -> Callable[[int], list[tuple[int, int]]]:
    """The engine's _step_ranges for dp=1 without a pipeline: one range per micro-batch."""
    from stalwart.workers.sampler import rank_slice

    def plan(position: int) -> list[tuple[int, int]]:
        start, count = rank_slice(position, args.global_batch, 0, 1)
        mb = args.micro_batch
        return [(start + i * mb, mb) for i in range(count // mb)]
    return plan


def open_stream(directory: Path, cache_dir: str, global_batch: int) -> Any:
    from stalwart.data import read_parquet

    stream = read_parquet(str(directory), columns=COLUMNS)
    stream.bind(seed=0, global_batch=global_batch, cache_dir=cache_dir)
    return stream


def stream_run(directory: Path, args: argparse.Namespace, cache_dir: str, *, steps: int,
               step_s: float = 0.0, depth: int | None = None) -> dict[str, Any]:
    """`steps` steps read through a Feeder as the engine reads them; each step touches its
    batches, then sleeps step_s (a step slower than reading), then checks the next step."""
    from stalwart.workers.feeder import Feeder

    stream = open_stream(directory, cache_dir, args.global_batch)
    depth = args.prefetch if depth is None else depth
    feeder = Feeder(stream, seed=0, plan=plan_of(args), step_size=args.global_batch,
                    depth=depth)
    waits: list[float] = []
    t0 = time.perf_counter()
    try:
        for step in range(steps):
            position = step * args.global_batch
            data, waited = feeder.take(position)
            for batch in data.batches:
                touch(batch)
            if step_s:
                time.sleep(step_s)
            if step + 1 < steps:
                _, more = feeder.check_ahead(position + args.global_batch)
                waited += more
            waits.append(waited)
        wall = time.perf_counter() - t0
    finally:
        feeder.close()
    samples = steps * args.global_batch
    steady = wall - waits[0]
    return {"samples": samples, "steps": steps, "wall_s": wall, "samples_per_s": samples / wall,
            "first_batch_s": waits[0], "after_first_per_s": _per_s(samples - args.global_batch,
                                                                   steady),
            "wait_s": sum(waits), "wait_share": sum(waits) / wall,
            "steady_wait_share": _per_s(sum(waits[1:]), steady),
            "max_wait_s": max(waits), "prefetch": depth, "lanes": stream.order.lanes,
            "window": stream.window, "units": len(stream.units),
            # Where the waits were: bursts at the steps whose lanes start new windows?
            "longest_waits": [[int(i), waits[i]] for i in np.argsort(waits)[::-1][:8]]}


def _per_s(amount: float, seconds: float) -> float | None:
    return amount / seconds if seconds > 0 else None


def _timed(batches: Iterator[dict[str, Any]], rows: Callable[[dict[str, Any]], int]
           ) -> dict[str, Any]:
    """Drains `batches`, touching each: samples/s over all of it, and the first batch's time."""
    t0 = time.perf_counter()
    samples, first, first_rows = 0, 0.0, 0
    for batch in batches:
        touch(batch)
        samples += rows(batch)
        if not first_rows:
            first, first_rows = time.perf_counter() - t0, samples
    wall = time.perf_counter() - t0
    return {"samples": samples, "wall_s": wall, "samples_per_s": samples / wall,
            "first_batch_s": first, "after_first_per_s": _per_s(samples - first_rows,
                                                                wall - first)}


def _label_rows(batch: dict[str, Any]) -> int:
    return len(batch["label"])


def as_tensors(table: Any, what: str) -> dict[str, Any]:
    """A table's numeric columns as tensors, converted as the stream converts its units."""
    from stalwart.data.columns import decode, numeric_batch

    return numeric_batch(decode(table).dense, table.schema, what)


def raw_run(directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    """pyarrow.dataset's scan in file order, each record batch made a torch batch by the
    stream's own conversion: the ceiling of what reading and converting costs."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    def batches() -> Iterator[dict[str, Any]]:
        for rb in ds.dataset(str(directory), format="parquet").to_batches(
                batch_size=args.global_batch, columns=COLUMNS):
            if rb.num_rows:
                yield as_tensors(pa.Table.from_batches([rb]), "raw")
    return _timed(batches(), _label_rows)


class RowGroups(torch.utils.data.IterableDataset):
    """A torch IterableDataset: each DataLoader worker reads its share of the row groups
    (dealt round robin, in a seeded order) with pyarrow and yields batches of `rows` rows."""

    def __init__(self, paths: list[str], row_groups: list[tuple[int, int]], rows: int) -> None:
        self.paths, self.row_groups, self.rows = paths, row_groups, rows

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        info = torch.utils.data.get_worker_info()
        mine = self.row_groups[info.id::info.num_workers] if info else self.row_groups
        files: dict[int, Any] = {}
        carry: pa.Table | None = None
        for f, g in mine:
            if f not in files:
                files[f] = pq.ParquetFile(self.paths[f])
            table = files[f].read_row_group(g, columns=COLUMNS)
            if carry is not None:  # rows left from the last row group lead the next batch
                table = pa.concat_tables([carry, table])
            whole = table.num_rows - table.num_rows % self.rows
            for lo in range(0, whole, self.rows):
                yield as_tensors(table.slice(lo, self.rows), "DataLoader")
            carry = table.slice(whole) if whole < table.num_rows else None
        if carry is not None:
            yield as_tensors(carry, "DataLoader")


def _one_thread(_: int) -> None:
    import pyarrow as pa
    import torch

    torch.set_num_threads(1)
    pa.set_cpu_count(1)


def loader_run(directory: Path, meta: dict[str, Any], args: argparse.Namespace
               ) -> dict[str, Any]:
    """torch's DataLoader over RowGroups, batch_size=None (each item is a batch of
    --global-batch rows: a per-row collate would time collation, not reading)."""
    import pyarrow.parquet as pq
    from torch.utils.data import DataLoader

    paths = [str(directory / name) for name in sorted(meta["sizes"])]
    groups = [(f, g) for f, p in enumerate(paths)
              for g in range(pq.ParquetFile(p).num_row_groups)]
    order = np.random.default_rng(0).permutation(len(groups))
    data = RowGroups(paths, [groups[i] for i in order], args.global_batch)
    workers = {"num_workers": args.loader_workers, "worker_init_fn": _one_thread,
               "prefetch_factor": 2} if args.loader_workers else {}
    loader = DataLoader(data, batch_size=None, **workers)
    return _timed(iter(loader), _label_rows) | {"workers": args.loader_workers}


def ray_run(directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Ray Data's read_parquet and iter_torch_batches, in a Ray of 2 CPUs started here;
    ray.init is not timed."""
    import ray

    # address="local": a Ray of its own, never a cluster another process started here.
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False)
    try:
        import ray.data

        ray.data.DataContext.get_current().enable_progress_bars = False
        ds = ray.data.read_parquet(str(directory)).select_columns(COLUMNS)
        return _timed(iter(ds.iter_torch_batches(batch_size=args.global_batch)), _label_rows)
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------- resume, index, memory


def resume_run(directory: Path, args: argparse.Namespace, cache_dir: str, total_rows: int
               ) -> dict[str, Any]:
    """A restarted worker: a fresh process lists the files, binds (the index) and reads its
    first micro-batch at a step near the start or at one about 90% into the epoch,
    alternating, --resume-reps times each. A fresh process, because a stream in the same
    process would find the units decoded before (FileStream shares them per process)."""
    positions = resume_positions(open_stream(directory, cache_dir, args.global_batch), args,
                                 total_rows)
    times: dict[str, list[dict[str, float]]] = {k: [] for k in positions}
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn, max_tasks_per_child=1) as pool:
        for rep in range(args.resume_reps):  # alternating, so neither is always first
            for name in (list(positions) if rep % 2 == 0 else list(positions)[::-1]):
                times[name].append(pool.submit(
                    _resume_once, str(directory), cache_dir, args.global_batch,
                    args.micro_batch, positions[name]).result())
    out: dict[str, Any] = {"positions": positions}
    for name, rows in times.items():
        totals = [r["total_s"] for r in rows]
        out[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]} | {
            "min_s": min(totals), "spread_s": max(totals) - min(totals), "all_total_s": totals}
    # The fastest of the repeats: the cost itself, where the median carries this machine's
    # noise.
    out["deep_over_near"] = out["deep"]["min_s"] / out["near"]["min_s"]
    out["median_deep_over_near"] = out["deep"]["total_s"] / out["near"]["total_s"]
    return out


def _resume_once(directory: str, cache_dir: str, global_batch: int, micro_batch: int,
                 position: int) -> dict[str, float]:
    """In a fresh process: a stream's files listed, bound and its first micro-batch read."""
    import pyarrow as pa
    import torch

    from stalwart.data import read_parquet  # imported before the clock, as a worker has it

    pa.set_cpu_count(2)
    pa.set_io_thread_count(2)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    stream = read_parquet(directory, columns=COLUMNS)
    t1 = time.perf_counter()
    stream.bind(seed=0, global_batch=global_batch, cache_dir=cache_dir)
    t2 = time.perf_counter()
    touch(stream.read(position, micro_batch)[0])
    t3 = time.perf_counter()
    return {"list_s": t1 - t0, "bind_s": t2 - t1, "first_batch_s": t3 - t2, "total_s": t3 - t0}


def resume_positions(stream: Any, args: argparse.Namespace, total_rows: int
                     ) -> dict[str, int]:
    """Step 1, and the last step at or before 90% of the epoch whose micro-batch reads as many
    units as step 1's: an epoch's last steps (its tail) read fewer, so they would flatter."""
    def units(position: int) -> int:
        return len(np.unique(stream.order.locate(np.arange(position,
                                                           position + args.micro_batch))[1]))

    near = args.global_batch
    deep = int(total_rows // args.global_batch * 0.9)
    while deep > 1 and units(deep * args.global_batch) < units(near):
        deep -= 1
    return {"near": near, "deep": deep * args.global_batch}


def index_run(directory: Path, meta: dict[str, Any], args: argparse.Namespace,
              work: Path) -> dict[str, Any]:
    """bind()'s time on a cold cache (an empty cache_dir, the files' pages evicted) and
    warm (the same cache_dir again, pages cached). Parquet's index is its footers."""
    from stalwart.data import read_parquet

    cache = str(work / "index-cache")
    out: dict[str, Any] = {"evicted": drop_page_cache(directory, meta)}
    for name in ("cold", "warm"):
        stream = read_parquet(str(directory), columns=COLUMNS)
        t0 = time.perf_counter()
        stream.bind(seed=0, global_batch=args.global_batch, cache_dir=cache)
        out[f"{name}_s"] = time.perf_counter() - t0
    out["units"] = len(stream.units)
    return out


def ids_cost(directory: Path, args: argparse.Namespace, cache_dir: str, batches: int = 200
             ) -> dict[str, float]:
    """Seconds a micro-batch's read spends finding its rows in the order (locate) and on its
    ledger ids (SampleIds), as FileStream.read does both, without reading the rows."""
    from stalwart.core.stream import SampleIds

    stream = open_stream(directory, cache_dir, args.global_batch)
    urls = tuple(f.url for f in stream.files)
    located, t0 = [], time.perf_counter()
    for i in range(batches):
        start = i * args.micro_batch
        located.append(stream.order.locate(np.arange(start, start + args.micro_batch)))
    t1 = time.perf_counter()
    for epochs, units, rows in located:
        files = np.array([stream.units[u].file for u in units.tolist()], dtype=np.int64)
        first = np.array([stream.units[u].first_row for u in units.tolist()], dtype=np.int64)
        SampleIds(epoch=epochs, file=files, row=first + rows, files=urls)
    t2 = time.perf_counter()
    return {"locate_s": (t1 - t0) / batches, "ids_s": (t2 - t1) / batches}


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


class PeakRSS:
    """This process's RSS before a block and its peak inside it: the kernel's high-water
    mark, reset at entry (Linux clear_refs 5); where that fails, getrusage's lifetime peak."""

    def __enter__(self) -> PeakRSS:
        self.before = _status_bytes("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")
            self.reset = True
        except OSError:
            self.reset = False
        return self

    def __exit__(self, *exc: object) -> None:
        import resource

        self.peak = (_status_bytes("VmHWM") if self.reset
                     else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


# ---------------------------------------------------------------------- the run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__, __spec__)
    p.add_argument("--json", "--out", dest="out", default=str(common.RESULTS / "data.json"),
                   help="JSON result file (bench/results/data.json)")
    p.add_argument("--dir", help="the dataset's directory, reused if it holds this bench's "
                   "dataset of the same parameters (default: one per size under the temp dir)")
    p.add_argument("--quick", action="store_true",
                   help=f"a small run for tests: {QUICK['size_mb']} MiB in {QUICK['files']} "
                        f"files, one round")
    p.add_argument("--size-mb", type=common.positive(float),
                   help=f"dataset size in MiB (default {FULL['size_mb']})")
    p.add_argument("--files", type=common.positive(), help=f"files (default {FULL['files']})")
    p.add_argument("--row-group-mb", type=common.positive(float),
                   help=f"row group size in MiB (default {FULL['row_group_mb']:g})")
    p.add_argument("--features", type=common.positive(), default=256,
                   help="float32 features a row (default 256)")
    p.add_argument("--global-batch", type=common.positive(), default=256,
                   help="rows per step (default 256)")
    p.add_argument("--micro-batch", type=common.positive(),
                   help="rows per micro-batch (default: the global batch)")
    p.add_argument("--step-ms", type=common.positive(float), default=20.0,
                   help="the slow fake step's time (default 20 ms)")
    p.add_argument("--slow-steps", type=common.positive(),
                   help="steps of the slow variant (default: two cycles of the stream's "
                        "windows, at most an epoch)")
    p.add_argument("--prefetch", type=int, choices=range(0, 65), default=2, metavar="0..64",
                   help="steps the feeder reads ahead, as data.prefetch (default 2, its default)")
    p.add_argument("--rounds", type=common.positive(),
                   help=f"rounds of stream and raw, alternating (default {FULL['rounds']})")
    p.add_argument("--resume-reps", type=common.positive(),
                   help=f"fresh processes per resume position (default {FULL['resume_reps']})")
    p.add_argument("--loader-workers", type=int, choices=(0, 1, 2), default=2,
                   help="DataLoader workers (default 2)")
    p.add_argument("--no-ray", action="store_true", help="leave Ray Data out")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.micro_batch is None:
        args.micro_batch = args.global_batch
    if args.global_batch % args.micro_batch:
        p.error(f"--global-batch ({args.global_batch}) must be a multiple of --micro-batch "
                f"({args.micro_batch})")
    params = dataset_params(args)
    if params["rows"] < params["files"] * args.global_batch:
        p.error(f"--size-mb {args.size_mb:g} holds {params['rows']} rows: fewer than a global "
                f"batch ({args.global_batch}) per file ({args.files} files); raise --size-mb")
    if args.dir is None:
        args.dir = os.path.join(tempfile.gettempdir(),
                                f"stalwart-bench-data-{args.size_mb:g}mb-{args.features}f")
    return args


def slow_steps(args: argparse.Namespace, lanes: int, window: int, row_group_rows: int,
               epoch_steps: int) -> int:
    """Two cycles of the windows: every lane crosses a window's end (and reads its next
    window's units) once per cycle, so the figure includes those reads."""
    cycle = -(-window * row_group_rows // (args.global_batch // lanes))
    return args.slow_steps or min(epoch_steps, max(20, 2 * cycle))


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    directory = Path(args.dir)
    params = dataset_params(args)
    t0 = time.perf_counter()
    meta, written = make_dataset(directory, params)
    size = sum(meta["sizes"].values())
    print(f"dataset: {directory}, {size / MIB:,.0f} MiB in {len(meta['sizes'])} files, "
          f"{params['rows']:,} rows, row groups of {params['row_group_rows']:,} rows; "
          + (f"written in {time.perf_counter() - t0:.1f} s" if written else "reused"),
          flush=True)
    warm_page_cache(directory, meta)
    cache = str(work / "cache")
    out: dict[str, Any] = {"dataset": {"dir": str(directory), "bytes": size, "written": written,
                                       **params}}
    out |= rates(directory, meta, args, cache, params)
    out["order_and_ids"] = ids_cost(directory, args, cache)
    out["resume"] = resume_run(directory, args, cache, params["rows"])
    out["index"] = index_run(directory, meta, args, work)
    warm_page_cache(directory, meta)  # as it was, for whatever reads it next
    return out


def stream_memory(directory: Path, args: argparse.Namespace, cache: str, steps: int,
                  size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The stream's first epoch, under PeakRSS: (its rates, its memory)."""
    import pyarrow as pa

    import stalwart.workers.feeder  # noqa: F401

    # What a stream imports (and its files' footers) loaded before the memory is measured;
    # no unit is read, so the allocator holds none of the data yet.
    open_stream(directory, cache, args.global_batch)
    gc.collect()
    pool = pa.default_memory_pool()
    with PeakRSS() as rss:
        run = stream_run(directory, args, cache, steps=steps)
    # What the stream's LRU of units may hold (FileStream: each lane's window and the next
    # one, read ahead, and the tail's: 2 x lanes x window + window + 2 units).
    cached = 2 * run["lanes"] * run["window"] + run["window"] + 2
    return run, {"rss_before": rss.before, "peak_rss": rss.peak, "hwm_reset": rss.reset,
                 "dataset_over_peak": size / rss.peak, "cached_units": cached,
                 "cached_bytes": cached * size / run["units"],
                 "arrow_pool": pool.backend_name, "arrow_peak": pool.max_memory()}


def rates(directory: Path, meta: dict[str, Any], args: argparse.Namespace, cache: str,
          params: dict[str, Any]) -> dict[str, Any]:
    """Every reader's samples/s: the stream and the raw scan in alternating rounds (the
    stream's first epoch measured for memory, before any other reader grew the process),
    the stream behind a slow step, the DataLoader and Ray Data."""
    epoch_steps = params["rows"] // args.global_batch
    first, memory = stream_memory(directory, args, cache, epoch_steps,
                                  sum(meta["sizes"].values()))
    out: dict[str, Any] = {"stream": [first], "raw": [], "memory": memory}
    _progress("stream", first)
    for rnd in range(args.rounds):
        for name in ["raw", "stream"] if rnd % 2 == 0 else ["stream", "raw"]:
            if name == "stream" and rnd == 0:
                continue  # the first epoch, above
            out[name].append(raw_run(directory, args) if name == "raw" else
                             stream_run(directory, args, cache, steps=epoch_steps))
            _progress(name, out[name][-1])
    steps = slow_steps(args, first["lanes"], first["window"], params["row_group_rows"],
                       epoch_steps)
    for key, depth in (("stream_slow", args.prefetch), ("stream_slow_deep", DEEP_PREFETCH)):
        if key == "stream_slow_deep" and args.prefetch >= DEEP_PREFETCH:
            continue
        out[key] = stream_run(directory, args, cache, steps=steps,
                              step_s=args.step_ms / 1000, depth=depth)
        _progress(f"stream, {args.step_ms:g} ms steps, prefetch {depth}", out[key])
    out["loader"] = loader_run(directory, meta, args)
    _progress(f"DataLoader ({args.loader_workers} workers)", out["loader"])
    if args.no_ray:
        out["ray"] = {"skipped": "--no-ray"}
    else:
        out["ray"] = ray_run(directory, args)
        _progress("Ray Data", out["ray"])
    return out


def _progress(name: str, r: dict[str, Any]) -> None:
    extra = f", waited {r['wait_share']:.1%}" if "wait_share" in r else ""
    print(f"  {name}: {r['samples_per_s']:,.0f} samples/s ({r['samples']:,} in "
          f"{r['wall_s']:.2f} s{extra})", flush=True)


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure of the table, the median over rounds."""
    keys = ("samples_per_s", "after_first_per_s", "first_batch_s", "wait_share")
    return {k: statistics.median(r[k] for r in runs) for k in keys if k in runs[0]}


def summarize(out: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The figures and goals: printed as a table, and the JSON's head."""
    medians = {"stream": _medians(out["stream"]), "raw": _medians(out["raw"])}
    stream, raw = medians["stream"]["samples_per_s"], medians["raw"]["samples_per_s"]
    slow, resume, memory = out["stream_slow"], out["resume"], out["memory"]
    per_read = args.micro_batch / stream
    rates = {"stream": stream, "raw": raw, "loader": out["loader"]["samples_per_s"],
             "ray": out["ray"].get("samples_per_s")}
    wait = slow["steady_wait_share"]
    goals = {
        "stream_over_raw": {"value": ratio(stream, raw), "goal": f">= {GOAL_RAW}",
                            "met": stream >= GOAL_RAW * raw},
        "slow_step_wait_share": {"value": wait, "goal": f"<= {GOAL_WAIT}",
                                 "met": wait is not None and wait <= GOAL_WAIT},
        "resume_deep_over_near": {"value": resume["deep_over_near"],
                                  "goal": f"<= {GOAL_RESUME} (fastest of the repeats)",
                                  "met": resume["deep_over_near"] <= GOAL_RESUME},
        "dataset_over_peak_rss": {"value": memory["dataset_over_peak"],
                                  "goal": f">= {GOAL_MEMORY:g}",
                                  "met": memory["dataset_over_peak"] >= GOAL_MEMORY}}
    shares = {k.removesuffix("_s") + "_share_of_read": v / per_read
              for k, v in out["order_and_ids"].items()}
    return {"samples_per_s": rates, "goals": goals, "medians": medians, **shares}


def print_table(out: dict[str, Any], summary: dict[str, Any], args: argparse.Namespace) -> None:
    goals, medians = summary["goals"], summary["medians"]
    raw = medians["raw"]["samples_per_s"]
    mib_per_sample = (args.features * 4 + 8) / MIB
    rows = [["reader", "samples/s", "MiB/s", "x raw", "after 1st", "1st batch", "data wait"]]

    def line(name: str, r: dict[str, Any], wait: str = "") -> None:
        rate = r["samples_per_s"]
        rows.append([name, fmt(rate), fmt(rate * mib_per_sample, ",.0f"),
                     fmt(ratio(rate, raw), ".3f"), fmt(r["after_first_per_s"]),
                     fmt(r["first_batch_s"], ".3f") + " s", wait])

    slow = out["stream_slow"]
    line("stalwart stream", medians["stream"], f"{medians['stream']['wait_share']:.1%}")
    for r in (slow, out.get("stream_slow_deep")):
        if r is not None:
            line(f"  + {args.step_ms:g} ms step, prefetch {r['prefetch']}", r,
                 f"{fmt(r['steady_wait_share'], '.2%')} after the 1st")
    line("pyarrow.dataset scan", medians["raw"])
    line(f"DataLoader, {args.loader_workers} workers", out["loader"])
    if "skipped" in out["ray"]:
        rows.append(["Ray Data", "skipped", "", "", "", "", out["ray"]["skipped"]])
    else:
        line("Ray Data", out["ray"])
    print(f"\n{args.global_batch}-row steps (micro-batch {args.micro_batch}); stream and raw "
          f"scan: medians of {args.rounds} round(s); the {args.step_ms:g} ms step variant: "
          f"{slow['steps']} steps; load {out['load'][0]:.1f} before, {out['load'][1]:.1f} after")
    common.print_columns(rows)
    resume, index, memory = out["resume"], out["index"], out["memory"]
    print(f"\nresume (a fresh process: list files + bind + first micro-batch), median of "
          f"{args.resume_reps} and fastest:")
    for name in ("near", "deep"):
        r = resume[name]
        print(f"  {name:>4} (position {resume['positions'][name]:>10,}): {r['total_s']:.3f} s "
              f"= list {r['list_s']:.3f} + bind {r['bind_s']:.3f} + first batch "
              f"{r['first_batch_s']:.3f}; fastest {r['min_s']:.3f} s")
    print(f"index (bind) over {index['units']} units: cold {index['cold_s']:.3f} s"
          f"{'' if index['evicted'] else ' (pages not evicted: no fadvise)'}, "
          f"warm {index['warm_s']:.3f} s")
    print(f"memory: peak RSS {memory['peak_rss'] / MIB:,.0f} MiB, of which "
          f"{(memory['peak_rss'] - memory['rss_before']) / MIB:,.0f} MiB grown while streaming "
          f"{out['dataset']['bytes'] / MIB:,.0f} MiB of files; its cache holds up to "
          f"{memory['cached_units']} units, about {memory['cached_bytes'] / MIB:,.0f} MiB; Arrow's "
          f"peak allocation {memory['arrow_peak'] / MIB:,.0f} MiB ({memory['arrow_pool']})")
    ids = out["order_and_ids"]
    print(f"a micro-batch's locate in the order: {ids['locate_s'] * 1e6:,.0f} us "
          f"({summary['locate_share_of_read']:.1%} of its read); its ledger ids: "
          f"{ids['ids_s'] * 1e6:,.0f} us ({summary['ids_share_of_read']:.1%})")
    print("\ngoals:")
    for name, g in goals.items():
        print(f"  {name}: {fmt(g['value'], '.3f')}  goal {g['goal']}: "
              f"{'MET' if g['met'] else 'NOT MET'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import pyarrow as pa
    import torch

    # The machine's 2 cores: pyarrow's pools and torch's threads kept to them.
    pa.set_cpu_count(2)
    pa.set_io_thread_count(2)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-data-"))
    load = os.getloadavg()[0]
    try:
        out = measure(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    out["load"] = [load, os.getloadavg()[0]]  # a shared machine's other work, before and after
    summary = summarize(out, args)
    print_table(out, summary, args)
    common.write_json(args.out, {
        "bench": "data", "time": time.time(), **summary, **out,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "machine": common.machine(with_ray=not args.no_ray)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
