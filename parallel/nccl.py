"""NCCL's side of leaving a failed world: its knobs, its flight recorder, and the device drain.

A survivor leaves a collective with a dead peer by aborting every communicator of its world
(parallel/distributed.py: abort_process_groups). What this module adds:

- The environment NCCL's process group must start with (`nccl_environment`, `apply`): an
  error or a timeout aborts the communicator but leaves the process alive (torch's default
  takes the process down, and with it a survivor that could have joined the next world), and
  the flight recorder is on, dumping to a private file of this process on a timeout.
- The flight recorder read in-process, as JSON (`take_flight_record`), and summarised into one
  line that names the collective a rank is stuck in and its group (`summarise_flight_record`).
  A dump file that torch wrote is read with an unpickler that resolves no global
  (`load_flight_record_file`): it can build plain containers only.
- A bounded wait for the work left on the device after an abort (`drain_device`).

Everything here imports torch lazily: the driver reads summaries without touching CUDA.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import pickle
import tempfile
import threading
from collections.abc import Callable, Mapping, MutableMapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

# Each knob: the names torch reads for it (a user who set any of them keeps theirs, and
# stalwart sets none of that knob's names), and stalwart's value.
#
# 2 is CleanUpOnly in ProcessGroupNCCL's ErrorHandlingMode (torch 2.11 and 2.13):
# 0 NoHandling, 1 TearDown, 2 CleanUpOnly, 3 SkipCleanUp (the default). On a failed or
# timed-out collective the watchdog then aborts the communicators and raises nothing; with
# 1 or 3 it rethrows the error on its own thread, which ends the whole process.
ASYNC_ERROR_HANDLING = (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"), "2")
# Entries in the flight recorder's ring buffer (torch's default is 2000 too, but say so:
# an older default was 0, off). The recorder reads TORCH_FR_BUFFER_SIZE first.
TRACE_BUFFER_SIZE = (("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"), "2000")
# On a timeout or an NCCL error, every rank's default group dumps its recorder to a file.
DUMP_ON_TIMEOUT = (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1")
# Where: torch appends the rank to this prefix. TORCH_FR_DUMP_TEMP_FILE is read first; the
# older name is set to the same prefix for tools that read it.
DUMP_FILE_NAMES = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")

# Seconds a flight-record dump may take before it is given up (it queries each recorded
# collective's CUDA events, which a wedged device can block).
DUMP_TIMEOUT_S = 2.0


def nccl_environment(dump_prefix: str) -> dict[tuple[str, ...], str]:
    """The knobs for NCCL's process groups in this process, by the names torch reads for each:
    CleanUpOnly error handling, the flight recorder on, dumped on a timeout to `dump_prefix`
    followed by the rank. Pure: `apply` puts them in the environment."""
    knobs = dict((ASYNC_ERROR_HANDLING, TRACE_BUFFER_SIZE, DUMP_ON_TIMEOUT))
    knobs[DUMP_FILE_NAMES] = dump_prefix
    return knobs


def apply(knobs: Mapping[tuple[str, ...], str],
          environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set each knob under all its names, unless the user set any of them: theirs stands.
    Returns what was set. Call it before the process's first NCCL group exists: the flight
    recorder reads its size once per process, each group its error handling when created."""
    env = os.environ if environ is None else environ
    set_now: dict[str, str] = {}
    for names, value in knobs.items():
        if any(name in env for name in names):
            continue
        for name in names:
            env[name] = set_now[name] = value
    return set_now


_dump_dir_lock = threading.Lock()
_dump_dir: str | None = None


def dump_prefix() -> str:
    """This process's prefix for the flight recorder's dump files, in a directory of its own
    (mode 0700, under the temp dir): the same for every world the process joins, since the
    recorder fixes its file name at its first dump."""
    global _dump_dir
    with _dump_dir_lock:
        if _dump_dir is None:
            _dump_dir = tempfile.mkdtemp(prefix=f"stalwart-nccl-{os.getpid()}-")
            atexit.register(_remove_if_empty, _dump_dir)  # a dump stays: it is evidence
        return os.path.join(_dump_dir, "trace_rank_")


