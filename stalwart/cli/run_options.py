"""Options that `stalwart run`, `submit` and `sweep` share, declared once so that they parse
into the same names, and the config that `run` and `submit` build from them.

`submit` builds the run's config exactly as `run` will on the cluster, so every problem a run
would refuse (an unknown key, a fault on a rank the run does not have) is refused before
anything is uploaded.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig

RESUME_HELP = "continue the run in --run-dir from its newest committed checkpoint"
AUTO_RESUME_HELP = ("continue the run in --run-dir when it holds a committed checkpoint of "
                    "this run, else start it (for jobs a scheduler retries: Slurm --requeue, "
                    "a RayJob's backoffLimit); a run dir of another run is refused (sets "
                    "run.auto_resume)")
TRUST_UNSIGNED_HELP = ("also accept checkpoints that are not signed with this machine's "
                       "checkpoint key (made elsewhere, or before signing); their files must "
                       "still match their manifest, and the run's events record each one")


KEY_FILE_HELP = ("the checkpoint key file (default: $STALWART_CHECKPOINT_KEY_FILE, else "
                 "~/.config/stalwart/checkpoint.key); never read from a config or a run "
                 "directory")
TRUSTED_KEY_HELP = ("a previous checkpoint key, trusted to verify but never to sign, for "
                    "a key rotation (repeatable; adds to $STALWART_CHECKPOINT_TRUSTED_KEY_FILES)")


def add_key_options(parser: argparse.ArgumentParser) -> None:
    """--key-file and --trusted-key-file: where the checkpoint keys come from."""
    parser.add_argument("--key-file", metavar="FILE", help=KEY_FILE_HELP)
    parser.add_argument("--trusted-key-file", dest="trusted_key_files", action="append",
                        default=[], metavar="FILE", help=TRUSTED_KEY_HELP)


def key_args(key_file: str | None, trusted_key_files: Sequence[str]) -> list[str]:
    """The key options as given, to pass on to the command that continues a run."""
    out = ["--key-file", key_file] if key_file else []
    return out + [a for f in trusted_key_files for a in ("--trusted-key-file", f)]


def add_set_option(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help=help)


def add_inject_option(parser: argparse.ArgumentParser, help: str) -> None:
    parser.add_argument("--inject", action="append", default=[], metavar="FAULT", help=help)


def add_resume_options(parser: argparse.ArgumentParser) -> None:
    """--resume and --auto-resume: one or the other (argparse refuses both, exit 2)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help=RESUME_HELP)
    group.add_argument("--auto-resume", action="store_true", help=AUTO_RESUME_HELP)


def run_config(args: argparse.Namespace) -> JobConfig:
    """The config file with its --set overrides, --auto-resume as run.auto_resume, and the
    --inject faults added to its [[faults]] (each checked against the config, as the config's
    own faults are)."""
    from stalwart.core.config import load_config, parse_fault
    from stalwart.core.errors import RunDirError

    for flag in ("resume", "auto_resume"):
        if getattr(args, flag) and not args.run_dir:
            raise RunDirError(f"--{flag.replace('_', '-')} needs --run-dir: the run "
                              f"directory to continue")
    config = load_config(args.config, args.overrides)
    if args.auto_resume:
        config = dataclasses.replace(config, run=dataclasses.replace(config.run,
                                                                     auto_resume=True))
    if args.inject:
        config = dataclasses.replace(config, faults=(
            *config.faults, *(parse_fault(text) for text in args.inject)))
    return config
