"""Ray Train's side of the cold-start bench (bench/cold_start.py): the script a user runs, from
`ray.init` to `TorchTrainer.fit()` over raytrain_worker.py's train loop (the reference task,
as bench/peers/torchrun_ddp.py trains it), with no fault. Rank 0 logs each step's end in
WORKDIR/steps.jsonl."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import add_config_args, parser


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, __spec__)
    p.add_argument("--workdir", required=True, help="step log, attempts and Ray Train's storage")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps (train.steps)")
    add_config_args(p)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import bench
    from bench.peers import raytrain_worker as rw

    workdir = Path(args.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    # A Ray of its own ("local": never another one running here) with the workers' CPUs and
    # Ray's defaults otherwise, the dashboard included: Ray Train's placement-group cleaner
    # asks its state API (without it, it logs a failure at every look).
    ray.init(address="local", num_cpus=rw.NUM_WORKERS, logging_level="WARNING")
    # The train loop and the bench modules it uses travel by value, not by import path.
    ray.cloudpickle.register_pickle_by_value(bench)
    overrides = [*args.overrides, f"train.steps={args.steps}",
                 f"scaling.num_workers={rw.NUM_WORKERS}"]
    trainer = TorchTrainer(
        rw.train_loop_per_worker,
        train_loop_config={"workdir": str(workdir), "config": args.config,
                           "overrides": overrides, "fault": "none", "fault_step": 0,
                           "checkpoint_every": args.steps},
        scaling_config=ScalingConfig(num_workers=rw.NUM_WORKERS, use_gpu=False,
                                     resources_per_worker={"CPU": 1}),
        run_config=RunConfig(name="raytrain-cold-start", storage_path=str(workdir / "storage")))
    result = trainer.fit()
    ray.shutdown()
    if result.error is not None:
        raise SystemExit(f"Ray Train failed: {result.error!r}")


if __name__ == "__main__":
    main()
