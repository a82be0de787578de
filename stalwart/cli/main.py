"""The `stalwart` command line: run, export, plan, sweep, report, and Ray jobs (submit,
status, logs, stop).

Exit codes: 0 finished, 1 the run failed, 2 bad input (nothing was started or changed),
130 stopped by Ctrl-C after checkpointing the last completed step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.cli.job_commands import JOB_COMMANDS, add_job_commands, run_job_command
from stalwart.cli.run_options import RESUME_HELP, add_inject_option, add_set_option, run_config
from stalwart.errors import StalwartError

if TYPE_CHECKING:
    from stalwart.config import JobConfig
    from stalwart.plan.estimate import ModelShape

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED = 0, 1, 2, 130


def _ensure_cwd_importable() -> None:
    """A console script's sys.path[0] is its bin/ dir, but user tasks live next to the user."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stalwart", description="Elastic, fault-tolerant PyTorch "
                                "training on Ray.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="train a task described by a TOML config")
    run.add_argument("config", help="TOML config file (see examples/gpt/config.toml)")
    add_set_option(run, "override a config key, e.g. --set train.steps=100 (repeatable)")
    run.add_argument("--run-dir", help="run directory (default runs/<run.name>-<timestamp>)")
    run.add_argument("--address", help="Ray cluster to join (default: start Ray on this machine)")
    add_inject_option(run, "inject a fault, e.g. kill:rank=1,step=20, hang:rank=0,step=40, "
                           "raise:rank=1,step=60, term:rank=1,step=30, kill-node:node=1,"
                           "step=80, drain:node=1,step=50 (repeatable; adds to the config's "
                           "[[faults]])")
    run.add_argument("--resume", action="store_true", help=RESUME_HELP)
    run.add_argument("--profile", metavar="STEPS",
                     help="trace these steps with the PyTorch profiler on every rank: 20 or "
                          "20-22 (inclusive); traces go to RUN_DIR/profile/ (sets "
                          "run.profile_steps)")

    exp = sub.add_parser("export", help="write a checkpoint's full model weights to one file")
    exp.add_argument("run_dir", help="run directory of the run to export")
    exp.add_argument("--step", type=int, help="checkpoint step (default: the newest committed)")
    exp.add_argument("--out", required=True, help="output file: .safetensors, .pt, .pth or .bin")
    _add_plan_parser(sub)

    sw = sub.add_parser("sweep", help="sweep hyperparameters with Ray Tune, as SWEEP.toml says")
    sw.add_argument("sweep", help="TOML sweep file (see examples/gpt/sweep_asha.toml)")
    add_set_option(sw, "override a key of the job config for every trial (repeatable)")
    sw.add_argument("--address", help="Ray cluster to join (default: start Ray on this machine)")
    sw.add_argument("--resume", action="store_true",
                    help="continue the sweep's Tune experiment (Tune's own restore)")
    add_job_commands(sub)

    rep = sub.add_parser("report", help="where a run's time went: goodput, failures, a figure")
    rep.add_argument("run_dir", help="run directory (its run may still be going)")
    rep.add_argument("--out", help="the figure's PNG file (default RUN_DIR/report.png)")
    rep.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def _add_plan_parser(sub: argparse._SubParsersAction) -> None:
    from stalwart.plan.estimate import AC_MODES, PP_SCHEDULES, PRECISIONS

    pl = sub.add_parser("plan", help="estimate per-device memory of every parallel layout and "
                        "recommend one")
    pl.add_argument("config", nargs="?", help="TOML config: the model comes from its task, "
                    "the options from [parallel] and [train]")
    pl.add_argument("--set", dest="overrides", action="append", default=[],
                    metavar="KEY=VALUE", help="override a config key (repeatable)")
    pl.add_argument("--params", metavar="N", help="plan for a bare parameter count instead of CONFIG: "
                    "7e9, 1.3B, 350M")
    for flag, what in (("--layers", "transformer blocks"), ("--heads", "attention heads"),
                       ("--d-model", "hidden size"), ("--seq-len", "sequence length"),
                       ("--vocab", "vocabulary size"), ("--ffn", "feed-forward hidden size")):
        pl.add_argument(flag, type=int, metavar="N", help=f"with --params: {what}")
    pl.add_argument("--devices", type=int, metavar="N",
                    help="devices (ranks) to plan for (default: scaling.num_workers, else 1)")
    pl.add_argument("--memory-gb", type=float, default=80.0, metavar="G",
                    help="memory per device in GiB (default 80)")
    pl.add_argument("--micro-batch", type=int, metavar="B",
                    help="sequences per forward (default: train.micro_batch_size, else 1)")
    pl.add_argument("--precision", choices=PRECISIONS, help="parallel.mixed_precision")
    pl.add_argument("--zero", type=int, choices=(2, 3),
                    help="3: reshard after forward (default), 2: keep gathered until backward")
    pl.add_argument("--cpu-offload", action="store_true", default=None,
                    help="parameters, gradients and optimizer state in host memory")
    pl.add_argument("--ac", choices=AC_MODES, help="parallel.activation_checkpointing")
    pl.add_argument("--pp-schedule", choices=PP_SCHEDULES, help="pipeline schedule "
                    "(default 1f1b)")
    pl.add_argument("--pp-microbatches", type=int, metavar="M", help="micro-batches per pipeline step "
                    "(default: pp)")
    pl.add_argument("--devices-per-node", type=int, metavar="N", help="caps tp: tensor parallelism stays "
                    "inside a node")


