"""Limits: how close stalwart's checkpoint tiers come to the machine they run on, each stalwart
path against the plain operation that bounds it, on the same bytes, in one run.

1. Memory-tier restore against raw TCP. Two Ray actors, a holder and a restoring rank: the
   holder's `MemoryTier.export` is returned through an actor call and handed, as an
   ObjectRef, to the restoring actor's `MemoryTier.restore` (fetch, CRC32 check, copy into
   its state), as a recovery does. Against: a plain socket `sendall` / `recv_into` of as many
   bytes between the same two actors. Both timed from the driver.
2. Snapshot staging against memcpy. `SnapshotStager.stage` of a model's and its optimizer's
   state into its reused buffer, against one `copy_` of as many bytes into a preallocated
   buffer; and what the CRC32 seal (`Shard.seal`) costs on top.
3. Storage write against a sequential write. `StorageCheckpointer.save_snapshot` of the
   staged shard until committed (its copy, DCP's write with each file hashed and fsynced,
   the manifest), against open / write / fsync of as many bytes in the same directory. Then
   the step stall of an asynchronous save: today's (save_snapshot on a thread) against DCP's
   process-based `async_save` (its DefaultStager in shared memory, pinned where CUDA is).

Each pair runs in alternating rounds and each side's fastest round is reported: on a shared
host other processes only ever add time. The stall is a median. Every process runs torch on
one thread, as a worker with the default cpus_per_worker = 1 does.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import math
import os
import shutil
import socket
import statistics
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import common

GOAL = 0.8  # each stalwart path >= 0.8 x the plain operation's GB/s
GIB = 2**30
LAYERS = 16  # Linear(d, d) layers: 12 bytes of state a parameter (weights, Adam's two moments)
GEN, SOURCE, STEP = 0, 0, 1  # the snapshot restored: generation, source rank, step
BATCH = 8  # rows of the training step run while an asynchronous save is in flight


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__, __spec__, "limits.json")
    p.add_argument("--gib", type=common.positive(float), default=1.0,
                   help="GiB of model and optimizer state a rank (default 1.0)")
    p.add_argument("--rounds", type=common.positive(), default=5,
                   help="rounds of the memory and staging pairs, under a second each "
                        "(default 5)")
    p.add_argument("--io-rounds", type=common.positive(), default=3,
                   help="rounds of the storage write pair (default 3)")
    p.add_argument("--stall-rounds", type=common.positive(), default=2,
                   help="saves of each kind whose step stall is measured (default 2)")
    p.add_argument("--dir", default=tempfile.gettempdir(),
                   help="where the storage part writes (default the temp dir)")
    return p.parse_args(argv)


# ---------------------------------------------------------------------- verdicts and table


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


def verdict(ratio: float | None, goal: float | None) -> str:
    """MET / NOT MET against a goal; "-" for a row with no goal or nothing measured."""
    if goal is None or ratio is None:
        return "-"
    return "MET" if ratio >= goal else "NOT MET"


def row(name: str, measured: float | None, baseline_name: str, baseline: float | None,
        goal: float | None = GOAL, unit: str = "GB/s") -> dict[str, Any]:
    """One line of the table: a stalwart figure against its baseline (higher is better)."""
    ratio = common.ratio(measured, baseline)
    return {"name": name, "measured": measured, "baseline_name": baseline_name,
            "baseline": baseline, "unit": unit, "ratio": ratio, "goal": goal,
            "verdict": verdict(ratio, goal)}


def table(rows: list[dict[str, Any]]) -> list[list[str]]:
    out = [["path", "measured", "baseline", "", "ratio", "goal", "verdict"]]
    for r in rows:
        out.append([r["name"], f"{common.fmt(r['measured'], '.2f')} {r['unit']}",
                    f"{common.fmt(r['baseline'], '.2f')} {r['unit']}", r["baseline_name"],
                    common.fmt(r["ratio"], ".2f") + ("x" if r["ratio"] is not None else ""),
                    f">= {r['goal']}x" if r["goal"] is not None else "-", r["verdict"]])
    return out


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def best(xs: list[float]) -> float | None:
    """The fastest round: on a shared host, every other process only ever adds time."""
    return min(xs) if xs else None


def alternate(rounds: int, first: Callable[[], float], second: Callable[[], float]
              ) -> tuple[list[float], list[float]]:
    """Each callable's seconds per round, their order flipping every round (a shared host's
    drifts favour neither)."""
    a: list[float] = []
    b: list[float] = []
    for rnd in range(rounds):
        if rnd % 2 == 0:
            a.append(first())
            b.append(second())
        else:
            b.append(second())
            a.append(first())
    return a, b


# ---------------------------------------------------------------------- the state


class BenchState:
    """A rank's training state: LAYERS Linear(d, d) and AdamW, about `gib` GiB in all, read
    and written as the engine does (DCP's get_state_dict / set_state_dict)."""

    def __init__(self, gib: float, seed: int) -> None:
        torch.manual_seed(seed)
        self.width = max(8, int(math.sqrt(gib * GIB / 12 / LAYERS)))
        self.model = torch.nn.Sequential(*(torch.nn.Linear(self.width, self.width)
                                           for _ in range(LAYERS)))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.step = 0
        self.train_step()  # Adam's moments exist from the first step on

    def train_step(self) -> None:
        x = torch.randn(BATCH, self.width)
        self.model(x).square().mean().backward()
        self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.model, self.optim)
        return {"model": model, "optim": optim, "train": {"step": self.step}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        self.step = int(state["train"]["step"])

    def view(self) -> Any:
        from stalwart.checkpointing.memory.tier import StateAccess

        return StateAccess(state_dict=self.state_dict,
                           scalar_state=lambda: {"train": {"step": self.step}},
                           signature=lambda: 0, load_state_dict=self.load_state_dict,
                           device=torch.device("cpu"))

    def stager(self, buffers: int = 2) -> Any:
        from stalwart.checkpointing.snapshot import SnapshotStager

        v = self.view()
        return SnapshotStager(state_dict=v.state_dict, scalar_state=v.scalar_state,
                              signature=v.signature, device=v.device, buffers=buffers)

    def digest(self) -> int:
        """CRC32 of every tensor of the state, in order: equal states, equal digests."""
        crc = 0
        for t in _tensors(self.state_dict()):
            crc = zlib.crc32(t.contiguous().view(-1).view(torch.uint8).numpy(), crc)
        return crc


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for k in sorted(tree, key=str) for t in _tensors(tree[k])]
    if isinstance(tree, list | tuple):
        return [t for v in tree for t in _tensors(v)]
    return []


