"""`stalwart plan`: estimate every parallel layout's per-device memory and recommend one.

The model comes from a config's task (its model counted on the meta device, its shape from
`TrainTask.model_dims`) or from a bare `--params` count. Nothing is started. Errors are
`PlanError`s, which the CLI prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import TYPE_CHECKING

from stalwart.core.config import AC_MODES, PP_SCHEDULES, PRECISIONS

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig
    from stalwart.plan.estimate import ModelShape


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
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
    pl.add_argument("--memory-gb", type=float, metavar="G",
                    help="memory per device in GiB (default: this machine's devices: its GPUs' "
                    "memory, or for CPU workers its memory shared by them)")
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


# The ranges plan accepts. Enumerating layouts takes time in the divisors of --devices, and
# the arithmetic must stay in floats: a plan beyond these is for no machine that exists.
MAX_DEVICES = 65536
MAX_MEMORY_GB = 2.0**20  # 1 PiB per device
MIN_MEMORY_GB = 0.001
MAX_PARAMS = 10**15
MAX_INT_FLAG = 2**31 - 1
INT_FLAGS = ("layers", "heads", "d_model", "seq_len", "vocab", "ffn", "micro_batch",
             "pp_microbatches", "devices_per_node")


def check_ranges(args: argparse.Namespace, devices: int, *, from_config: bool) -> None:
    """Every numeric flag within its range, before any arithmetic."""
    from stalwart.plan.estimate import PlanError

    if not 1 <= devices <= MAX_DEVICES:
        source = "scaling.num_workers (the devices to plan for)" if from_config else "--devices"
        raise PlanError(f"{source} must be an integer from 1 to {MAX_DEVICES}, got {devices}")
    for name in INT_FLAGS:
        value = getattr(args, name)
        if value is not None and not 1 <= value <= MAX_INT_FLAG:
            raise PlanError(f"--{name.replace('_', '-')} must be an integer from 1 to "
                            f"{MAX_INT_FLAG}, got {value}")
    if args.memory_gb is not None and not (
            MIN_MEMORY_GB <= args.memory_gb <= MAX_MEMORY_GB):  # NaN fails both
        raise PlanError(f"--memory-gb must be a number of GiB from {MIN_MEMORY_GB} to "
                        f"{MAX_MEMORY_GB:.0f} (1 PiB), got {args.memory_gb}")


def parse_count(text: str) -> int:
    """A parameter count as people write it: 7e9, 1.3B, 350M, 125k, 7_000_000."""
    scales = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
    clean = text.strip().lower().replace("_", "").replace(",", "")
    scale = scales.get(clean[-1:], 1.0)
    try:
        value = float(clean[:-1] if scale != 1.0 else clean) * scale
    except ValueError:
        value = float("nan")
    if not 1 <= value <= MAX_PARAMS:
        from stalwart.plan.estimate import PlanError

        raise PlanError(f"--params {text!r} is not a parameter count from 1 to 1e15: write "
                        f"e.g. 7e9, 1.3B or 350M")
    return round(value)


def _plan_model(args: argparse.Namespace, config: JobConfig | None) -> tuple[ModelShape, str]:
    """The model's shape, and where it came from: the task's model (and its
    `TrainTask.model_dims` hook), or a bare --params count with its shape flags."""
    from stalwart.plan.estimate import ModelShape, PlanError

    shape_flags = {"n_layers": args.layers, "n_heads": args.heads, "d_model": args.d_model,
                   "seq_len": args.seq_len, "vocab_size": args.vocab, "ffn_hidden": args.ffn}
    if config is None:
        return (ModelShape.from_param_count(parse_count(args.params), **shape_flags),
                "--params")
    if args.params is not None or any(v is not None for v in shape_flags.values()):
        raise PlanError("give CONFIG or --params (with shape flags), not both: change the "
                        "config's model with --set task.args.KEY=VALUE")
    from stalwart.core.task import build_task  # torch: only for a config's model

    task = build_task(config.task.path, config.task.args)
    return ModelShape.from_task(task, config), f"task {config.task.path}"


def cmd_plan(args: argparse.Namespace) -> int:
    from stalwart.core.config import ParallelConfig, load_config
    from stalwart.plan.devices import planned_devices
    from stalwart.plan.estimate import PlanError, PlanLayout
    from stalwart.plan.search import (
        NoLayoutFits,
        format_bytes,
        format_plan,
        plan,
        recommend,
        refused,
        runnable_check,
        valid_layouts,
        why_recommended,
    )

    if args.config is None and args.params is None:
        raise PlanError("plan needs CONFIG or --params N (e.g. stalwart plan --params 7e9 "
                        "--devices 8 --memory-gb 80)")
    if args.config is None and args.overrides:
        raise PlanError("--set needs CONFIG")
    config = load_config(args.config, args.overrides) if args.config is not None else None
    devices = args.devices if args.devices is not None else (
        config.scaling.num_workers if config else 1)
    check_ranges(args, devices, from_config=args.devices is None and config is not None)
    shape, source = _plan_model(args, config)

    # Flags win; then the config's [parallel] keys that exist in this version; then defaults.
    par, train = (config.parallel, config.train) if config else (None, None)

    def pick(flag: object, key: str, default: object) -> object:
        return flag if flag is not None else getattr(par, key, default)

    options = PlanLayout(
        zero3=args.zero == 3 if args.zero is not None else getattr(
            par, "reshard_after_forward", True),
        mixed_precision=pick(args.precision, "mixed_precision", "fp32"),
        cpu_offload=bool(pick(args.cpu_offload, "cpu_offload", False)),
        activation_checkpointing=pick(args.ac, "activation_checkpointing", "none"),
        sequence_parallel=bool(pick(None, "sequence_parallel", True)),
        micro_batch_size=args.micro_batch or (train.micro_batch_size if train else 1),
        pp_microbatches=pick(args.pp_microbatches, "pp_microbatches", None),
        pp_schedule=pick(args.pp_schedule, "pp_schedule", "1f1b"))
    # The devices: --memory-gb, else this machine's (a CPU-only one's memory, shared).
    target = planned_devices(args.memory_gb, devices, config)
    memory = target.bytes
    # With a config, only the layouts a run of it would start (the others are listed apart).
    check = runnable_check(config) if config is not None else None
    candidates = plan(shape, devices, memory, options, max_tp=args.devices_per_node,
                      check=check)
    left_out = refused(valid_layouts(devices, shape, options, max_tp=args.devices_per_node),
                       check)
    configured = None
    if config is not None and devices == config.scaling.num_workers:
        configured = config.parallel.layout(devices)
    print(format_plan(candidates, shape=shape, source=source, devices=devices,
                      memory_bytes=memory, options=options, configured=configured,
                      left_out=left_out, memory_source=target.source))
    try:
        best = recommend(candidates, memory)  # NoLayoutFits names the smallest estimate
    except NoLayoutFits as exc:
        if target.source == "--memory-gb":
            raise
        raise NoLayoutFits(f"{exc} (the devices are {target.source}; --memory-gb G plans "
                           f"for others)") from None
    print(f"recommended: {best.layout.describe()}: {format_bytes(best.estimate.device)}"
          f"{'' if best.estimate.complete else '+'} of {format_bytes(memory)} per device")
    print(f"  {why_recommended(best)}")
    # Only the degrees this version's [parallel] has (pp comes with pipeline parallelism).
    keys = {f.name for f in dataclasses.fields(ParallelConfig)}
    print("  " + " ".join(f"--set parallel.{k}={v}" for k, v in best.layout.degrees().items()
                          if k in keys))
    return 0


