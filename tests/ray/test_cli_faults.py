"""Every failure kind from the CLI on a local Ray, as a user injects it (`--inject`) or as the
machine does it (a real SIGSTOP by PID): recovered in place with the survivors' processes
kept, bit-identical to a failure-free run; or failed cleanly with checkpoints intact."""

from __future__ import annotations

import os
import signal
import textwrap

import pytest

from stalwart.checkpointing.storage.catalog import committed_checkpoints, verify
from stalwart.core.events import read_jsonl
from tests.cli_helpers import (
    REFERENCE_CONFIG,
    sets,
    stalwart_here,
    wait_for_step,
)
from tests.keys import trust
from tests.ray.conftest import RUN, STEPS
from tests.ray.helpers import assert_same_weights, events_of, only

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("local_ray")]

FAST_HANG = ["failure.hang_timeout_floor_s=3"]


def survivors_kept(events, replaced_rank):
    """The workers of the second world: every rank but the replaced one kept its process."""
    first, second = [e["workers"] for e in events if e["kind"] == "workers_started"][:2]
    old = {w["pid"] for w in first}
    new = {w["pid"] for w in second}
    assert first[replaced_rank]["pid"] not in new
    assert old - {first[replaced_rank]["pid"]} <= new


def test_sigstopped_worker_is_detected_as_hung_and_replaced(tmp_path, straight_run):
    run_dir = tmp_path / "stopped"

    def stop_rank_1() -> None:
        wait_for_step(run_dir / "metrics.jsonl", 15, None)
        (workers,) = [e["workers"] for e in events_of(run_dir) if e["kind"] == "workers_started"]
        os.kill(workers[1]["pid"], signal.SIGSTOP)  # alive, silent, holding its peer

    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*RUN, *FAST_HANG, "failure.max_failures=1"),
                  "--run-dir", "stopped", cwd=tmp_path, during=stop_rank_1)
    events = events_of(run_dir)
    failure = only(events, "failure")
    assert failure["failure_kind"] == "hang" and failure["ranks"] == [1] and failure["retry"]
    # Seen stopped by its node's agent (/proc), not after the hang detector's limit, and
    # well before the 300 s collective timeout.
    assert "is stopped" in failure["message"] and 0 <= failure["detection_s"] < 60
    recovered = only(events, "recovered")
    assert recovered["lost_steps"] == failure["step"] - recovered["from_step"]
    survivors_kept(events, replaced_rank=1)
    assert_same_weights(tmp_path, straight_run, run_dir)


def test_injected_kill_recovers_in_place_from_memory_bit_identical(tmp_path, straight_run):
    run = stalwart_here("run", str(REFERENCE_CONFIG), *sets(*RUN, "failure.max_failures=1"),
                        "--inject", "kill:rank=1,step=25", "--run-dir", "killed", cwd=tmp_path)
    events = events_of(tmp_path / "killed")
    # The console: stalwart's own line for the death and for the restore, not Ray's paragraph
    # (which guesses at the OOM killer), which the run dir keeps in ray.log.
    console = " ".join((run.stdout + run.stderr).split())  # as typed, however it wrapped
    pid = [e for e in events if e["kind"] == "workers_started"][0]["workers"][1]["pid"]
    assert f"recovering from: worker rank 1 (pid {pid}) exited" in console
    assert "restoring step 24 from memory" in console
    assert "killed by the OOM killer" not in console and "(raylet)" not in console
    assert "not writable" not in console  # the memory restore's view of a peer's shard
    assert f"Worker PID: {pid}" in (tmp_path / "killed" / "ray.log").read_text()
    fault = only(events, "fault_injected")
    assert fault == {**fault, "fault": "kill:rank=1,step=25", "rank": 1, "step": 25}
    failure = only(events, "failure")
    assert failure["failure_kind"] == "worker_died" and failure["ranks"] == [1]
    assert failure["step"] == 24 and 0 <= failure["detection_s"] < 10
    recovered = only(events, "recovered")
    # From the memory tier: the step before the fault, not storage's step 20; only the step
    # in flight is lost.
    assert recovered == {**recovered, "from_step": 24, "lost_steps": 0, "source": "memory",
                         "world_size": 2}
    chosen = only(events, "checkpoint_chosen")
    assert chosen == {**chosen, "source": "memory", "step": 24, "memory_step": 24}
    # Saves are asynchronous: on a loaded machine step 20 may not be committed by step 24.
    assert chosen["storage_step"] in (10, 20)
    assert set(recovered["phases"]) == {"detect", "teardown", "wait", "join", "restore",
                                        "first_step"}
    survivors_kept(events, replaced_rank=1)
    assert_same_weights(tmp_path, straight_run, tmp_path / "killed")


