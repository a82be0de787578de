"""Failures from the CLI on a local Ray: a killed worker is recovered from the newest storage
checkpoint (bit-identical result), an exception in user code fails fast with its traceback."""

from __future__ import annotations

import os
import signal
import textwrap

import pytest
import torch

from stalwart.core.events import read_jsonl
from tests.cli_helpers import (
    REFERENCE_CONFIG,
    TINY,
    exported_weights,
    sets,
    stalwart_here,
    wait_for_commit,
    wait_for_step,
)
from tests.ray.conftest import NO_SPARE, RUN

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600), pytest.mark.usefixtures("local_ray")]


def test_killed_worker_restarts_from_checkpoint_with_identical_result(tmp_path, straight_run):
    run_dir = tmp_path / "killed"

    def kill_rank_1() -> None:
        wait_for_step(run_dir / "metrics.jsonl", 15, None)
        wait_for_commit(run_dir, None)  # the kill must find a checkpoint to restore
        (workers,) = [e["workers"] for e in read_jsonl(run_dir / "events.jsonl")
                      if e["kind"] == "workers_started"]
        os.kill(workers[1]["pid"], signal.SIGKILL)  # a real process death, by its own PID

    # The storage tier alone (memory tier off): the kill costs the steps since its last save.
    stalwart_here("run", str(REFERENCE_CONFIG),
                  *sets(*RUN, "failure.max_failures=1", "checkpoint.snapshot_every=0"),
                  "--run-dir", "killed", cwd=tmp_path, during=kill_rank_1)

    events = read_jsonl(run_dir / "events.jsonl")
    kinds = [e["kind"] for e in events]
    (failure,) = [e for e in events if e["kind"] == "failure"]
    assert failure["failure_kind"] == "worker_died" and failure["rank"] == 1 and failure["retry"]
    (recovered,) = [e for e in events if e["kind"] == "recovered"]
    assert recovered["source"] == "storage" and recovered["from_step"] % 10 == 0
    # Trained again: the first world's steps past the restored one. Its last may come after
    # the failure's step (rank 0 hands over a step that no poll brought when it leaves).
    rows = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    first_world_last = next(a for a, b in zip(rows, rows[1:], strict=False) if b <= a)
    assert first_world_last >= failure["step"] >= recovered["from_step"]
    assert recovered["lost_steps"] == first_world_last - recovered["from_step"]
    assert [e["generation"] for e in events if e["kind"] == "workers_started"] == [0, 1]
    assert kinds[-1] == "finished"

    a = exported_weights(straight_run, tmp_path, "straight")
    b = exported_weights(run_dir, tmp_path, "recovered")
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs after recovery"


EXPLODING_TASK = textwrap.dedent('''
    from stalwart.examples.gpt.task import GPTTask

    class ExplodingTask(GPTTask):
        """Raises from the loss after a few micro-batches, like a bug in user code."""

        def __init__(self, *, explode_after=6, **kw):
            super().__init__(**kw)
            self.explode_after, self.calls = explode_after, 0

        def loss(self, model, inputs, targets):
            self.calls += 1
            if self.calls > self.explode_after:
                raise ValueError(f"user bug after {self.calls - 1} micro-batches")
            return super().loss(model, inputs, targets)
''')


def test_user_exception_fails_fast_with_traceback(tmp_path):
    # The task lives next to the user, not in an installed package: workers must find it too.
    (tmp_path / "my_tasks.py").write_text(EXPLODING_TASK)
    proc = stalwart_here("run", str(REFERENCE_CONFIG),
                         *sets(*RUN, NO_SPARE, "task.path=my_tasks:ExplodingTask",
                               "failure.max_failures=3"),  # not retried: no spare needed
                         "--run-dir", "exploding", cwd=tmp_path, check=1)
    assert "ValueError: user bug after 6 micro-batches" in proc.stdout
    assert "my_tasks.py" in proc.stdout  # the user's own frame is in the traceback
    events = read_jsonl(tmp_path / "exploding" / "events.jsonl")
    (failure,) = [e for e in events if e["kind"] == "failure"]
    assert failure["failure_kind"] == "user_error" and failure["retry"] is False
    assert events[-1]["kind"] == "failed"
    assert [e["kind"] for e in events].count("workers_started") == 1  # not retried


def test_keep_best_by_a_metric_the_task_never_reports_fails_at_its_first_row(tmp_path):
    # The example's loss returns no metrics of its own: nothing would rank the checkpoints.
    proc = stalwart_here("run", str(REFERENCE_CONFIG),
                         *sets(*TINY, "train.steps=3", "train.warmup_steps=0",
                               "checkpoint.keep_best=1", "checkpoint.best_metric=accuracy",
                               "failure.max_failures=3", "failure.retry_user_errors=true"),
                         "--run-dir", "unranked", cwd=tmp_path, check=1)
    message = ("checkpoint.best_metric = 'accuracy' is never reported by the task, so "
               "checkpoint.keep_best = 1 would keep no best checkpoint: step 1 reports loss. "
               "Rank by one of those, or make the task's loss return it: "
               "`return loss, {'accuracy': value}`")
    assert f"reason: {message}" in proc.stdout
    events = read_jsonl(tmp_path / "unranked" / "events.jsonl")
    assert events[-1]["kind"] == "failed" and events[-1]["reason"] == message
    kinds = [e["kind"] for e in events]
    assert "failure" not in kinds and kinds.count("workers_started") == 1  # not retried
