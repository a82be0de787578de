"""`stalwart submit / status / logs / stop`: a run as a Ray job on a cluster, from anywhere.

`status` also takes a run directory: that is read locally by stalwart.cli.run_status (its
own exit codes: 0 finished, 1 ended early, 3 no end recorded).

`submit` ships the working directory (never from $HOME or /; credentials and sweep state left
out, see stalwart.cli.upload) and says how many files and bytes; `--dry-run` lists them, and
the credentials it leaves out, and stops. It returns once the cluster has the job (closing the
terminal does not stop it) unless --follow streams its output to the end. Exit codes as for
`stalwart run`: 0 done (or submitted), 1 the job failed or was stopped, 2 bad input (nothing
submitted), 130 Ctrl-C while following (which stops the following, never the job).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import datetime
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from stalwart.cli import jobs, upload
from stalwart.cli.continuing import continue_command, trust_flags
from stalwart.cli.run_options import (
    TRUST_UNSIGNED_HELP,
    add_inject_option,
    add_key_options,
    add_resume_options,
    add_set_option,
    run_config,
)
from stalwart.core.errors import ClusterError, ConfigError
from stalwart.tables import key_values

if TYPE_CHECKING:
    from ray.job_submission import JobDetails, JobSubmissionClient

JOB_COMMANDS = ("submit", "status", "logs", "stop")
EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
ADDRESS_HELP = ("the cluster's job API, http://HEAD:8265 (its head's dashboard; default "
                "$RAY_API_SERVER_ADDRESS, else $RAY_ADDRESS if it is an http URL)")


def add_job_commands(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("submit", help="run a config as a Ray job on a cluster (ships the "
                       "current directory)")
    s.add_argument("config", help="TOML config file, inside the current directory")
    add_set_option(s, "override a config key (repeatable)")
    s.add_argument("--run-dir", help="run directory, made absolute against the current "
                   "directory (default runs/<run.name>-<timestamp>); on a remote cluster, a "
                   "path its nodes can write")
    add_inject_option(s, "inject a fault, as for `stalwart run` (repeatable)")
    add_resume_options(s)
    s.add_argument("--trust-unsigned", action="store_true", help=TRUST_UNSIGNED_HELP)
    s.add_argument("--address", help=ADDRESS_HELP)
    s.add_argument("--follow", action="store_true", help="stream the job's output until it "
                   "ends; exit 0 if it succeeded, 1 if it failed or was stopped")
    s.add_argument("--job-id", help="the job's submission id (default: one Ray makes up)")
    s.add_argument("--dry-run", action="store_true", help="list the files the job would "
                   "upload (size, path), their totals and the credentials left out, and "
                   "submit nothing (no cluster needed)")

    for name, what in (("status", "show a job's status, or a run directory's"),
                       ("logs", "print a job's output"),
                       ("stop", "stop a job: it checkpoints its last step, as on Ctrl-C")):
        p = sub.add_parser(name, help=what)
        if name == "status":  # a run dir, read locally (stalwart/cli/run_status.py), or a job
            p.add_argument("job_id", metavar="RUN_DIR|JOB", help="a run directory (its "
                           "state, step, newest checkpoint, how to continue it), or a job's "
                           "submission id (or job id)")
            p.add_argument("--trust-unsigned", action="store_true", help="for a run "
                           "directory: also accept checkpoints not signed with this key, as "
                           "`run --trust-unsigned` does")
            add_key_options(p)
        else:
            p.add_argument("job_id", metavar="JOB", help="the job's submission id (or job id)")
        p.add_argument("--address", help=ADDRESS_HELP)
        if name == "logs":
            p.add_argument("--follow", action="store_true", help="stream until the job ends "
                           "(Ctrl-C stops following, not the job)")


def run_job_command(args: argparse.Namespace) -> int:
    """Run one job command; StalwartError propagates (the CLI prints it, exit code 2)."""
    commands = {"submit": _submit, "status": _status, "logs": _logs, "stop": _stop}
    if args.command not in commands:
        raise ValueError(f"unexpected command {args.command!r}")
    return commands[args.command](args)


def _submit(args: argparse.Namespace) -> int:
    from stalwart.run_dir import RunDir

    # Everything local first: a refused job leaves nothing on the cluster.
    cwd = Path.cwd().resolve()
    upload.refuse_home_or_root(cwd)
    address = None if args.dry_run else jobs.resolve_address(args.address)
    config_path = jobs.config_in(args.config, cwd)
    config = run_config(args)  # the config the job's `stalwart run` will build
    jobs.check_storage(config.checkpoint.storage)
    spec = jobs.JobSpec(config=config_path, overrides=tuple(args.overrides),
                        injects=tuple(args.inject), resume=args.resume,
                        auto_resume=config.run.auto_resume,
                        stop_timeout_s=config.failure.stop_timeout_s,
                        trust_unsigned=args.trust_unsigned,
                        run_dir=jobs.absolute_run_dir(args.run_dir, RunDir.default_path(config),
                                                      cwd))
    # What Ray will pack, found as Ray finds it (its excludes, .gitignore and .rayignore).
    excludes = spec.runtime_env(cwd, config.checkpoint.storage)["excludes"]
    shipped = upload.listing(cwd, excludes)
    _check_config_ships(config_path, shipped)
    if address is None:  # --dry-run
        print(upload.describe(shipped, upload.withheld(shipped, excludes,
                                                       set(jobs.secret_excludes(cwd)))))
        print(f"entrypoint: {spec.entrypoint()}\nnothing submitted (--dry-run)")
        return EXIT_OK

    jobs.check_task_here(config, cwd)  # the task as the job's `stalwart run` would check it
    client = jobs.job_client(address)
    print(f"uploading {shipped.summary()} from {cwd}", flush=True)
    job_id = jobs.submit(client, spec, cwd=cwd, storage=config.checkpoint.storage,
                         job_id=args.job_id)
    submit_cmd = spec.resume_commands(address)[0]
    run_cmd = continue_command(spec.run_dir, flags=trust_flags(spec.trust_unsigned))
    # The run goes on (after a stop, or if its driver dies) with the command that status and
    # stop print, where the run dir is seen; or as a job again.
    print(f"submitted job {job_id} to {address}\n" + key_values([
        ("run dir:", str(spec.run_dir)),
        ("dashboard:", f"{address}/#/jobs/{job_id}"),
        ("follow:", f"stalwart logs {job_id} --address {address} --follow"),
        ("stop:", f"stalwart stop {job_id} --address {address}"),
        ("continue:", run_cmd),
        ("as a job:", submit_cmd)], indent=2, gap=1), flush=True)
    if not args.follow:
        return EXIT_OK
    return _follow(client, job_id, address)


def _check_config_ships(config_path: PurePosixPath, shipped: upload.Upload) -> None:
    """The job reads its config from its copy of the working directory."""
    if str(config_path) not in {e.path for e in shipped.entries}:
        raise ConfigError(f"config file {str(config_path)!r} would be left out of the upload (by "
                          f"a .gitignore, a .rayignore, or what submit never ships: runs/, "
                          f"checkpoints/, sweeps/, credentials), so the job could not read it; "
                          f"keep it where it ships, outside those")


def _follow(client: JobSubmissionClient, job_id: str, address: str) -> int:
    try:
        status = jobs.follow(client, job_id, lambda text: (sys.stdout.write(text),
                                                           sys.stdout.flush()))
    except KeyboardInterrupt:
        print(f"\nstopped following; job {job_id} goes on (stop it with: stalwart stop "
              f"{job_id} --address {address})", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"job {job_id}: {status}")
    return EXIT_OK if status == "SUCCEEDED" else EXIT_FAILED


def _status(args: argparse.Namespace) -> int:
    from stalwart.cli.run_status import is_run_dir_arg, run_status

    if is_run_dir_arg(args.job_id):
        return run_status(args.job_id, trust_unsigned=args.trust_unsigned,
                          key_file=args.key_file,
                          trusted_key_files=tuple(args.trusted_key_files))
    for flag, given in (("--trust-unsigned", args.trust_unsigned),
                        ("--key-file", args.key_file),
                        ("--trusted-key-file", args.trusted_key_files)):
        if given:
            raise ConfigError(f"{flag} is for a run directory, and there is none named "
                              f"{args.job_id!r} here")
    try:
        address = jobs.resolve_address(args.address)
    except ClusterError as exc:
        raise ClusterError(f"no run directory {args.job_id!r} here; as a job id: {exc}") from None
    print(_describe(jobs.find(jobs.job_client(address), args.job_id)))
    return EXIT_OK


def _describe(job: JobDetails) -> str:
    rows: list[tuple[str, str]] = []
    if job.message:
        rows.append(("message:", job.message))
    rows.append(("entrypoint:", job.entrypoint))
    metadata = job.metadata or {}
    if run_dir := metadata.get("stalwart_run_dir"):
        rows.append(("run dir:", run_dir))
    if job.status.value in ("FAILED", "STOPPED") and (command := job_continue(job)):
        rows.append(("continue:", command))
    times = [datetime.fromtimestamp(t / 1000).isoformat(sep=" ", timespec="seconds")
             for t in (job.start_time, job.end_time) if t]
    if times:
        rows.append((f"{'started, ended' if len(times) == 2 else 'started'}:",
                     ", ".join(times)))
    if job.driver_exit_code is not None:
        rows.append(("driver exit code:", str(job.driver_exit_code)))
    return (f"job {job.submission_id or job.job_id}: {job.status.value}\n"
            f"{key_values(rows, indent=2, gap=1)}")


def _logs(args: argparse.Namespace) -> int:
    address = jobs.resolve_address(args.address)
    client = jobs.job_client(address)
    jobs.find(client, args.job_id)  # an unknown id is an error, not an empty stream
    if args.follow:
        return _follow(client, args.job_id, address)
    print(client.get_job_logs(args.job_id), end="")
    return EXIT_OK


def _stop(args: argparse.Namespace) -> int:
    address = jobs.resolve_address(args.address)
    client = jobs.job_client(address)
    job = jobs.find(client, args.job_id)
    if job.status.value in jobs.TERMINAL:
        print(f"job {args.job_id} already ended: {job.status.value}")
        return EXIT_OK
    client.stop_job(args.job_id)
    wait_s = jobs.stop_wait_of(job)
    print(f"stopping job {args.job_id}: its run checkpoints the step in flight (up to "
          f"{wait_s} s before it is killed)", flush=True)
    status = jobs.wait_for_end(client, args.job_id, timeout_s=wait_s + 30)
    print(f"job {args.job_id}: {status}")
    if command := job_continue(job):
        print(f"  continue:   {command}")
    return EXIT_OK if status == "STOPPED" else EXIT_FAILED


def job_continue(job: JobDetails) -> str | None:
    """The command that continues a job's run, as `stalwart status RUN_DIR` prints it (on a
    machine that sees the run dir); None for a job that `stalwart submit` did not start."""
    run_dir = (job.metadata or {}).get("stalwart_run_dir")
    if not run_dir:
        return None
    try:
        given = shlex.split(job.entrypoint or "")
    except ValueError:  # not ours to parse
        given = []
    return continue_command(run_dir, flags=trust_flags("--trust-unsigned" in given))