def touched(nbytes: int) -> torch.Tensor:
    """A buffer of nbytes with every page already faulted in (as a reused buffer is)."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(0)
    return buf


# ---------------------------------------------------------------------- 1. memory tier vs TCP


class Rank:
    """One Ray actor of part 1: a holder (its own snapshot in its tier's store) or a
    restoring rank (a state of the same shapes, other values)."""

    def __init__(self, gib: float, seed: int) -> None:
        from stalwart.checkpointing.memory.tier import MemoryTier

        torch.set_num_threads(1)
        self.state = BenchState(gib, seed)
        self.tier = MemoryTier()
        self._listener: socket.socket | None = None
        self._inbox: torch.Tensor | None = None

    def hold(self) -> Any:
        """Stage and seal this rank's snapshot of STEP and keep it in the store; its layout."""
        shard = self.state.stager(buffers=1).stage(STEP)
        shard.seal()
        self.tier.store.put(GEN, SOURCE, shard)
        return shard.layout

    def export(self, generation: int, source: int, step: int) -> Any:
        return self.tier.export(generation, source, step)  # as the worker actor's method

    def restore(self, layouts: dict[int, Any], sources: dict[int, Any]) -> dict[str, Any]:
        """What a worker's restore_memory does, with the fetch timed apart."""
        import ray

        fetch_s = 0.0

        def fetch(src: int) -> Any:
            nonlocal fetch_s
            t0 = time.perf_counter()
            got = ray.get(sources[src])
            fetch_s += time.perf_counter() - t0
            return got

        t0 = time.perf_counter()
        fetched = self.tier.restore(self.state.view(), generation=GEN, step=STEP,
                                    layouts=layouts, fetch=fetch)
        return {"restore_s": time.perf_counter() - t0, "fetch_s": fetch_s,
                "fetched": fetched}

    def digest(self) -> int:
        return self.state.digest()

    def crc_s(self, threads: int) -> float:
        """Seconds to check the held snapshot's CRC32 as a restore does, on `threads`."""
        from stalwart.checkpointing.snapshot import buffer_crc

        shard = self.tier.store.get(GEN, SOURCE, STEP)
        assert shard is not None
        t0 = time.perf_counter()
        if buffer_crc(shard.buffer, threads) != shard.crc:
            raise RuntimeError("the held snapshot no longer matches its CRC32")
        return time.perf_counter() - t0

    def listen(self, nbytes: int) -> int:
        """A listening socket on the loopback and a buffer to receive into; its port."""
        if self._listener is None:
            self._listener = socket.create_server(("127.0.0.1", 0))
        if self._inbox is None or self._inbox.numel() != nbytes:
            self._inbox = touched(nbytes)
        return int(self._listener.getsockname()[1])

    def receive(self) -> float:
        """Accept one connection and recv_into the buffer until it is full; seconds."""
        assert self._listener is not None and self._inbox is not None
        conn, _ = self._listener.accept()
        view, got = memoryview(self._inbox.numpy()), 0
        t0 = time.perf_counter()
        with conn:
            while got < len(view):
                n = conn.recv_into(view[got:])
                if n == 0:
                    raise ConnectionError(f"the sender closed after {got} of {len(view)} bytes")
                got += n
        return time.perf_counter() - t0

    def send(self, port: int) -> float:
        """sendall this rank's snapshot buffer to the port; seconds."""
        shard = self.tier.store.get(GEN, SOURCE, STEP)
        assert shard is not None
        with socket.create_connection(("127.0.0.1", port)) as conn:
            t0 = time.perf_counter()
            conn.sendall(memoryview(shard.buffer.numpy()))
            return time.perf_counter() - t0


def memory_part(gib: float, rounds: int) -> dict[str, Any]:
    import ray

    ray.init(address="local", num_cpus=2, object_store_memory=max(3 * int(gib * GIB), 2**28),
             include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        actor = ray.remote(num_cpus=1)(Rank)
        holder, restorer = actor.remote(gib, 1), actor.remote(gib, 2)
        layout = ray.get(holder.hold.remote())
        port = ray.get(restorer.listen.remote(layout.nbytes))
        details: list[dict[str, Any]] = []

        def tier() -> float:
            t0 = time.perf_counter()
            ref = holder.export.remote(GEN, SOURCE, STEP)
            ray.wait([ref], fetch_local=False)  # exported: in the object store
            t1 = time.perf_counter()
            report = ray.get(restorer.restore.remote({SOURCE: layout}, {SOURCE: ref}))
            t2 = time.perf_counter()
            details.append(report | {"export_s": t1 - t0, "seconds": t2 - t0})
            return t2 - t0

        def tcp() -> float:
            t0 = time.perf_counter()
            ray.get([restorer.receive.remote(), holder.send.remote(port)])
            return time.perf_counter() - t0

        tier(), tcp()  # warm-up: the object store's and the socket's first pages
        details.clear()
        tier_s, tcp_s = alternate(rounds, tier, tcp)
        same = ray.get(holder.digest.remote()) == ray.get(restorer.digest.remote())
        # The check a restore makes, on the one thread a rank has here and on two (a rank
        # with cpus_per_worker = 2 checks its shard's halves at once).
        crc = {t: [ray.get(holder.crc_s.remote(t)) for _ in range(rounds)] for t in (1, 2)}
    finally:
        ray.shutdown()
    return {"nbytes": layout.nbytes, "tier_s": tier_s, "tcp_s": tcp_s, "restores": details,
            "restored_state_equals_holders": same, "crc_check_s": crc}


def memory_rows(m: dict[str, Any]) -> list[dict[str, Any]]:
    n = m["nbytes"]
    return [row("memory-tier restore (export -> restore)", gbps(n, best(m["tier_s"])),
                "raw TCP, same 2 actors", gbps(n, best(m["tcp_s"])))]


# ---------------------------------------------------------------------- 2. staging vs memcpy


def staging_part(state: BenchState, rounds: int) -> dict[str, Any]:
    """Stage (in the steady state: both buffers' pages touched) against one copy_ of the
    same tensor bytes; then stage and seal, the seal timed."""
    stager = state.stager()
    for _ in range(2):
        shard = stager.stage(STEP)
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in _tensors(state.state_dict())])
    dest = touched(flat.numel())

    def stage() -> float:
        t0 = time.perf_counter()
        stager.stage(STEP)
        return time.perf_counter() - t0

    def memcpy() -> float:
        t0 = time.perf_counter()
        dest.copy_(flat)
        return time.perf_counter() - t0

    stage_s, copy_s = alternate(rounds, stage, memcpy)
    seal_s = []
    for _ in range(rounds):
        shard = stager.stage(STEP)
        t0 = time.perf_counter()
        shard.seal()
        seal_s.append(time.perf_counter() - t0)
    return {"nbytes": shard.layout.nbytes, "tensor_bytes": flat.numel(),
            "tensors": len(shard.layout.slots), "stage_s": stage_s, "memcpy_s": copy_s,
            "seal_s": seal_s, "stager": stager}


