"""The peers' rows of the numerics benchmark: one NaN loss on rank 1 at one step, in a plain
torchrun DDP loop and in a Ray Train TorchTrainer loop, each run as a user runs it by default and
again with its own restarts on, measured from the run's own per-step log.

Run with `python -m` it is the torchrun loop (bench/peers/torchrun_recovery.py's, with the NaN);
run_peer_rows() launches it and Ray Train and returns one row per run."""

# The start time is taken before the imports, which take seconds.
# ruff: noqa: E402
from __future__ import annotations

import time

START = time.time()

import argparse
import math
import os
import signal
import statistics
import threading
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch._dynamo  # noqa: F401 (before the world forms: see main())
import torch.distributed as dist

import bench
from bench import common, harness
from bench.common import add_config_args, append_jsonl, parser, set_args, write_atomic
from bench.peers import raytrain_worker as rw
from bench.peers.ddp_step import DDPSetup, build_ddp
from bench.peers.torchrun_recovery import ATTEMPTS_FILE, resume_attempt
from stalwart.core.config import load_config
from stalwart.core.events import read_jsonl

WORLD = 2
MAX_RESTARTS = 3  # the "with restarts" rows: torchrun --max-restarts, FailureConfig(max_failures)
CHECKPOINT_EVERY = 10  # as the recovery benchmark's peers
# The files each run leaves in its workdir; times are time.time() of this one machine.
STEPS_FILE = "steps.jsonl"        # rank 0: {"step", "time", "loss", "nan_weights", "pid", ...}
# ATTEMPTS_FILE (every rank's start and ready) and the checkpoints: as torchrun_recovery.py's
MARKER_FILE = "nan.injected"      # created with O_EXCL: a restarted attempt injects nothing
STOP_FILE = rw.STOP_FILE          # the driver past its timeout: every Ray Train loop returns

OUTCOMES = ("loss stays NaN", "run fails", "restarts from storage", "loss recovers")