def _cmd_run(args: argparse.Namespace) -> int:
    import dataclasses

    from stalwart.config import parse_profile_steps
    from stalwart.errors import ConfigError
    from stalwart.trainer import Trainer, summarize

    config = run_config(args)
    if args.profile is not None:
        steps = parse_profile_steps(args.profile)
        try:
            config = dataclasses.replace(config, run=dataclasses.replace(
                config.run, profile_steps=steps))
        except ConfigError as exc:  # steps past train.steps
            raise ConfigError(f"--profile {args.profile!r}: {exc}") from None
    result = Trainer(config, run_dir=args.run_dir, address=args.address,
                     resume=args.resume).fit()
    print(summarize(result))
    if result.state == "STOPPED":
        again = " ".join(shlex.quote(a) for o in args.overrides for a in ("--set", o))
        print(f"resume with: stalwart run {shlex.quote(args.config)}{' ' if again else ''}"
              f"{again} --run-dir {shlex.quote(str(result.run_dir))} --resume")
        return EXIT_STOPPED
    return EXIT_OK if result.state == "FINISHED" else EXIT_FAILED


def _cmd_export(args: argparse.Namespace) -> int:
    import torch

    from stalwart.checkpointing.storage.export import export_weights, pick_checkpoint
    from stalwart.config import load_config
    from stalwart.run_dir import RunDir
    from stalwart.task import build_task

    rd = RunDir(Path(args.run_dir))
    rd.check_resumable()
    config = load_config(rd.config_file)
    checkpoint = pick_checkpoint(rd.storage_url(config), args.step)
    task = build_task(config.task.path, config.task.args)
    torch.manual_seed(config.train.seed)
    out = export_weights(task.build_model(config), checkpoint, Path(args.out))
    print(f"exported step {checkpoint.step} of {rd.path} to {out}")
    return EXIT_OK


def _cmd_sweep(args: argparse.Namespace) -> int:
    import ray

    from stalwart.cli.cluster import connect
    from stalwart.integrations.tune.sweep import (
        check_experiment_dir,
        embedded_cpus,
        format_results,
        run_sweep,
        trial_rows,
        write_results,
    )
    from stalwart.integrations.tune.sweep_file import load_sweep

    sweep = load_sweep(args.sweep, args.overrides)
    check_experiment_dir(sweep, args.resume)
    started = connect(args.address, num_cpus=embedded_cpus(sweep))
    try:
        rows = trial_rows(sweep, run_sweep(sweep, resume=args.resume))
    finally:
        if started:
            ray.shutdown()
    print(format_results(sweep, rows))
    print(f"results: {write_results(sweep, rows)}")
    return EXIT_FAILED if any(r.state == "error" for r in rows) or not rows else EXIT_OK


def parse_count(text: str) -> int:
    """A parameter count as people write it: 7e9, 1.3B, 350M, 125k, 7_000_000."""
    scales = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    clean = text.strip().lower().replace("_", "").replace(",", "")
    scale = scales.get(clean[-1:], 1.0)
    try:
        value = float(clean[:-1] if scale != 1.0 else clean) * scale
    except ValueError:
        value = float("nan")
    if not value >= 1 or value == float("inf"):
        from stalwart.plan.estimate import PlanError

        raise PlanError(f"--params {text!r} is not a parameter count >= 1: write e.g. 7e9, "
                        f"1.3B or 350M")
    return round(value)