def staging_rows(s: dict[str, Any]) -> list[dict[str, Any]]:
    n, copy = s["tensor_bytes"], gbps(s["tensor_bytes"], best(s["memcpy_s"]))
    stage, seal = best(s["stage_s"]), best(s["seal_s"])
    return [row("snapshot staging (SnapshotStager.stage)", gbps(n, stage),
                "copy_ into a buffer", copy),
            row("  staging + CRC32 seal", gbps(n, stage + seal if stage and seal else None),
                "copy_ into a buffer", copy, goal=None)]


# ---------------------------------------------------------------------- 3. storage vs write


def _trust() -> Any:
    from stalwart.checkpointing.storage.signing import CheckpointTrust, SigningKey

    return CheckpointTrust(key=SigningKey(secret=b"limits bench", source="bench/limits.py"),
                           run_id="limits")


def checkpointer(url: Path) -> Any:
    """Rank 0's checkpointer as a worker makes it (asynchronous), keeping every checkpoint:
    the write alone is timed, not retention's deletions and read-backs (timed apart)."""
    from stalwart.checkpointing.storage.writer import StorageCheckpointer

    return StorageCheckpointer(str(url), rank=0, keep_last=0, async_save=True,
                               manifest_extra={"world_size": 1}, trust=_trust())


