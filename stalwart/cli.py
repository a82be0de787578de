"""The `stalwart` command line: run, export.

Exit codes: 0 finished, 1 the run failed, 2 bad input (nothing was started or changed),
130 stopped by Ctrl-C after checkpointing the last completed step.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from stalwart.errors import StalwartError

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
    run.add_argument("--set", dest="overrides", action="append", default=[],
                     metavar="KEY=VALUE", help="override a config key, e.g. --set train.steps=100"
                     " (repeatable)")
    run.add_argument("--run-dir", help="run directory (default runs/<run.name>-<timestamp>)")
    run.add_argument("--address", help="Ray cluster to join (default: start Ray on this machine)")
    run.add_argument("--resume", action="store_true",
                     help="continue the run in --run-dir from its newest committed checkpoint")

    exp = sub.add_parser("export", help="write a checkpoint's full model weights to one file")
    exp.add_argument("run_dir", help="run directory of the run to export")
    exp.add_argument("--step", type=int, help="checkpoint step (default: the newest committed)")
    exp.add_argument("--out", required=True, help="output file: .safetensors, .pt, .pth or .bin")
    return p


def _cmd_run(args: argparse.Namespace) -> int:
    from stalwart.config import load_config
    from stalwart.errors import RunDirError
    from stalwart.trainer import Trainer, summarize

    if args.resume and not args.run_dir:
        raise RunDirError("--resume needs --run-dir: the run directory to continue")
    config = load_config(args.config, args.overrides)
    result = Trainer(config, run_dir=args.run_dir, address=args.address,
                     resume=args.resume).fit()
    print(summarize(result))
    if result.state == "STOPPED":
        print(f"resume with: stalwart run {args.config} --run-dir {result.run_dir} --resume")
        return EXIT_STOPPED
    return EXIT_OK if result.state == "FINISHED" else EXIT_FAILED


def _cmd_export(args: argparse.Namespace) -> int:
    import torch

    from stalwart.checkpointing.export import export_weights, pick_checkpoint
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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _ensure_cwd_importable()
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "export":
            return _cmd_export(args)
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
