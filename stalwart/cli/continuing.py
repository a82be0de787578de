"""The one command that continues a run, wherever stalwart prints it: `stalwart run` when the
run stops, `stalwart stop` and `stalwart status JOB` for a job's run, and `stalwart status
RUN_DIR`. The same run gets the same command in all of them.

It needs nothing but the run directory: the run's own config.toml (every `--set` and `--inject`
it started with already in it) and `--auto-resume`, which continues from the newest committed
checkpoint that verifies, or starts the run if it has none yet. The checkpoint trust options
the run was given go with it (the resume verifies checkpoints as the run did). Reads and
imports nothing.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path

from stalwart.cli.run_options import key_args


def trust_flags(trust_unsigned: bool, key_file: str | None = None,
                trusted_key_files: Sequence[str] = ()) -> list[str]:
    """The checkpoint trust options, as given, to pass on to the continuing run."""
    return ["--trust-unsigned"] * trust_unsigned + key_args(key_file, trusted_key_files)


def continue_command(run_dir: str | Path, *, flags: Sequence[str] = ()) -> str:
    """`stalwart run RUN_DIR/config.toml --run-dir RUN_DIR --auto-resume FLAGS`, quoted for a
    shell. `flags`: trust options (trust_flags) and --allow-rollback where it is needed."""
    run_dir = str(run_dir)
    args = ["stalwart", "run", str(Path(run_dir) / "config.toml"), "--run-dir", run_dir,
            "--auto-resume", *flags]
    return shlex.join(args)