class NaNLoss:
    """The task, its loss multiplied by NaN while `armed`: what a bad batch or an overflow does
    to one rank's loss. Everything else is the task's own."""

    def __init__(self, task: Any) -> None:
        self._task = task
        self.armed = False

    def loss(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> Any:
        loss = self._task.loss(model, inputs, targets)
        return loss * float("nan") if self.armed else loss

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


def arm_once(workdir: Path, rank: int, step: int, fault_step: int) -> bool:
    """True on rank 1 for `fault_step`, once over all attempts (an O_EXCL marker file)."""
    if rank != 1 or step != fault_step:
        return False
    try:
        os.close(os.open(workdir / MARKER_FILE, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False  # injected by an earlier attempt
    return True


def nan_weight_fraction(model: torch.nn.Module) -> float:
    """The share of the model's weights that are NaN (this rank's replica)."""
    with torch.no_grad():
        params = [p.detach() for p in model.parameters()]
        return sum(int(p.isnan().sum()) for p in params) / sum(p.numel() for p in params)


def train_steps(run: DDPSetup, rank: int, world: int, cfg: dict[str, Any],
                after_step: Any) -> None:
    """The shared loop: the NaN on rank 1 at fault_step, rank 0's step row, after_step(loss)."""
    workdir = Path(cfg["workdir"])
    poison = NaNLoss(run.task)
    run.task = poison
    while run.step < run.train.steps and not (workdir / STOP_FILE).exists():
        poison.armed = arm_once(workdir, rank, run.step + 1, cfg["fault_step"])
        loss_sum, _ = run.rank_step(rank, world)
        poison.armed = False
        if rank == 0:
            append_jsonl(workdir / STEPS_FILE, {
                "step": run.step, "time": time.time(), "loss": loss_sum / world,
                "nan_weights": nan_weight_fraction(run.model), "attempt": cfg["attempt"],
                "pid": os.getpid()})
        after_step(loss_sum / world)


# torchrun: this module under `python -m torch.distributed.run`.


def torchrun_command(workdir: Path, *, steps: int, fault_step: int, max_restarts: int,
                     config: str | Path, overrides: list[str]) -> list[str]:
    """torchrun as a user types it: no --max-restarts (its default, 0) or --max-restarts N."""
    return common.torchrun("bench.peers.numerics_peers", WORLD, [
        "--workdir", str(workdir), "--steps", str(steps), "--fault-step", str(fault_step),
        "--checkpoint-every", str(CHECKPOINT_EVERY), "--config", str(config),
        *set_args(overrides)], max_restarts=max_restarts)


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, __spec__)
    p.add_argument("--workdir", required=True, help="step log, attempts and checkpoints")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (train.steps)")
    p.add_argument("--fault-step", type=int, default=20, help="the step whose loss is NaN")
    p.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY)
    add_config_args(p)
    return p.parse_args()


def main() -> None:
    """One torchrun process: resume from the newest checkpoint, train, checkpoint (rank 0)."""
    args = parse_args()
    workdir = Path(args.workdir)
    attempt, rank, world, run, folder = resume_attempt(workdir, args.config, args.overrides,
                                                       args.steps, START)

    def checkpoint(_loss: float) -> None:
        if rank == 0 and (run.step % args.checkpoint_every == 0 or run.step == run.train.steps):
            folder.mkdir(parents=True, exist_ok=True)
            write_atomic(folder / f"step-{run.step:06d}.pt",
                         partial(torch.save, run.state_dict()), "wb")

    train_steps(run, rank, world, {"workdir": workdir, "fault_step": args.fault_step,
                                   "attempt": attempt}, checkpoint)
    # A rank that leaves while the other still writes its checkpoint, or with gloo's threads
    # still running at interpreter exit, aborts ("terminate called without an active
    # exception") and torchrun counts a failure that is not the NaN's: both ranks leave
    # together, and torch._dynamo was imported before the world formed (else the optimizer's
    # first step imports it and it keeps the group alive past destroy_process_group).
    dist.barrier()
    dist.destroy_process_group()


# Ray Train: the same loop as a TorchTrainer's train_loop_per_worker.


def ray_train_loop(cfg: dict[str, Any]) -> None:
    """train_loop_per_worker: raytrain_worker.py's setup, restore and checkpoint reports."""
    import ray.train

    torch.set_num_threads(1)
    workdir = Path(cfg["workdir"])
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    append_jsonl(workdir / ATTEMPTS_FILE, {"event": "start", "time": time.time(), "rank": rank,
                                           "pid": os.getpid()})
    run = build_ddp(load_config(cfg["config"], cfg["overrides"]), world)
    if (checkpoint := ray.train.get_checkpoint()) is not None:
        with checkpoint.as_directory() as d:
            run.load(torch.load(Path(d) / rw.STATE_FILE, weights_only=False))
    append_jsonl(workdir / ATTEMPTS_FILE, {
        "event": "ready", "time": time.time(), "rank": rank, "pid": os.getpid(),
        "restored_from": run.step if checkpoint is not None else None})

    def report(loss: float) -> None:
        if run.step % cfg["checkpoint_every"] == 0 or run.step == run.train.steps:
            rw._report(run, rank, loss, workdir)

    train_steps(run, rank, world, {**cfg, "attempt": None}, report)


def _fit(workdir: Path, loop: dict[str, Any], max_failures: int | None,
         timeout_s: float) -> str | None:
    """trainer.fit() on a local Ray of 2 CPUs that ends with it: fit's error (None: none).
    max_failures None: FailureConfig's defaults. RAY_ADDRESS pins Ray Train's placement group
    cleaner to this Ray, as in bench/peers/raytrain_recovery.py."""
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    cluster = harness.local_cluster(0, num_cpus=WORLD)
    try:
        ray.init(address=cluster.address,
                 runtime_env={"env_vars": {"RAY_ADDRESS": cluster.address}})
        ray.cloudpickle.register_pickle_by_value(bench)  # the loop travels by value
        failure = FailureConfig() if max_failures is None else FailureConfig(
            max_failures=max_failures)
        trainer = TorchTrainer(
            ray_train_loop, train_loop_config={"workdir": str(workdir), **loop},
            scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False,
                                         resources_per_worker={"CPU": 1}),
            run_config=RunConfig(name="numerics-nan", storage_path=str(workdir / "storage"),
                                 failure_config=failure))
        return _fit_within(trainer, workdir, timeout_s)
    finally:
        try:
            ray.shutdown()
        finally:
            cluster.shutdown()


