"""NCCL's knobs and its flight recorder (parallel/nccl.py), checked without NCCL.

The environment is a pure function and never overrides what the user set; the summariser
reads records laid out as torch's recorder writes them (FlightRecorder.hpp's keys: NCCL's
entries are built here, gloo's come from torch's own writer in a one-rank world); a dump file
is read without resolving a global; a hang's failure names what each rank's recorder says.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist

from stalwart.core.config import load_config
from stalwart.orchestrator import classify
from stalwart.orchestrator.health import Hang
from stalwart.parallel import nccl
from stalwart.parallel.distributed import destroy_process_group, registered_groups
from stalwart.workers.actor import TrainWorker
from tests.cli_helpers import REFERENCE_CONFIG

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

NOW_NS = 1_800_000_000_000_000_000


def test_the_environment_names_each_knob_as_torch_reads_it():
    assert nccl.nccl_environment("/tmp/x/trace_rank_") == {
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"): "2",  # CleanUpOnly
        ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE"): "2000",
        ("TORCH_NCCL_DUMP_ON_TIMEOUT",): "1",
        ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"): "/tmp/x/trace_rank_",
    }


def test_apply_sets_what_is_missing_and_keeps_what_the_user_set():
    environ = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_FR_BUFFER_SIZE": "0",
               "PATH": "/bin"}
    knobs = nccl.nccl_environment("/d/trace_rank_")
    assert nccl.apply(knobs, environ) == {
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_DUMP_TEMP_FILE": "/d/trace_rank_",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/d/trace_rank_"}
    # The user's values stand, and a knob set under another of its names gets neither.
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert environ["TORCH_FR_BUFFER_SIZE"] == "0"
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in environ
    assert nccl.apply(knobs, environ) == {}  # the next world sets nothing again


def test_the_dump_prefix_is_private_to_the_process_and_stable():
    first = nccl.dump_prefix()
    assert first == nccl.dump_prefix()
    folder = first.rsplit("/", 1)[0]
    assert os.stat(folder).st_mode & 0o077 == 0  # mkdtemp's 0700


def entry(record_id: int, seq: int, *, op: str = "nccl:all_reduce", group: str = "0",
          desc: str = "default_pg", state: str = "completed", retired: bool = True,
          age_s: float = 40.0) -> dict:
    """One entry as ProcessGroupNCCL's recorder writes it (FlightRecorder.hpp's keys)."""
    return {"record_id": record_id, "pg_id": int(group), "process_group": [group, desc],
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "is_p2p": False,
            "profiling_name": op, "time_created_ns": NOW_NS - int(age_s * 1e9),
            "input_sizes": [[1024]], "input_dtypes": ["Float"], "output_sizes": [[1024]],
            "output_dtypes": ["Float"], "state": state, "retired": retired,
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None,
            "timeout_ms": 300000, "thread_id": "1", "thread_name": "stalwart-train"}


def record(*entries: dict) -> dict:
    return {"version": "2.10", "entries": list(entries), "pg_status": {},
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
                          "1": {"name": "1", "desc": "undefined", "ranks": "[0, 2]"}}}


def test_the_summary_names_the_first_collective_that_never_completed():
    stuck = record(entry(0, 56), entry(1, 57, state="started", retired=False, age_s=31),
                   entry(2, 58, state="scheduled", retired=False, age_s=30))
    assert nccl.summarise_flight_record(stuck, 2, NOW_NS) == (
        "rank 2: nccl:all_reduce #57 of group 0 (default_pg, ranks [0, 1, 2, 3]) never "
        "completed (started, 31s ago); 1 more queued behind it")


def test_an_nccl_entry_retired_without_completing_timed_out():
    timed_out = record(entry(0, 7, group="1", desc="undefined", state="started", age_s=300))
    assert nccl.summarise_flight_record(timed_out, 0, NOW_NS).startswith(
        "rank 0: nccl:all_reduce #7 of group 1 (undefined, ranks [0, 2]) never completed")


def test_gloo_entries_are_finished_once_retired():
    # gloo records no CUDA event: its entries stay "scheduled", and retiring ends them.
    done = entry(0, 3, op="gloo:all_reduce", state="scheduled", retired=True)
    waiting = entry(1, 4, op="gloo:broadcast", state="scheduled", retired=False, age_s=9)
    assert "gloo:broadcast #4 of group 0" in nccl.summarise_flight_record(
        record(done, waiting), 1, NOW_NS)
    assert nccl.summarise_flight_record(record(done), 1, NOW_NS) == (
        "rank 1: in no collective; the last it completed is gloo:all_reduce #3 of group 0 "
        "(default_pg, ranks [0, 1, 2, 3])")


def test_an_earlier_worlds_entries_are_not_this_worlds():
    # The recorder outlives a world: what the last one left in flight is not this one's.
    last_world = entry(0, 9, state="started", retired=False, age_s=600)
    this_world = entry(1, 1, age_s=20)
    assert nccl.summarise_flight_record(
        record(last_world, this_world), 0, NOW_NS, since_ns=NOW_NS - int(60e9)) == (
        "rank 0: in no collective; the last it completed is nccl:all_reduce #1 of group 0 "
        "(default_pg, ranks [0, 1, 2, 3])")


def test_a_rank_with_nothing_recorded_says_so():
    assert nccl.summarise_flight_record(record(), 3, NOW_NS) == (
        "rank 3: in no collective; none recorded")


def test_torchs_own_records_read_in_process_and_from_its_dump_file(tmp_path):
    # A one-rank gloo world: gloo records into the recorder the generic dump reads.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sub = dist.new_group(backend="gloo")
        dist.all_reduce(torch.ones(3))
        dist.all_reduce(torch.ones(3), group=sub)
        names = [str(dist.distributed_c10d._world.pg_names[g]) for g in registered_groups()]
        taken = nccl.take_flight_record()
        dumped = tmp_path / "trace_rank_0"  # torch's pickle, as its on-timeout dump writes it
        dumped.write_bytes(torch._C._distributed_c10d._dump_fr_trace(True, False, False))
    finally:
        destroy_process_group()
    assert sorted(names) == ["0", "1"]
    last = "rank 0: in no collective; the last it completed is gloo:all_reduce #1 of group 1"
    assert taken is not None and nccl.summarise_flight_record(
        taken, 0, time.time_ns()).startswith(last)
    loaded = nccl.load_flight_record_file(dumped)
    assert loaded["version"] == "2.10"
    assert nccl.summarise_flight_record(loaded, 0, time.time_ns()).startswith(last)
    assert nccl.newest_dump_file(str(tmp_path / "trace_rank_")) == dumped
    assert nccl.newest_dump_file(str(tmp_path / "trace_rank_"), since_ns=time.time_ns()
                                 + 10**12) is None


def test_a_dump_file_that_names_a_global_is_refused(tmp_path):
    planted = tmp_path / "trace_rank_0"
    planted.write_bytes(pickle.dumps(OrderedDict(entries=[])))  # needs collections.OrderedDict
    with pytest.raises(pickle.UnpicklingError, match="collections.OrderedDict"):
        nccl.load_flight_record_file(planted)
    planted.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(pickle.UnpicklingError, match="is a dict"):
        nccl.load_flight_record_file(planted)


def test_without_cuda_the_device_has_nothing_to_drain():
    assert nccl.drain_device(0.1)


def test_a_hang_names_what_each_ranks_recorder_says():
    found = Hang(ranks=(0, 1), silent_s=31.0, limit_s=30.0, answering=True,
                 last_heartbeat=70.0)
    failure = classify.hang(found, 100.0, None, {
        1: "rank 1: in no collective; the last it completed is nccl:all_reduce #56 of group 0",
        0: "rank 0: nccl:all_reduce #57 of group 0 never completed (started, 31s ago)"})
    assert failure.message.startswith("hang: no rank completed a step for 31.0s")
    assert failure.message.endswith(
        "; flight recorder: rank 0: nccl:all_reduce #57 of group 0 never completed (started, "
        "31s ago); rank 1: in no collective; the last it completed is nccl:all_reduce #56 of "
        "group 0")
    assert "flight recorder" not in classify.hang(found, 100.0, None, {}).message


def test_a_quiet_training_thread_brings_its_flight_record_to_the_poll(tmp_path):
    config = load_config(REFERENCE_CONFIG, ["failure.hang_timeout_floor_s=0.4"])
    sigterm = signal.getsignal(signal.SIGTERM)  # the worker installs its own handler
    stuck = threading.Event()
    try:
        worker = TrainWorker(config.to_dict(), str(tmp_path / "storage")).worker
        # A training thread that completes no step: stuck, as in a collective.
        worker._thread = threading.Thread(target=stuck.wait, daemon=True)
        worker._thread.start()
        assert worker.poll().flight_record is None  # not yet half the hang limit
        time.sleep(0.25)
        quiet = worker.poll().flight_record
        assert quiet is not None and quiet.startswith("rank -1: ")
        stuck.set()
        worker._thread.join()
        assert worker.poll().flight_record is None  # the thread ended: nothing to say
    finally:
        stuck.set()
        signal.signal(signal.SIGTERM, sigterm)