def _plan_model(args: argparse.Namespace, config: JobConfig | None) -> tuple[ModelShape, str]:
    """The model's shape, and where it came from."""
    import torch

    from stalwart.examples.gpt.model import GPTConfig
    from stalwart.plan.estimate import ModelShape, PlanError
    from stalwart.task import build_task

    shape_flags = {"n_layers": args.layers, "n_heads": args.heads, "d_model": args.d_model,
                   "seq_len": args.seq_len, "vocab_size": args.vocab, "ffn_hidden": args.ffn}
    if config is None:
        return (ModelShape.from_param_count(parse_count(args.params), **shape_flags),
                "--params")
    if args.params is not None or any(v is not None for v in shape_flags.values()):
        raise PlanError("give CONFIG or --params (with shape flags), not both: change the "
                        "config's model with --set task.args.KEY=VALUE")
    task = build_task(config.task.path, config.task.args)
    model_config = getattr(task, "model_config", None)
    if isinstance(model_config, GPTConfig):
        return ModelShape.from_gpt_config(model_config), f"task {config.task.path}"
    try:  # another task: count its parameters on the meta device; the shape stays unknown
        with torch.device("meta"):
            n_params = sum(p.numel() for p in task.build_model(config).parameters())
    except Exception as exc:  # user code: any error belongs in the message
        raise PlanError(f"cannot build the model of {config.task.path!r} on the meta device "
                        f"to count its parameters ({type(exc).__name__}: {exc}); use --params"
                        ) from exc
    return ModelShape.from_param_count(n_params), f"task {config.task.path}"


def _cmd_plan(args: argparse.Namespace) -> int:
    from stalwart.config import ParallelConfig, load_config
    from stalwart.plan.estimate import Layout, PlanError
    from stalwart.plan.search import format_bytes, format_plan, plan, recommend

    if args.config is None and args.params is None:
        raise PlanError("plan needs CONFIG or --params N (e.g. stalwart plan --params 7e9 "
                        "--devices 8 --memory-gb 80)")
    if args.config is None and args.overrides:
        raise PlanError("--set needs CONFIG")
    config = load_config(args.config, args.overrides) if args.config is not None else None
    devices = args.devices if args.devices is not None else (
        config.scaling.num_workers if config else 1)
    for flag, value in (("--devices", devices), ("--micro-batch", args.micro_batch),
                        ("--pp-microbatches", args.pp_microbatches),
                        ("--devices-per-node", args.devices_per_node)):
        if value is not None and value < 1:
            raise PlanError(f"{flag} must be >= 1, got {value}")
    if not args.memory_gb > 0:
        raise PlanError(f"--memory-gb must be > 0, got {args.memory_gb}")
    shape, source = _plan_model(args, config)

    # Flags win; then the config's [parallel] keys that exist in this version; then defaults.
    par, train = (config.parallel, config.train) if config else (None, None)

    def pick(flag: object, key: str, default: object) -> object:
        return flag if flag is not None else getattr(par, key, default)

    options = Layout(
        zero3=args.zero == 3 if args.zero is not None else getattr(
            par, "reshard_after_forward", True),
        mixed_precision=pick(args.precision, "mixed_precision", "fp32"),
        cpu_offload=bool(pick(args.cpu_offload, "cpu_offload", False)),
        activation_checkpointing=pick(args.ac, "activation_checkpointing", "none"),
        sequence_parallel=bool(pick(None, "sequence_parallel", True)),
        micro_batch_size=args.micro_batch or (train.micro_batch_size if train else 1),
        pp_microbatches=pick(args.pp_microbatches, "pp_microbatches", None),
        pp_schedule=pick(args.pp_schedule, "pp_schedule", "1f1b"))
    memory = round(args.memory_gb * 2**30)
    candidates = plan(shape, devices, memory, options, max_tp=args.devices_per_node)
    configured = None
    if config is not None and devices == config.scaling.num_workers:
        configured = (*config.parallel.degrees(devices), getattr(par, "tp", 1),
                      getattr(par, "pp", 1))
    print(format_plan(candidates, shape=shape, source=source, devices=devices,
                      memory_bytes=memory, options=options, configured=configured))
    best = recommend(candidates, memory)  # raises NoLayoutFits, naming the smallest estimate
    print(f"recommended: {best.layout.describe()}: {format_bytes(best.estimate.device)}"
          f"{'' if best.estimate.complete else '+'} of {format_bytes(memory)} per device")
    # Only the degrees this version's [parallel] has (pp comes with pipeline parallelism).
    keys = {f.name for f in dataclasses.fields(ParallelConfig)}
    degrees = {"dp_replicate": best.layout.dp_replicate, "dp_shard": best.layout.dp_shard,
               "tp": best.layout.tp, "pp": best.layout.pp}
    print("  " + " ".join(f"--set parallel.{k}={v}" for k, v in degrees.items() if k in keys))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _ensure_cwd_importable()
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "export":
            return _cmd_export(args)
        if args.command == "plan":
            return _cmd_plan(args)
        if args.command == "sweep":
            return _cmd_sweep(args)
        if args.command in JOB_COMMANDS:
            return run_job_command(args)
        if args.command == "report":
            from stalwart.report import main as report

            return report(args.run_dir, out=args.out, as_json=args.json)
        raise ValueError(f"unexpected command {args.command!r}")
    except StalwartError as exc:
        print(f"stalwart: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("stalwart: interrupted twice; stopped without a final checkpoint (the newest "
              "committed one is intact)", file=sys.stderr)
        return EXIT_STOPPED


if __name__ == "__main__":
    sys.exit(main())