def _remove_if_empty(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:
        pass


# ---------------------------------------------------------------------------- flight records


def _bounded(fn: Callable[[], T], timeout_s: float) -> tuple[bool, T | None]:
    """fn() on a daemon thread: (False, None) when it has not returned in `timeout_s` (the
    thread is left to it), (True, None) when it raised, else (True, its result)."""
    out: list[T | None] = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception:
            out.append(None)

    thread = threading.Thread(target=run, name="stalwart-bounded", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return (True, out[0]) if out else (False, None)


_dump_stuck = False


def take_flight_record(since_ns: int = 0, timeout_s: float = DUMP_TIMEOUT_S
                       ) -> dict[str, Any] | None:
    """This process's flight recorders, now, as one record (torch's JSON layout): NCCL's
    (CUDA builds) and the generic one that gloo records into, entries merged in the order
    they were recorded. A torch without those dumps: the newest file this process's
    recorder dumped since `since_ns`, if any. None when a dump hung: then no later call
    tries again (the stuck dump still holds the recorder's lock)."""
    global _dump_stuck
    if _dump_stuck:
        return None
    done, record = _bounded(_dump_both, timeout_s)
    _dump_stuck = not done
    if done and record is None and _dump_dir is not None:
        dumped = newest_dump_file(dump_prefix(), since_ns)
        if dumped is not None:
            try:
                record = load_flight_record_file(dumped)
            except (OSError, pickle.UnpicklingError, EOFError, ValueError):
                record = None
    return record


def _dump_functions() -> list[Callable[..., Any]]:
    """torch's private dumps of its recorders, as JSON (present in 2.11 and 2.13; looked up,
    since private: a torch without them gives no record, never an error)."""
    import torch

    c10d = torch._C._distributed_c10d
    names = ("_dump_nccl_trace_json", "_dump_fr_trace_json")
    return [fn for fn in (getattr(c10d, name, None) for name in names) if fn is not None]


def _dump_both() -> dict[str, Any] | None:
    merged: dict[str, Any] | None = None
    for dump in _dump_functions():
        raw = dump(True, False)  # includeCollectives, onlyActive
        part = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        if merged is None:
            merged = {"entries": [], "pg_config": {}, "pg_status": {}}
        merged["entries"] += part.get("entries") or []
        for key in ("pg_config", "pg_status"):
            merged[key].update(part.get(key) or {})
    if merged is not None:
        merged["entries"].sort(key=lambda e: e.get("time_created_ns") or 0)
    return merged


class _NoGlobals(pickle.Unpickler):
    """torch writes its dump with plain dicts, lists, tuples, strings and numbers: a global
    in the stream is not torch's, and resolving it could run anything."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a flight record names no global; this one names "
                                     f"{module}.{name}")


def load_flight_record_file(path: str | Path) -> dict[str, Any]:
    """A dump file that torch's flight recorder wrote (a pickle), read without resolving any
    global: only its plain data can come out of it."""
    data = _NoGlobals(io.BytesIO(Path(path).read_bytes())).load()
    if not isinstance(data, dict):
        raise pickle.UnpicklingError(f"{path}: a flight record is a dict, not "
                                     f"{type(data).__name__}")
    return data


def newest_dump_file(prefix: str, since_ns: int = 0) -> Path | None:
    """The newest dump under `prefix` (any rank) written at or after `since_ns`, if any."""
    folder, stem = os.path.split(prefix)
    try:
        found = [p for p in Path(folder).iterdir() if p.name.startswith(stem)]
    except OSError:
        return None
    found = [p for p in found if p.stat().st_mtime_ns >= since_ns]
    return max(found, key=lambda p: p.stat().st_mtime_ns, default=None)


def _in_flight(entry: Mapping[str, Any]) -> bool:
    """Whether a recorded collective never completed. NCCL marks completion by its CUDA
    event: anything else never finished (a retired one timed out or was aborted). Backends
    that record no event (gloo) retire an entry when its work ends."""
    if entry.get("state") == "completed":
        return False
    if str(entry.get("profiling_name", "")).startswith("nccl:"):
        return True
    return not entry.get("retired", False)


def _describe(entry: Mapping[str, Any], record: Mapping[str, Any]) -> str:
    """`nccl:all_reduce #57 of group 0 (default_pg, ranks [0, 1])`."""
    name, desc = (list(entry.get("process_group") or ()) + ["?", ""])[:2]
    seq = entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")
    ranks = ((record.get("pg_config") or {}).get(name) or {}).get("ranks")
    about = ", ".join(x for x in (desc, f"ranks {ranks}" if ranks else "") if x)
    return (f"{entry.get('profiling_name', '?')} #{seq} of group {name}"
            + (f" ({about})" if about else ""))


def summarise_flight_record(record: Mapping[str, Any], rank: int, now_ns: int,
                            since_ns: int = 0) -> str:
    """One line on where `rank` is, from its flight record: the first collective that never
    completed (the ones after it queue behind it) and for how long, or, when none is in
    flight, the last one it completed: a rank in no collective while its peers wait in one
    is the rank that stalled. `now_ns`: time.time_ns() on the rank's host; `since_ns`: when
    this world began (the recorder outlives worlds: an aborted world's entries stay in it)."""
    entries = [e for e in record.get("entries") or ()
               if (e.get("time_created_ns") or 0) >= since_ns]
    pending = [e for e in entries if _in_flight(e)]
    if pending:
        first = pending[0]
        created = first.get("time_created_ns") or 0
        age = f", {max(0, now_ns - created) / 1e9:.0f}s ago" if created else ""
        state = first.get("state") or "scheduled"
        more = f"; {len(pending) - 1} more queued behind it" if len(pending) > 1 else ""
        return (f"rank {rank}: {_describe(first, record)} never completed "
                f"({state}{age}){more}")
    if entries:
        return (f"rank {rank}: in no collective; the last it completed is "
                f"{_describe(entries[-1], record)}")
    return f"rank {rank}: in no collective; none recorded"


# ---------------------------------------------------------------------------- the device


def drain_device(timeout_s: float) -> bool:
    """Wait up to `timeout_s` for the work queued on this process's GPU: after an abort,
    NCCL's kernels exit and whatever was queued behind them runs out. A kernel that never
    ends would block torch.cuda.synchronize() for ever, so it runs on a daemon thread, as
    NVIDIA's in-process restart does; False: the device is stuck and the process is not
    fit for another world. True at once without CUDA."""
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return True
    done, synced = _bounded(lambda: torch.cuda.synchronize() or True, timeout_s)
    return done and synced is True