def test_raise_is_retried_when_configured(tmp_path, straight_run):
    # With the memory tier off: the recovery restores the newest storage checkpoint.
    stalwart_here("run", str(REFERENCE_CONFIG),
                  *sets(*RUN, "failure.max_failures=1", "failure.retry_user_errors=true",
                   "checkpoint.snapshot_every=0"),
                  "--inject", "raise:rank=1,step=25", "--run-dir", "raised", cwd=tmp_path)
    events = events_of(tmp_path / "raised")
    failure = only(events, "failure")
    assert failure["failure_kind"] == "user_error" and failure["retry"]
    assert "InjectedFault: injected fault raise:rank=1,step=25" in failure["message"]
    recovered = only(events, "recovered")
    assert recovered["from_step"] == 20 and recovered["source"] == "storage"
    assert recovered["lost_steps"] == 4
    assert not [e for e in events if e["kind"] in ("checkpoint_chosen", "memory_tier")]
    assert_same_weights(tmp_path, straight_run, tmp_path / "raised")


def test_preemption_checkpoints_then_resizes_without_losing_a_step(tmp_path, straight_run):
    stalwart_here("run", str(REFERENCE_CONFIG), *sets(*RUN), "--inject", "term:rank=1,step=33",
                  "--run-dir", "preempted", cwd=tmp_path)
    run_dir = tmp_path / "preempted"
    events = events_of(run_dir)
    assert not [e for e in events if e["kind"] == "failure"]  # planned, not a failure
    resized = only(events, "resized")
    assert resized["reason"] == "preempted" and resized["new_world_size"] == 2
    # Every rank stopped after the same step and checkpointed it; the next world started
    # there: no step was trained twice.
    committed = [e["step"] for e in events if e["kind"] == "checkpoint_committed"]
    assert resized["step"] in committed and resized["step"] % 10 != 0
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1))
    survivors_kept(events, replaced_rank=1)
    assert_same_weights(tmp_path, straight_run, run_dir)


def test_failures_past_the_budget_fail_with_checkpoints_intact(tmp_path):
    proc = stalwart_here("run", str(REFERENCE_CONFIG), *sets(*RUN, "failure.max_failures=1"),
                         "--inject", "kill:rank=1,step=15", "--inject", "kill:rank=0,step=35",
                         "--run-dir", "budget", cwd=tmp_path, check=1)
    events = events_of(tmp_path / "budget")
    failures = [e for e in events if e["kind"] == "failure"]
    assert [f["retry"] for f in failures] == [True, False]
    assert events[-1]["kind"] == "failed"
    assert "failure budget exhausted (failure.max_failures=1; failures: worker_died, " \
           "worker_died)" in events[-1]["reason"]
    assert "reason: failure budget exhausted" in proc.stdout
    checkpoints = committed_checkpoints(str(tmp_path / "budget" / "checkpoints"))
    commits = [e["step"] for e in events if e["kind"] == "checkpoint_committed"]
    assert checkpoints and checkpoints[-1].step == commits[-1] >= 20
    for info in checkpoints:
        verify(info, trust())  # every committed checkpoint is whole


SLOW_STORAGE_TASK = textwrap.dedent('''
    """The reference task, with checkpoints on a filesystem whose shard writes take 4 s."""
    import time

    import fsspec
    from fsspec.implementations.local import LocalFileSystem

    from stalwart.examples.gpt.task import GPTTask


    class SlowFileSystem(LocalFileSystem):
        protocol = "slowfile"

        @classmethod
        def _strip_protocol(cls, path):
            return super()._strip_protocol(str(path).removeprefix("slowfile://"))

        def _open(self, path, mode="rb", **kwargs):
            if "w" in mode and str(path).endswith(".distcp"):
                time.sleep(4)
            return super()._open(path, mode, **kwargs)


    fsspec.register_implementation("slowfile", SlowFileSystem, clobber=True)


    class SlowStorageTask(GPTTask):
        pass
''')


def test_kill_during_a_storage_write_keeps_the_last_commit(tmp_path):
    (tmp_path / "slow_storage.py").write_text(SLOW_STORAGE_TASK)
    storage = f"slowfile://{tmp_path / 'ckpt'}"
    # Step 20's shards take 4 s to write in the background; step 22 starts at once and
    # kills rank 1 mid-write.
    stalwart_here("run", str(REFERENCE_CONFIG),
                  *sets(*RUN, "train.steps=40", "task.path=slow_storage:SlowStorageTask",
                   f'checkpoint.storage="{storage}"', "failure.max_failures=1"),
                  "--inject", "kill:rank=1,step=22", "--run-dir", "slow", cwd=tmp_path)
    events = events_of(tmp_path / "slow")
    failure = only(events, "failure")
    committed_before = [e["step"] for e in events[:events.index(failure)]
                        if e["kind"] == "checkpoint_committed"]
    assert committed_before == [10]  # step 20 was being written when rank 1 died
    # Storage's newest valid checkpoint is 10 (20 is partial, not offered); memory has 21.
    chosen = only(events, "checkpoint_chosen")
    assert (chosen["storage_step"], chosen["memory_step"], chosen["source"]) == \
        (10, 21, "memory")
    assert only(events, "recovered")["from_step"] == 21
    assert events[-1]["kind"] == "finished"
    for info in committed_checkpoints(str(tmp_path / "ckpt")):
        verify(info, trust())
