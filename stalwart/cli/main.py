"""The `stalwart` command line: run, export, plan, sweep, report, and Ray jobs (submit,
status, logs, stop).

Exit codes: 0 finished, 1 the run failed, 2 bad input (nothing was started or changed; a
bare `stalwart` prints the commands and exits 2 too), 130 stopped by Ctrl-C and 143 by SIGTERM
(128 + the signal), whether the step in flight was checkpointed or, on a second signal or past
failure.stop_timeout_s, abandoned. Output piped into a reader that stopped reading (`| head`)
ends the command quietly with 141, as the shell's own tools end (128 + SIGPIPE).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.cli.continuing import continue_command, trust_flags
from stalwart.cli.job_commands import JOB_COMMANDS, add_job_commands, run_job_command
from stalwart.cli.plan import add_plan_parser, cmd_plan
from stalwart.cli.run_options import (
    TRUST_UNSIGNED_HELP,
    add_inject_option,
    add_key_options,
    add_resume_options,
    add_set_option,
    run_config,
)
from stalwart.core.errors import StalwartError
from stalwart.core.spelling import closest

if TYPE_CHECKING:
    from stalwart.trainer import RunResult

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_STOPPED = 0, 1, 2, 130
EXIT_BROKEN_PIPE = 128 + signal.SIGPIPE


# Commands that import the user's task: the current directory is searched for it, last.
IMPORTS_TASK = ("run", "plan", "sweep")


def _import_path_for(command: str) -> None:
    """Where modules are found. A console script's sys.path[0] is its bin/ dir, but user
    tasks live next to the user: commands that import a task append the current directory
    (appended, so a file there never shadows a library). The others import nothing from
    it: `report` and `export` run in run directories that anyone may have written to."""
    cwd = os.getcwd()
    if command in IMPORTS_TASK:
        if cwd not in sys.path:
            sys.path.append(cwd)
        return
    sys.path[:] = [p for p in sys.path if p not in ("", ".", cwd)]  # `python -m` puts it first


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as every other bad input's: one `stalwart: error:` line
    (not the usage block), exit code 2. Subcommands' parsers are of this class too."""

    def error(self, message: str) -> typing.NoReturn:
        command = self.prog.removeprefix("stalwart").strip()
        print(f"stalwart: error: {command + ': ' if command else ''}{message}; see "
              f"`{self.prog} --help`", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)

    def _check_value(self, action: argparse.Action, value: typing.Any) -> None:
        """A command or choice that is not one: the closest one named first."""
        choices = action.choices
        if choices is not None and value not in choices and isinstance(value, str):
            match = closest(value, [str(c) for c in choices])
            hint = f"did you mean {match!r}? " if match is not None else ""
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}; {hint}choose "
                                                 f"from {', '.join(map(repr, choices))}")
        super()._check_value(action, value)