def _fit_within(trainer: Any, workdir: Path, timeout_s: float) -> str | None:
    """fit() on a thread; past timeout_s the stop file makes every loop return."""
    out: dict[str, str | None] = {"error": "fit did not return"}

    def fit() -> None:
        try:
            res = trainer.fit()
            out["error"] = None if res.error is None else repr(res.error)
        except BaseException as e:  # reported, not raised: the row says what happened
            out["error"] = repr(e)

    thread = threading.Thread(target=fit, name="numerics-fit", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        (workdir / STOP_FILE).write_text(f"timeout_s={timeout_s:g} reached")
        thread.join(120.0)  # for the teardown; ray.shutdown() ends what is left
        out["error"] = f"timeout_s={timeout_s:g} reached; {out['error']}"
    return out["error"]


# The rows.


def measure(steps: list[dict[str, Any]], attempts: list[dict[str, Any]], *, exit_code: int,
            wall_s: float, fault_step: int, error: str | None = None) -> dict[str, Any]:
    """A row's fields from the run's step log (rank 0) and its processes' starts."""
    rows = sorted(steps, key=lambda r: r["time"])
    after = [r for r in rows if r["step"] > fault_step]
    first_nan = min((r["step"] for r in rows if math.isnan(r["loss"])), default=None)
    restarts = len({a["pid"] for a in attempts if a["rank"] == 0}) - 1
    finite_after = sum(math.isfinite(r["loss"]) for r in after)
    readies = sorted((a for a in attempts if a["rank"] == 0 and a["event"] == "ready"),
                     key=lambda a: a["time"])
    out = {"outcome": _outcome(exit_code, restarts, after, finite_after),
           "first_nan_step": first_nan, "final_loss": rows[-1]["loss"] if rows else None,
           "finite_steps_after_fault": finite_after, "exit_code": exit_code, "wall_s": wall_s,
           "restarts": max(restarts, 0),
           "restored_from_steps": [a["restored_from"] for a in readies[1:]],
           "last_step": rows[-1]["step"] if rows else None,
           "nan_weights_at_end": rows[-1].get("nan_weights") if rows else None,
           "step_s_median": _step_s(rows),
           "loss_by_step": {str(r["step"]): r["loss"] for r in rows}}
    out["detail"] = _detail(out, fault_step, len(after), error)
    return out


def _outcome(exit_code: int, restarts: int, after: list[dict[str, Any]],
             finite_after: int) -> str:
    if restarts > 0:
        return "restarts from storage"
    if exit_code != 0:
        return "run fails"
    return "loss recovers" if after and finite_after == len(after) else "loss stays NaN"


def _step_s(rows: list[dict[str, Any]]) -> float | None:
    """The median time between consecutive steps of one process."""
    gaps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:], strict=False)
            if b["pid"] == a["pid"] and b["step"] == a["step"] + 1]
    return statistics.median(gaps) if gaps else None


def _detail(row: dict[str, Any], fault_step: int, logged_after: int, error: str | None) -> str:
    nan = row["nan_weights_at_end"]
    weights = "" if nan is None else f", {nan:.0%} of weights NaN at the end"
    if row["outcome"] == "run fails":
        why = f": {error[:160]}" if error else ""
        return f"exit {row['exit_code']} after step {row['last_step']}{why}"
    if row["outcome"] == "restarts from storage":
        return (f"{row['restarts']} restart(s), resumed from step(s) "
                f"{row['restored_from_steps']}; {row['finite_steps_after_fault']}/{logged_after}"
                f" steps after {fault_step} finite{weights}")
    return (f"no error raised, no restart; {logged_after - row['finite_steps_after_fault']}/{logged_after} "
            f"steps after step {fault_step} logged a non-finite loss{weights}")


