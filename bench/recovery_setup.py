"""The recovery benchmark's scenario (bench/recovery.py): the run, the fault, the rows
measured and the targets, as data shared by what runs, measures and reports it."""

from __future__ import annotations

from typing import Any

from bench.outside_kill import OUTSIDE_KILL
from bench.peers.raytrain_recovery import TINY

FAULTS = ("kill", "hang", "node", "freeze", OUTSIDE_KILL)
# Faults that need a multi-node cluster: a node is lost or frozen.
NODE_FAULTS = ("node", "freeze")
WORKERS = 2
STEPS = 40
FAULT_STEP = 25
PERSIST_EVERY = 10
HANG_WAIT_S = 60.0
TARGET_KILL_RATIO = 10.0
TARGET_HANG_DETECTION_S = 10.0
TARGET_FREEZE_DETECTION_S = 1.0  # a frozen node: noticed within a second
# outside-kill: stalwart's kill -> next completed step <= a normal step + this; and the peers'
# times over stalwart's at least these ratios.
TARGET_NEXT_STEP_SLACK_S = 0.5
TARGET_OUTSIDE_RATIOS = {"ray-train": 20.0, "torchrun": 10.0}

# Every stalwart run: the tiny model, a storage checkpoint every 10 steps, a metrics row every
# step, no validation, plain log lines, up to 3 recoveries.
STALWART_OVERRIDES = [
    *TINY, f"train.steps={STEPS}", f"checkpoint.persist_every={PERSIST_EVERY}",
    "run.log_every=1", "data.val_every=0", "run.progress=false", "failure.max_failures=3",
    f"scaling.num_workers={WORKERS}",
]
SPARE = ["scaling.spare_workers=1"]
NO_SPARE = ["scaling.spare_workers=0"]  # whatever the config says
ELASTIC = ["scaling.min_workers=1", "scaling.resize_check_s=2", "scaling.spare_workers=0"]
STORAGE_ONLY = ["checkpoint.snapshot_every=0"]  # the in-memory tier off
INJECT = {"kill": f"kill:rank=1,step={FAULT_STEP}", "hang": f"hang:rank=1,step={FAULT_STEP}",
          "node": f"kill-node:node=2,step={FAULT_STEP}",
          "freeze": f"freeze-node:node=2,step={FAULT_STEP}"}

# (runner, label) per fault, in the order of a round.
RUNNERS = {
    "kill": [("stalwart", "stalwart"), ("stalwart+spare", "stalwart + warm spare"),
             ("stalwart+spare/storage", "stalwart + spare, storage"), ("ray-train", "Ray Train")],
    "hang": [("stalwart", "stalwart"), ("stalwart+spare", "stalwart + warm spare"),
             ("ray-train", "Ray Train")],
    "node": [("stalwart-elastic", "stalwart (shrink)"),
             ("stalwart-elastic/storage", "stalwart (shrink), storage"),
             ("ray-train", "Ray Train")],
    # stalwart only: Ray Train has no freeze of its own here; it waits for Ray's node health
    # check (tens of seconds) as it does for a lost node.
    "freeze": [("stalwart-elastic", "stalwart (shrink)")],
    # The table: stalwart with its warm spare and the memory tier, Ray Train's
    # TorchTrainer, torchrun --max-restarts; each killed from outside by the same harness.
    OUTSIDE_KILL: [("stalwart+spare", "stalwart (memory tier, spare)"),
                   ("ray-train", "Ray Train"), ("torchrun", "torchrun --max-restarts")],
}
NODE_HEAD_ARGS: dict[str, Any] = {"num_cpus": 0, "include_dashboard": False,
                                  "_system_config": {"worker_niceness": 0}}
POLL_S = 0.2  # how often the node run checks the GCS (as run_raytrain does)


# outside-kill: the "reference run", examples/gpt/config.toml's own model and batch (not
# the tiny model of the other rows), on every side; the same steps and checkpoint interval.
OUTSIDE_MODEL: list[str] = []
OUTSIDE_STALWART = [
    *OUTSIDE_MODEL, f"train.steps={STEPS}", f"checkpoint.persist_every={PERSIST_EVERY}",
    "run.log_every=1", "data.val_every=0", "run.progress=false", "failure.max_failures=3",
    f"scaling.num_workers={WORKERS}", *SPARE,
]


def stalwart_overrides(runner: str) -> list[str]:
    base, _, tier = runner.partition("/")
    extra = {"stalwart": NO_SPARE, "stalwart+spare": SPARE, "stalwart-elastic": ELASTIC}[base]
    return [*STALWART_OVERRIDES, *extra, *(STORAGE_ONLY if tier == "storage" else [])]