def verify_s(url: Path, step: int) -> float:
    """Seconds retention takes to verify one checkpoint (its files read back and hashed):
    with keep_last >= 2 every commit does it once, for the checkpoint committed before."""
    from stalwart.checkpointing.storage.catalog import read_checkpoint, verify

    t0 = time.perf_counter()
    verify(read_checkpoint(str(url), step), _trust())
    return time.perf_counter() - t0


def sequential_write(path: Path, data: torch.Tensor) -> float:
    """open, write, fsync, close: the plain write of these bytes; seconds. The file stays
    (as a checkpoint does): each write fills fresh pages of the page cache, as a save does."""
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.write(memoryview(data.numpy()))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def storage_part(shard: Any, root: Path, rounds: int) -> dict[str, Any]:
    """save_snapshot until committed (its copy, DCP's write with every file hashed and
    fsynced, the manifest) against a sequential write; one warm-up save first. Each side's
    CPU seconds (all of this process's threads) too: on a busy host they vary far less than
    its wall time."""
    ckpt = checkpointer(root / "ckpt")
    steps = iter(range(STEP, 10**6))
    cpu: dict[str, list[float]] = {"save": [], "write": []}

    def save() -> float:
        shard.step = next(steps)
        c0, t0 = time.process_time(), time.perf_counter()
        ckpt.save_snapshot(shard)
        ckpt.wait()
        cpu["save"].append(time.process_time() - c0)
        return time.perf_counter() - t0

    def write() -> float:
        c0 = time.process_time()
        seconds = sequential_write(root / f"plain-{len(cpu['write'])}.bin", shard.buffer)
        cpu["write"].append(time.process_time() - c0)
        return seconds

    try:
        save()
        cpu["save"].clear()  # the warm-up's
        save_s, write_s = alternate(rounds, save, write)
    finally:
        ckpt.close()
    return {"nbytes": shard.layout.nbytes, "save_s": save_s, "write_s": write_s,
            "save_cpu_s": cpu["save"], "write_cpu_s": cpu["write"],
            "retention_verify_s": verify_s(root / "ckpt", shard.step),
            "passes": write_passes(shard)}