def _kill_leftovers(attempts: list[dict[str, Any]]) -> list[int]:
    """SIGKILL the run's own rank processes that outlived it (by the pids they logged)."""
    left = sorted(p for p in {a["pid"] for a in attempts} if harness.pid_alive(p))
    for pid in left:
        harness.signal_pid(pid, signal.SIGKILL)
    return left


def _finish(workdir: Path, runner: str, mode: str, *, exit_code: int, wall_s: float,
            fault_step: int, error: str | None = None) -> dict[str, Any]:
    attempts = read_jsonl(workdir / ATTEMPTS_FILE)
    left = _kill_leftovers(attempts)
    row = {"runner": runner, "mode": mode, **measure(
        read_jsonl(workdir / STEPS_FILE), attempts, exit_code=exit_code, wall_s=wall_s,
        fault_step=fault_step, error=error)}
    return row | {"leftover_pids_killed": left, "workdir": str(workdir)}


def torchrun_row(work: Path, mode: str, *, steps: int, fault_step: int, timeout_s: float,
                 overrides: list[str]) -> dict[str, Any]:
    """torchrun over main(): default (no restarts) or --max-restarts MAX_RESTARTS."""
    workdir = work / f"torchrun-{mode.replace(' ', '-')}"
    workdir.mkdir(parents=True)
    cmd = torchrun_command(workdir, steps=steps, fault_step=fault_step,
                           max_restarts=MAX_RESTARTS if mode == "with restarts" else 0,
                           config=common.DEFAULT_CONFIG, overrides=overrides)
    code, wall = harness.run_watched(cmd, workdir.with_suffix(".log"), timeout_s)
    error = None if code == 0 else common.tail(workdir.with_suffix(".log"), 3)
    return _finish(workdir, "torchrun", mode, exit_code=code, wall_s=wall,
                   fault_step=fault_step, error=error)


def ray_train_row(work: Path, mode: str, *, steps: int, fault_step: int, timeout_s: float,
                  overrides: list[str]) -> dict[str, Any]:
    """TorchTrainer.fit() in this process: default FailureConfig or max_failures=MAX_RESTARTS.
    exit_code is what a script around fit() exits with: 1 when fit raised or failed, else 0."""
    from bench.recovery_rows import output_to

    workdir = work / f"ray-train-{mode.replace(' ', '-')}"
    workdir.mkdir(parents=True)
    loop = {"config": str(common.DEFAULT_CONFIG), "overrides": overrides,
            "fault_step": fault_step, "checkpoint_every": CHECKPOINT_EVERY}
    t0 = time.perf_counter()
    with output_to(workdir.with_suffix(".log")):  # Ray prints the workers' output here
        error = _fit(workdir, loop, MAX_RESTARTS if mode == "with restarts" else None, timeout_s)
    return _finish(workdir, "ray-train", mode, exit_code=0 if error is None else 1,
                   wall_s=time.perf_counter() - t0, fault_step=fault_step, error=error)


def run_peer_rows(work: Path, *, steps: int = 40, fault_step: int = 20,
                  timeout_s: float = 300.0) -> list[dict[str, Any]]:
    """torchrun and Ray Train, each by default and with restarts, on the tiny model (2 gloo
    ranks, one thread each, CPU): the loss of fault_step on rank 1 is NaN once. Starts and
    shuts down a Ray of its own for each Ray Train row."""
    if not 0 < fault_step <= steps:
        raise ValueError(f"fault_step={fault_step} must be in [1, steps={steps}]")
    import ray

    if ray.is_initialized():
        raise RuntimeError("run_peer_rows starts a Ray of its own (num_cpus=2) for Ray Train, "
                           "but one is already initialised in this process; call "
                           "ray.shutdown() first")
    overrides = [*common.TINY, f"train.steps={steps}", f"scaling.num_workers={WORLD}"]
    common.tokens_per_step(str(common.DEFAULT_CONFIG), overrides)  # data ready, off the clock
    work = Path(work).resolve()
    kw = {"steps": steps, "fault_step": fault_step, "timeout_s": timeout_s,
          "overrides": overrides}
    return [row(work, mode, **kw) for row in (torchrun_row, ray_train_row)
            for mode in ("default", "with restarts")]


if __name__ == "__main__":
    main()
