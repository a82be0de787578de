"""`stalwart report` on a real run with failures on a multi-node Ray cluster
(ray.cluster_utils on this machine): a lost node, then the killed last worker; the report
finds them at their steps, with what each cost, and accounts for every kept step's time."""

from __future__ import annotations

import json
import re

import pytest

from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart, stalwart_here
from tests.ray.helpers import driving, events_of, local_cluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

# 2 workers, one per 1-CPU node; a row every 5 steps, a checkpoint every 10. Losing node 2
# as step 13 starts shrinks the world to rank 0, restored from its memory (step 12: steps
# 11-12 had no row and are kept). Killing that last worker as step 28 starts leaves no
# memory: its replacement restores storage's newest step and trains the rest again. That is
# step 20 unless its asynchronous save was still in flight when the worker died (a loaded
# machine); then it is step 10, and the run says so in checkpoint_chosen.
RUN = [*TINY, "train.steps=40", "run.log_every=5", "checkpoint.persist_every=10",
       "data.val_every=20", "scaling.num_workers=2", "scaling.min_workers=1",
       "scaling.placement_strategy=SPREAD",
       "failure.max_failures=2"]
TOKENS_PER_STEP = 8 * 64  # global batch x seq_len (TINY)


def test_report_of_a_run_with_a_node_loss_and_a_kill(tmp_path):
    cluster = local_cluster(2, cpus=1)
    try:
        with driving(cluster):
            run = stalwart_here("run", str(REFERENCE_CONFIG), *sets(*RUN), "--address",
                                cluster.address, "--inject", "kill-node:node=2,step=13",
                                "--inject", "kill:rank=0,step=28", "--run-dir", "faulty",
                                cwd=tmp_path)
    finally:
        cluster.shutdown()
    run_dir = tmp_path / "faulty"
    events = events_of(run_dir)
    print(*[{k: v for k, v in e.items() if k not in ("workers", "message")}
            for e in events], sep="\n")  # shown when the test fails
    restored = [e["step"] for e in events
                if e["kind"] == "checkpoint_chosen" and e["source"] == "storage"]
    assert restored in ([20], [10]), restored
    lost = 27 - restored[0]

    report = json.loads(stalwart("report", str(run_dir), "--json", cwd=tmp_path,
                                 timeout=60).stdout)
    assert report["state"] == "finished"
    assert report["steps_done"] == report["steps_total"] == 40
    # each fault fires as its step starts: the failure is after the step before
    assert [(f["kind"], f["step"]) for f in report["failures"]] == [
        ("node_died", 12), ("worker_died", 27)]
    assert report["failures_by_kind"] == {"node_died": 1, "worker_died": 1}
    assert report["recoveries_by_source"] == {"memory": 1, "storage": 1}
    assert report["lost_steps"] == lost
    assert 0 <= report["detection_s_median"] < 10 and report["recovery_s_median"] > 0
    assert [(r["step"], r["old_world_size"], r["new_world_size"], r["reason"])
            for r in report["resizes"]] == [(12, 2, 1, "shrink")]
    # steps 10, 20, 30, 40; the event of step 10 can be missing: its asynchronous save may
    # complete after the node loss, and a world that ended reports no more commits
    assert report["checkpoints"] in (3, 4) and report["checkpoint_save_s"] > 0
    assert report["tokens_per_step"] == TOKENS_PER_STEP
    assert report["tokens"] == 40 * TOKENS_PER_STEP  # the steps trained twice counted once
    assert 0 < report["goodput"] < 1 and report["notes"] == []
    assert report["untimed_steps"] == 0  # 11-12 are timed by kept_unlogged

    # The run's closing line measured all its step time (lost attempts included): tokens of
    # every step it trained over it. The lost attempt is not productive.
    throughput = float(re.search(r"throughput ([\d,]+) tokens/s", run.stdout)[1]
                       .replace(",", ""))
    step_time_s = (40 + lost) * TOKENS_PER_STEP / throughput
    assert 0.5 * step_time_s < report["productive_s"] < step_time_s < report["wall_s"]

    png = run_dir / "report.png"
    assert report["png"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000

    table = stalwart("report", str(run_dir), cwd=tmp_path, timeout=60).stdout
    print(table)
    assert "node_died 1, worker_died 1" in table and "memory 1, storage 1" in table