class _Sink(io.RawIOBase):
    """A stream that keeps nothing: torch.save's own work, without a file's."""

    def __init__(self) -> None:
        self.n = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        self.n += n
        return n

    def tell(self) -> int:
        return self.n


def _torch_saves(shard: Any, crc: bool) -> float:
    """Seconds for torch.save of every slot's tensor, as DCP's writer does, into a sink."""
    from torch.serialization import get_crc32_options, set_crc32_options

    was = get_crc32_options()
    set_crc32_options(crc)
    try:
        t0 = time.perf_counter()
        for index in shard.layout.slots:
            torch.save(shard.tensor(index), _Sink())
        return time.perf_counter() - t0
    finally:
        set_crc32_options(was)


def write_passes(shard: Any) -> dict[str, float]:
    """Seconds of each pass the storage write makes over the bytes on its one thread,
    besides the write itself: save_snapshot's copy of the staged buffer, torch.save's CRC32
    of each zip record, the sha256 of each file (storage/hashing.py)."""
    dest = touched(shard.buffer.numel())
    t0 = time.perf_counter()
    dest.copy_(shard.buffer)
    t1 = time.perf_counter()
    hashlib.sha256(memoryview(shard.buffer.numpy())).hexdigest()
    t2 = time.perf_counter()
    return {"copy_s": t1 - t0, "sha256_s": t2 - t1,
            "zip_crc32_s": max(0.0, _torch_saves(shard, True) - _torch_saves(shard, False))}


def storage_rows(s: dict[str, Any]) -> list[dict[str, Any]]:
    n = s["nbytes"]
    return [row("storage write (save_snapshot -> committed)", gbps(n, best(s["save_s"])),
                "open/write/fsync", gbps(n, best(s["write_s"])))]


# ---------------------------------------------------------------------- 3b. the step stall


def stalled(state: BenchState, start: Callable[[], Any], done: Callable[[Any], bool]
            ) -> dict[str, Any]:
    """Train steps while a save started by `start()` is in flight; `done(handle)` says it is
    complete. The stall: the time from the save's start to the end of the first step after
    it completed, less as many normal steps (timed just before: a shared host's load
    drifts)."""
    base_step_s = step_time(state, 3)
    t0 = time.perf_counter()
    handle = start()
    blocking = time.perf_counter() - t0
    steps, slowest = 0, 0.0
    while True:
        finished = done(handle)
        t1 = time.perf_counter()
        state.train_step()
        slowest = max(slowest, time.perf_counter() - t1)
        steps += 1
        if finished:
            break
    elapsed = time.perf_counter() - t0
    return {"blocking_s": blocking, "steps": steps, "elapsed_s": elapsed,
            "base_step_s": base_step_s, "slowest_step_s": slowest,
            "stall_s": max(0.0, elapsed - steps * base_step_s)}