def _version() -> str:
    """The installed package's version (what pip installed, not a constant in the code)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stalwart")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="stalwart", description="Elastic, fault-tolerant PyTorch "
                "training on Ray.")
    p.add_argument("--version", action="version", version=f"stalwart {_version()}")
    # Not required: a bare `stalwart` prints the commands (main), not an error line.
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    run = sub.add_parser("run", help="train a task described by a TOML config")
    run.add_argument("config", help="TOML config file (see examples/gpt/config.toml)")
    add_set_option(run, "override a config key, e.g. --set train.steps=100 (repeatable)")
    run.add_argument("--run-dir", help="run directory (default runs/<run.name>-<timestamp>)")
    run.add_argument("--address", help="Ray cluster to join (default: start Ray on this machine)")
    add_inject_option(run, "inject a fault, e.g. kill:rank=1,step=20, hang:rank=0,step=40, "
                           "raise:rank=1,step=60, term:rank=1,step=30, kill-node:node=1,"
                           "step=80, freeze-node:node=1,step=80, drain:node=1,step=50 "
                           "(repeatable; adds to the config's [[faults]])")
    add_resume_options(run)
    run.add_argument("--allow-rollback", action="store_true",
                     help="with --resume or --auto-resume: continue from the newest "
                          "checkpoint that verifies even when it is older than the newest "
                          "the run dir recorded as committed (refused by default)")
    run.add_argument("--trust-unsigned", action="store_true", help=TRUST_UNSIGNED_HELP)
    add_key_options(run)
    run.add_argument("--profile", metavar="STEPS",
                     help="trace these steps with the PyTorch profiler on every rank: 20 or "
                          "20-22 (inclusive); traces go to RUN_DIR/profile/ (sets "
                          "run.profile_steps)")

    exp = sub.add_parser("export", help="write a checkpoint's full model weights to one file, "
                                        "a Hugging Face model directory or a peft adapter")
    exp.add_argument("run_dir", help="run directory of the run to export")
    exp.add_argument("--step", type=int, help="checkpoint step (default: the newest committed)")
    exp.add_argument("--format", choices=("file", "hf", "peft"), default="file",
                     help="file: the weights in one file (default); hf: a Hugging Face model "
                          "directory (config.json, tokenizer, safetensors) for from_pretrained; "
                          "peft: a LoRA fine-tune's adapter directory for "
                          "PeftModel.from_pretrained")
    exp.add_argument("--merge", action="store_true",
                     help="with --format hf: merge a LoRA fine-tune's adapter into its base "
                          "model (read where training read it, checked unchanged)")
    exp.add_argument("--out", required=True,
                     help="output file (.safetensors, .pt, .pth or .bin), or with --format hf "
                          "or peft a directory that does not exist yet")
    exp.add_argument("--max-shard-size", default="5GB",
                     help="with --format hf: split the weights into files of at most this "
                          "size, with an index (default 5GB)")
    exp.add_argument("--trust-unsigned", action="store_true", help=TRUST_UNSIGNED_HELP)
    add_key_options(exp)
    add_plan_parser(sub)

    sw = sub.add_parser("sweep", help="sweep hyperparameters with Ray Tune, as SWEEP.toml says")
    sw.add_argument("sweep", help="TOML sweep file (see examples/gpt/sweep_asha.toml)")
    add_set_option(sw, "override a key of the job config for every trial (repeatable)")
    sw.add_argument("--address", help="Ray cluster to join (default: start Ray on this machine)")
    sw.add_argument("--resume", action="store_true",
                    help="continue the sweep's Tune experiment (Tune's own restore)")
    sw.add_argument("--verbose", action="store_true",
                    help="print Tune's own output and each trial's, instead of a table of "
                         "the trials per round (their output then goes to output.log in "
                         "each trial's directory)")
    add_key_options(sw)
    add_job_commands(sub)

    rep = sub.add_parser("report", help="where a run's time went: goodput, failures, a figure")
    rep.add_argument("run_dir", help="run directory (its run may still be going)")
    rep.add_argument("--out", help="the figure's PNG file (default RUN_DIR/report.png)")
    rep.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def _cmd_run(args: argparse.Namespace) -> int:

    from stalwart.core.config import parse_profile_steps
    from stalwart.core.errors import ConfigError

    config = run_config(args)
    if args.profile is not None:
        steps = parse_profile_steps(args.profile)
        try:
            config = dataclasses.replace(config, run=dataclasses.replace(
                config.run, profile_steps=steps))
        except ConfigError as exc:  # steps past train.steps
            raise ConfigError(f"--profile {args.profile!r}: {exc}") from None
    # Imported once the config is good; Trainer.fit loads torch and Ray after its own checks.
    from stalwart.orchestrator.interrupt import StopAbandoned
    from stalwart.trainer import Trainer

    trainer = Trainer(config, run_dir=args.run_dir, address=args.address,
                      resume=args.resume, trust_unsigned=args.trust_unsigned,
                      key_file=args.key_file, trusted_key_files=args.trusted_key_files,
                      allow_rollback=args.allow_rollback)
    try:
        result = trainer.fit()
    except StopAbandoned as exc:  # a second stop signal, or failure.stop_timeout_s passed
        print(f"stalwart: stopped: {exc}; the newest committed checkpoint is intact",
              file=sys.stderr)
        print(f"continue: {_continue(args, trainer.run_dir.path)}")
        return 128 + exc.signum
    print(closing_summary(result))
    if result.state == "STOPPED":
        print(f"  continue: {_continue(args, result.run_dir)}")
        return 128 + result.stop_signal if result.stop_signal else EXIT_STOPPED
    return EXIT_OK if result.state == "FINISHED" else EXIT_FAILED


def _continue(args: argparse.Namespace, run_dir: Path) -> str:
    """The command that continues this stopped run (as `stalwart status` prints it)."""
    return continue_command(run_dir, flags=trust_flags(args.trust_unsigned, args.key_file,
                                                       args.trusted_key_files))


def closing_summary(result: RunResult) -> str:
    """What `stalwart run` prints when the run ends: state, loss, val_loss and the task's
    own metrics, throughput (tokens/s or samples/s: stalwart.progress.throughput_unit),
    checkpoints."""
    from stalwart.core import events as ev
    from stalwart.progress import metrics_text, row_throughput_unit, task_metrics

    commits = [e for e in ev.read_events(result.run_dir / "events.jsonl")
               if isinstance(e, ev.CheckpointCommitted)]
    lines = [f"{result.state} at step {result.step} in {result.wall_s:.1f}s"]
    if result.loss is not None:
        val = {"val_loss": result.val_loss} if result.val_loss is not None else {}
        lines.append("  " + metrics_text({"loss": result.loss, **val,
                                          **task_metrics(result.metrics)}))
    if result.tokens_per_s is not None:
        lines.append(f"  throughput {result.tokens_per_s:,.0f} "
                     f"{row_throughput_unit(result.metrics)}/s")
    if commits:
        lines.append(f"  checkpoints committed: {len(commits)}, newest step "
                     f"{commits[-1].step} at {commits[-1].path}")
    lines.append(f"  run dir: {result.run_dir}")
    if result.reason:
        lines.append(f"  reason: {result.reason}")
    return "\n".join(lines)


def _cmd_export(args: argparse.Namespace) -> int:
    from functools import partial

    from stalwart.core.config import load_config
    from stalwart.core.errors import ConfigError
    from stalwart.run_dir import RunDir

    if args.merge and args.format != "hf":
        raise ConfigError(f"export: --merge goes with --format hf only (it writes the merged "
                          f"model as a Hugging Face model directory), not --format "
                          f"{args.format}")
    rd = RunDir(Path(args.run_dir))
    rd.check_resumable()  # before torch loads: a wrong path fails in a second
    config = load_config(rd.config_file)
    from stalwart.checkpointing.storage.export import check_out, export_newest, write_file
    from stalwart.checkpointing.storage.export_hf import check_out_dir, parse_size, write_hf
    from stalwart.checkpointing.storage.export_peft import write_merged, write_peft
    from stalwart.checkpointing.storage.layout import check_remote_readable
    from stalwart.checkpointing.storage.signing import CheckpointTrust, load_trust_keys

    out = Path(args.out)
    if args.format == "hf":
        try:
            shard_bytes = parse_size(args.max_shard_size)
        except ValueError as exc:
            raise ConfigError(f"--max-shard-size: {exc}") from None
        write = partial(write_merged if args.merge else write_hf, max_shard_bytes=shard_bytes)
        check = check_out_dir
    elif args.format == "peft":
        write, check = write_peft, check_out_dir
    else:
        write, check = write_file, check_out
    check(out)
    key, previous = load_trust_keys(args.key_file, tuple(args.trusted_key_files))
    trust = CheckpointTrust(key=key, previous=previous, accept_unsigned=args.trust_unsigned)

    def skipped(step: int, why: str) -> None:  # read only: the checkpoint stays as it is
        print(f"stalwart: skipping checkpoint step {step}: {why}", file=sys.stderr)

    storage = rd.storage_url(config)
    check_remote_readable(storage)
    checkpoint, out = export_newest(storage, args.step, out, trust=trust,
                                    on_skip=skipped, check=check, write=write)
    if checkpoint.unsigned:
        print(f"stalwart: exporting step {checkpoint.step} although {checkpoint.unsigned} "
              f"(--trust-unsigned)", file=sys.stderr)
    print(f"exported step {checkpoint.step} of {rd.path} to {out}")
    return EXIT_OK


def _cmd_sweep(args: argparse.Namespace) -> int:
    # The sweep file and --address are checked before Ray, Tune and torch load: a bad one
    # fails in a second.
    from stalwart.cluster import check_reachable, connect
    from stalwart.integrations.tune.sweep_file import load_sweep

    if args.address:
        check_reachable(args.address)
    sweep = load_sweep(args.sweep, args.overrides)
    from stalwart.integrations.tune.sweep import (
        check_experiment_dir,
        embedded_cpus,
        format_results,
        run_sweep,
        trial_rows,
        write_results,
    )

    check_experiment_dir(sweep, args.resume)
    from stalwart.checkpointing.storage.signing import load_trust_keys

    load_trust_keys(args.key_file, tuple(args.trusted_key_files))  # a bad key fails here
    import ray

    started = connect(args.address, num_cpus=embedded_cpus(sweep))
    try:
        rows = trial_rows(sweep, run_sweep(sweep, resume=args.resume, key_file=args.key_file,
                                           trusted_key_files=args.trusted_key_files,
                                           verbose=args.verbose))
    finally:
        if started:
            ray.shutdown()
    print(f"\n{format_results(sweep, rows)}")
    print(f"results: {write_results(sweep, rows)}")
    return EXIT_FAILED if any(r.state == "error" for r in rows) or not rows else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, so that a reader gone away is seen here
        return code
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # another pipe or socket broke: a real error
        return _reader_gone()


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll says POLLERR then)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no fd (a test's capture), no poll
        return False


def _reader_gone() -> int:
    """The reader of our output stopped reading (`stalwart report RUN | head`): end quietly,
    as `cat` or `git log` do, with 128 + SIGPIPE. What is still buffered goes nowhere; without
    this Python would print a second traceback when it flushes stdout at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return EXIT_BROKEN_PIPE


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `stalwart`: what it can do, as bad input (nothing ran)
        parser.print_help(sys.stderr)
        return EXIT_BAD_INPUT
    _import_path_for(args.command)
    try:
        if args.command == "run":
            return _cmd_run(args)
        if args.command == "export":
            return _cmd_export(args)
        if args.command == "plan":
            return cmd_plan(args)
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
    except KeyboardInterrupt:  # before the run's own stop handling was installed, or after
        print("stalwart: interrupted; stopped without a final checkpoint (the newest "
              "committed one is intact)", file=sys.stderr)
        return EXIT_STOPPED


if __name__ == "__main__":
    sys.exit(main())
