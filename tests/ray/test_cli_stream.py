"""A streamed parquet dataset through every failure, as a user runs it (`stalwart run` on a
multi-node local Ray): a killed worker, a lost node (shrink, then grow back) and a data file
that disappears (the run stops after a checkpoint, naming it, and resumes once it is back).
The data ledger shows every sample trained exactly once per epoch, in the order of a
failure-free run, and the final weights equal that run's bit for bit."""

from __future__ import annotations

import os
import subprocess
import textwrap
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from stalwart.core.events import read_jsonl
from stalwart.examples.stream.make_data import write
from tests.cli_helpers import (
    STALWART,
    exported_weights,
    sets,
    stalwart_here,
    wait_for_event,
    wait_for_step,
    wait_until,
)
from tests.ray.helpers import driven_cluster

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

ROWS, BATCH, STEPS = 400, 16, 100  # 1,600 samples: four whole epochs
CONFIG = """\
[task]
path = "patient_task:PatientTask"

[task.args]
data = "{data}"
hidden = 16
n_features = 8
# Two lanes of one unit's window: a rank holds few units, so it reads the files again and
# again (the vanished file is missed within steps).
lanes = 2
window = 1

[scaling]
num_workers = 1
spare_workers = 0

[parallel]
dp_replicate = -1
dp_shard = 1
invariant_reduction = true

[train]
steps = {steps}
global_batch_size = {batch}
micro_batch_size = 4
lr = 1e-2
warmup_steps = 2

[checkpoint]
persist_every = 10
keep_last = 0

[failure]
hang_timeout_floor_s = 3
max_failures = 3

[data]
ledger = true
val_every = 0
cache_dir = "{cache}"

[run]
progress = false
log_every = 1
"""
# The stream task, 0.1 s slower per micro-batch (a sleep: no change to the numbers), so the
# test can act while the run trains however loaded the machine is.
PATIENT_TASK = textwrap.dedent('''
    import time

    from stalwart.examples.stream.task import StreamTask


    class PatientTask(StreamTask):
        def loss(self, model, batch):
            time.sleep(0.1)
            return super().loss(model, batch)
''')


def wait_for_resize(events: Path, reason: str, proc: subprocess.Popen) -> dict:
    """The first `resized` event of this reason in the run `proc` is making."""
    found: list[dict] = []

    def done() -> bool:
        found[:] = [e for e in read_jsonl(events) if e["kind"] == "resized"
                    and e["reason"] == reason] if events.exists() else []
        return bool(found)

    wait_until(done, f"a {reason}", proc, timeout=300)
    return found[0]


@pytest.fixture(scope="module")
def cluster():
    """A driver-only head node and two worker nodes of 2 CPUs each."""
    with driven_cluster(2) as c:
        yield c


@pytest.fixture(scope="module")
def setup(tmp_path_factory, cluster) -> Path:
    root = tmp_path_factory.mktemp("stream")
    write(str(root / "data"), rows=ROWS, files=4, row_group=10, features=8, classes=4,
          fmt="parquet", seed=0)
    (root / "patient_task.py").write_text(PATIENT_TASK)
    (root / "stream.toml").write_text(CONFIG.format(data=root / "data", cache=root / "cache",
                                                    steps=STEPS, batch=BATCH))
    stalwart_here("run", "stream.toml", "--address", cluster.address, "--run-dir",
                  "reference", cwd=root)
    return root


def ledger(run_dir: Path) -> list[tuple[int, int, str, int]]:
    """(step, epoch, file, row) of every sample, in training order."""
    table = pq.read_table(run_dir / "ledger.parquet").sort_by([("step", "ascending"),
                                                               ("position", "ascending")])
    return list(zip(*(table[c].to_pylist() for c in ("step", "epoch", "file", "row")),
                    strict=True))