def step_time(state: BenchState, n: int) -> float:
    """The median of n training steps' seconds."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        state.train_step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class ThreadSave:
    """Today's asynchronous save: the memory tier's staged snapshot (staged before the save
    starts, as the tier does anyway) written by StorageCheckpointer.save_snapshot on its
    background thread."""

    name = "thread"

    def __init__(self, state: BenchState, stager: Any, root: Path) -> None:
        self.state, self.stager = state, stager
        self.ckpt = checkpointer(root / "thread")
        self.steps = iter(range(STEP, 10**6))
        self.shard: Any = None

    def prepare(self) -> None:
        self.shard = self.stager.stage(self.state.step)
        self.shard.seal()
        self.shard.step = next(self.steps)

    def start(self) -> Any:
        return self.ckpt.save_snapshot(self.shard)

    def done(self, _: Any) -> bool:
        return bool(self.ckpt.poll())  # rank 0's commit report, once the save is committed

    def close(self) -> None:
        self.ckpt.close()


class ProcessSave:
    """DCP's process-based async_save of the live state: its DefaultStager copies the state
    into shared memory (pinned memory and a staging thread where CUDA is), its daemon
    process writes it with DCP's FileSystemWriter."""

    name = "process"

    def __init__(self, state: BenchState, root: Path) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = torch.cuda.is_available()
        self.stager = DefaultStager(StagingOptions(
            use_pinned_memory=cuda, use_shared_memory=True, use_async_staging=cuda,
            use_non_blocking_copy=cuda))
        self.state, self.root = state, root / "process"
        self.steps = iter(range(STEP, 10**6))

    def prepare(self) -> None:
        pass

    def start(self) -> Any:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        return dcp.async_save(self.state.state_dict(),
                              checkpoint_id=str(self.root / str(next(self.steps))),
                              async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                              async_stager=self.stager)

    def done(self, handle: Any) -> bool:
        return bool(getattr(handle, "upload_completion", handle).done())

    def close(self) -> None:
        self.stager.close()


def stall_part(state: BenchState, stager: Any, root: Path, rounds: int) -> dict[str, Any]:
    """Each save's stall, in alternating rounds after one warm-up save each (the first
    process-based save starts DCP's daemon)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=0, world_size=1)
    savers = [ThreadSave(state, stager, root), ProcessSave(state, root)]
    out: dict[str, Any] = {s.name: [] for s in savers}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP's, once a save
            for rnd in range(rounds + 1):
                for saver in savers if rnd % 2 == 0 else savers[::-1]:
                    saver.prepare()
                    result = stalled(state, saver.start, saver.done)
                    if rnd > 0:
                        out[saver.name].append(result)
    finally:
        for saver in savers:
            saver.close()
        dist.destroy_process_group()
    return out


def stall_summary(s: dict[str, Any]) -> dict[str, Any]:
    """Each save's median figures over its rounds."""
    keys = ("blocking_s", "stall_s", "elapsed_s", "steps", "base_step_s", "slowest_step_s")
    return {name: {k: med([r[k] for r in s[name]]) for k in keys}
            for name in ("thread", "process")}


# ---------------------------------------------------------------------- the whole bench