def check_exactly_once(rows: list[tuple[int, int, str, int]]) -> None:
    steps = [r[0] for r in rows]
    assert sorted(set(steps)) == list(range(1, STEPS + 1))
    assert all(steps.count(s) == BATCH for s in set(steps))
    samples = [(e, f, r) for _, e, f, r in rows]
    assert len(set(samples)) == len(samples), "a sample was trained twice in an epoch"
    for epoch in range(STEPS * BATCH // ROWS):  # every whole epoch holds every row
        assert len({(f, r) for e, f, r in samples if e == epoch}) == ROWS


def test_the_failure_free_ledger_holds_each_sample_once(setup) -> None:
    rows = ledger(setup / "reference")
    check_exactly_once(rows)
    assert {Path(f).name for _, _, f, _ in rows} == {f"part-0000{i}.parquet" for i in range(4)}
    report = stalwart_here("report", str(setup / "reference"), cwd=setup)
    assert "exactly once" in report.stdout


def test_kill_node_loss_and_a_vanished_file_keep_the_order_and_the_weights(setup, cluster):
    root, run_dir = setup, setup / "chaos"
    world4 = ["scaling.num_workers=4", "scaling.min_workers=2", "scaling.resize_check_s=2"]
    proc = subprocess.Popen(
        [STALWART, "run", "stream.toml", *sets(*world4), "--address", cluster.address,
         "--inject", "kill-node:node=2,step=8", "--inject", "kill:rank=1,step=36",
         "--run-dir", "chaos"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    moved = root / "away.parquet"
    gone = root / "data" / "part-00002.parquet"
    try:
        wait_for_event(run_dir / "events.jsonl", "resized", proc, timeout=300)
        cluster.add_node(num_cpus=2)  # the node comes back
        grown = wait_for_resize(run_dir / "events.jsonl", "grow", proc)
        # Past the grow (and the kill, on a loaded machine a step or two before it).
        moved_at = max(grown["step"] + 3, 40)
        wait_for_step(run_dir / "metrics.jsonl", moved_at, proc, timeout=300)
        os.rename(gone, moved)  # the file disappears mid-run
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
        if moved.exists():
            os.rename(moved, gone)
    assert proc.returncode != 0, f"the run went on without its file\n{out}\n{err}"
    assert "part-00002.parquet" in out + err
    events = read_jsonl(run_dir / "events.jsonl")
    failed = events[-1]
    assert failed["kind"] == "failed" and "part-00002.parquet" in failed["reason"]
    stopped_at = max(e["step"] for e in events if e["kind"] == "checkpoint_committed")
    assert moved_at <= stopped_at < STEPS
    assert stopped_at == read_jsonl(run_dir / "metrics.jsonl")[-1]["step"], \
        "the last step trained is the checkpointed one"

    # A file added since the checkpoint changes the order: the resume is refused, naming it,
    # before anything starts.
    stray = root / "data" / "part-00009.parquet"
    stray.write_bytes((root / "data" / "part-00000.parquet").read_bytes())
    refused = stalwart_here("run", "stream.toml", *sets(*world4), "--address", cluster.address,
                            "--run-dir", "chaos", "--resume", cwd=root, check=2)
    assert "part-00009.parquet" in refused.stderr and "accept_changed_files" in refused.stderr
    stray.unlink()

    # The file is back: the run resumes from its last step and finishes.
    stalwart_here("run", "stream.toml", *sets(*world4), "--address", cluster.address,
                  "--run-dir", "chaos", "--resume", cwd=root)
    events = read_jsonl(run_dir / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert kinds.count("recovered") >= 2 and kinds[-1] == "finished"
    failures = [e["failure_kind"] for e in events if e["kind"] == "failure"]
    assert failures[:2] == ["node_died", "worker_died"] and failures[-1] == "user_error"
    resized = [(e["old_world_size"], e["new_world_size"], e["reason"]) for e in events
               if e["kind"] == "resized"]
    assert resized[:2] == [(4, 2, "shrink"), (2, 4, "grow")]
    assert [e["from_step"] for e in events if e["kind"] == "resumed"] == [stopped_at]

    rows = ledger(run_dir)
    check_exactly_once(rows)
    assert rows == ledger(root / "reference"), "the order differs from the failure-free run"
    a = exported_weights(root / "reference", root, "reference")
    b = exported_weights(run_dir, root, "chaos")
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the failure-free run"