def print_report(report: dict[str, Any]) -> None:
    rounds = report["rounds"]
    print(f"\nlimits: {report['gib']} GiB of state a rank; the fastest of {rounds['rounds']} "
          f"rounds (storage: {rounds['io_rounds']}); torch on 1 thread; {os.cpu_count()} CPUs, "
          f"load average {report['load_before']:.1f} before, {report['load_after']:.1f} after")
    common.print_columns(table(report["rows"]))
    m, s = report["memory"], report["staging"]
    r = min(m["restores"], key=lambda x: x["seconds"])
    print(f"memory restore, fastest round: export {r['export_s']:.3f} s, restore "
          f"{r['restore_s']:.3f} s (fetch {r['fetch_s']:.3f} s, the rest CRC32 check and "
          f"copy); the restored state equals the holder's: {m['restored_state_equals_holders']}")
    crc1, crc2 = (best(m["crc_check_s"][t]) for t in (1, 2))
    print(f"CRC32 check of a restore: {common.fmt(gbps(m['nbytes'], crc1), '.2f')} GB/s on one "
          f"thread (cpus_per_worker = 1), {common.fmt(gbps(m['nbytes'], crc2), '.2f')} GB/s on "
          f"two")
    seal = best(s["seal_s"])
    print(f"CRC32 seal (Shard.seal): {common.fmt(seal, '.3f')} s for {s['nbytes'] / GIB:.2f} "
          f"GiB, {common.fmt(gbps(s['nbytes'], seal), '.2f')} GB/s; staging "
          f"{common.fmt(best(s['stage_s']), '.3f')} s")
    st = report["storage"]
    p = st["passes"]
    print(f"storage write: {best(st['save_s']):.3f} s against {best(st['write_s']):.3f} s, "
          f"CPU {med(st['save_cpu_s']):.3f} s against {med(st['write_cpu_s']):.3f} s; its "
          f"passes over the bytes besides the write, one after another on one thread: copy "
          f"{p['copy_s']:.3f} s, torch.save's zip CRC32 {p['zip_crc32_s']:.3f} s, sha256 "
          f"{p['sha256_s']:.3f} s; retention's read-back of one checkpoint (each commit, "
          f"keep_last >= 2) {st['retention_verify_s']:.3f} s")
    print(f"async save of the whole state, the training step's stall (median of "
          f"{rounds['stall_rounds']} saves each):")
    for name, what in (("thread", "today, save_snapshot on a thread"),
                       ("process", "DCP async_save, process-based")):
        x = report["stall_summary"][name]
        print(f"  {what}: blocks the step {common.fmt(x['blocking_s'], '.3f')} s, stall "
              f"{common.fmt(x['stall_s'], '.3f')} s in all over the "
              f"{common.fmt(x['elapsed_s'], '.2f')} s the save took "
              f"({common.fmt(x['steps'], '.0f')} steps; a normal one "
              f"{common.fmt(x['base_step_s'], '.3f')} s, the slowest "
              f"{common.fmt(x['slowest_step_s'], '.3f')} s)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # as a worker with cpus_per_worker = 1
    t0, load_before = time.time(), os.getloadavg()[0]
    print(f"limits: {args.gib} GiB of state a rank", flush=True)
    print("1. memory-tier restore vs raw TCP (two Ray actors)", flush=True)
    memory = memory_part(args.gib, args.rounds)
    print("2. snapshot staging vs memcpy; the CRC32 seal", flush=True)
    state = BenchState(args.gib, 3)
    staging = staging_part(state, args.rounds)
    stager = staging.pop("stager")
    root = Path(tempfile.mkdtemp(prefix="stalwart-bench-limits-", dir=args.dir))
    try:
        print(f"3. storage write vs sequential write in {root}; async save stall", flush=True)
        shard = stager.stage(STEP)
        shard.seal()
        storage = storage_part(shard, root, args.io_rounds)
        stall = stall_part(state, stager, root, args.stall_rounds)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rounds = {k: getattr(args, k) for k in ("rounds", "io_rounds", "stall_rounds")}
    report = {"gib": args.gib, "rounds": rounds, "goal": GOAL, "torch_threads": 1,
              "load_before": load_before, "load_after": os.getloadavg()[0],
              "rows": memory_rows(memory) + staging_rows(staging) + storage_rows(storage),
              "memory": memory, "staging": staging, "storage": storage, "stall": stall,
              "stall_summary": stall_summary(stall), "wall_s": time.time() - t0,
              "machine": common.machine()}
    common.write_json(args.out, report)
    print_report(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
