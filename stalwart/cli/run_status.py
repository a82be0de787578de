"""`stalwart status RUN_DIR`: where a run stands, from its run directory alone.

Says whether the run finished, stopped, failed or was interrupted (the last invocation's end
event in events.jsonl), or that no end is recorded: it is running, or its driver was lost
(killed outright) before it could write one. Then its last step, its newest committed
checkpoint that verifies (signature and checksums, as a resume checks them; one that does
not verify is named and never loaded), and the command that continues the run.

Like `report` and `export`, it reads files only: it imports no task code and needs no Ray.

Exit codes: 0 finished; 1 ended before its last step (stopped, failed, interrupted): continue
it with the command printed; 3 no end recorded (running, or its driver was lost); 2 bad input.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from stalwart.cli.continuing import continue_command, trust_flags
from stalwart.core import events as ev
from stalwart.core.errors import RunDirError
from stalwart.tables import key_values

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig

EXIT_FINISHED, EXIT_ENDED_EARLY, EXIT_NO_END = 0, 1, 3
NO_END = "RUNNING"


def is_run_dir_arg(arg: str) -> bool:
    """Whether `status ARG` is about a run directory rather than a Ray job: ARG exists
    here, or is written as a path. A path that is no run dir is refused (RunDirError)."""
    path = Path(arg)
    if path.is_dir():
        if not (path / "config.toml").exists() and not (path / "events.jsonl").exists():
            raise RunDirError(f"{arg} is a directory but not a run directory (it holds no "
                              f"config.toml or events.jsonl); status takes a run directory "
                              f"or a job id")
        return True
    if path.exists():
        raise RunDirError(f"{arg} is a file; status takes a run directory or a job id")
    if "/" in arg or arg in (".", ".."):
        raise RunDirError(f"run dir {arg} does not exist; status takes a run directory or "
                          f"a job id")
    return False


@dataclass(frozen=True, kw_only=True)
class Checkpoints:
    """The run's storage checkpoints as a resume would see them."""

    url: str
    newest: int | None = None
    """The newest committed step that verifies."""
    newest_path: str | None = None
    unsigned: str | None = None
    """Set when the newest was accepted without a trusted signature (--trust-unsigned)."""
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """Committed steps newer than it that do not verify, and why (never loaded)."""
    problem: str | None = None
    """Why the checkpoints could not be checked at all (no key, storage unreadable)."""
    recorded: int | None = None
    """The newest step the run dir's events record as committed (a resume from an older
    one is refused without --allow-rollback)."""


@dataclass(frozen=True, kw_only=True)
class RunStatus:
    state: str
    """FINISHED, STOPPED, FAILED, INTERRUPTED, or RUNNING: no end recorded."""
    reason: str | None
    step: int | None
    """The last completed step: the end event's, else the last metrics row's."""
    steps_total: int | None
    last_event: float | None
    """When the newest event was written; None when there is none yet."""
    checkpoints: Checkpoints
    has_config: bool


def read_status(run_dir: Path, *, trust_unsigned: bool = False, key_file: str | None = None,
                trusted_key_files: tuple[str, ...] = ()) -> RunStatus:
    """The run's status from its files; a damaged record is a RecordError (bad input)."""
    from stalwart.core.config import load_config

    events = ev.read_events(run_dir / "events.jsonl") if (run_dir / "events.jsonl").exists() \
        else []
    rows = ev.read_metrics(run_dir / "metrics.jsonl") \
        if (run_dir / "metrics.jsonl").exists() else []
    config_file = run_dir / "config.toml"
    has_config = config_file.exists()
    config = load_config(config_file if has_config else None)
    end = last_end(events)
    starts = [e for e in events if isinstance(e, ev.Started)]
    step = end.step if end is not None else (rows[-1].step if rows else
                                             (starts[-1].start_step if starts else None))
    # The newest invocation's target (a resume may have changed train.steps).
    steps_total = starts[-1].steps if starts else (config.train.steps if has_config else None)
    return RunStatus(
        state=end.kind.upper() if end is not None else NO_END,
        reason=getattr(end, "reason", None), step=step, steps_total=steps_total,
        last_event=events[-1].time if events else None, has_config=has_config,
        checkpoints=_checkpoints(run_dir, config, trust_unsigned=trust_unsigned,
                                 keys=(key_file, trusted_key_files)))


def _checkpoints(run_dir: Path, config: JobConfig, *, trust_unsigned: bool,
                 keys: tuple[str | None, tuple[str, ...]]) -> Checkpoints:
    """The newest checkpoint that verifies, with the key from --key-file, the environment
    or the default file: never one the run dir's config names (a run dir is data here)."""
    from stalwart.checkpointing.errors import CheckpointKeyError
    from stalwart.checkpointing.storage.catalog import newest_valid
    from stalwart.checkpointing.storage.layout import check_remote_readable
    from stalwart.checkpointing.storage.signing import (
        CheckpointTrust,
        key_file_path,
        load_trust_keys,
    )
    from stalwart.run_dir import RunDir

    rd = RunDir(run_dir)
    url = rd.storage_url(config)
    check_remote_readable(url)
    path, named_by = key_file_path(keys[0])
    if not path.exists():  # read only: the default key is never created here
        return Checkpoints(url=url, problem=f"they cannot be verified here: {named_by} "
                                            f"{str(path)!r} does not exist")
    try:
        key, previous = load_trust_keys(*keys)
    except CheckpointKeyError as exc:
        return Checkpoints(url=url, problem=f"they cannot be verified here: {exc}")
    run_id = rd.run_id_file.read_text().strip() if rd.run_id_file.exists() else ""
    trust = CheckpointTrust(key=key, previous=previous, accept_unsigned=trust_unsigned,
                            run_id=run_id or None)
    skipped: list[tuple[int, str]] = []
    try:
        newest = newest_valid(url, trust, on_skip=lambda s, why: skipped.append((s, why)))
    except Exception as exc:  # any filesystem's own error type (permissions, auth, network)
        return Checkpoints(url=url, problem=f"{url} cannot be read: {type(exc).__name__}: "
                                            f"{exc}")
    if newest is None:
        return Checkpoints(url=url, skipped=skipped)
    return Checkpoints(url=url, newest=newest.step, newest_path=newest.path,
                       unsigned=newest.unsigned, skipped=skipped,
                       recorded=rd.newest_recorded_commit())


END_EVENTS = (ev.Finished, ev.Stopped, ev.Failed, ev.Interrupted)
# Each invocation of `stalwart run` starts with one of these (a resume, or a fresh start in
# a run dir that held no checkpoint): an end written before it is an earlier invocation's.
BEGIN_EVENTS = (ev.Resumed, ev.StartedFrom, ev.Started)


def last_end(events: list[ev.Event]
             ) -> ev.Finished | ev.Stopped | ev.Failed | ev.Interrupted | None:
    """The newest invocation's end event, or None while it has none."""
    end: ev.Finished | ev.Stopped | ev.Failed | ev.Interrupted | None = None
    for e in events:
        if isinstance(e, BEGIN_EVENTS):
            end = None
        elif isinstance(e, END_EVENTS):
            end = e
    return end


def describe(run_dir: str, status: RunStatus, *, flags: Sequence[str] = (),
             now: float | None = None) -> str:
    now = time.time() if now is None else now
    head = {NO_END: "RUNNING, or its driver was lost (no end recorded)"}.get(status.state,
                                                                           status.state)
    if status.last_event is None:
        head = "RUNNING, or its driver was lost (no event yet: it is starting, or it was " \
               "lost before its first event)"
    rows: list[tuple[str, str]] = []
    if status.reason:
        said = status.reason.strip().splitlines() or [""]
        rows.append(("reason:", f"{said[0]}{' ... ' + said[-1] if len(said) > 1 else ''}"))
    if status.step is not None:
        of = f" of {status.steps_total}" if status.steps_total is not None else ""
        rows.append(("step:", f"{status.step}{of}"))
    if status.last_event is not None:
        rows.append(("last event:", _when(status.last_event, now)))
    ck = status.checkpoints
    if ck.problem:
        rows.append(("checkpoint:", f"unknown: {ck.problem}"))
    elif ck.newest is not None:
        unsigned = f" (accepted although {ck.unsigned})" if ck.unsigned else ""
        rows.append(("checkpoint:", f"step {ck.newest}, verified{unsigned}: {ck.newest_path}"))
    else:
        rows.append(("checkpoint:", f"{'none verifies' if ck.skipped else 'none committed'} "
                                    f"under {ck.url}"))
    lines = [f"run {run_dir}: {head}", key_values(rows, **LAYOUT)]
    for step, why in ck.skipped:
        lines.append(f"  not verified (never loaded): step {step}: {why}")
    if status.state != "FINISHED":
        lines.append(key_values([("continue:", _continue(run_dir, status, flags=flags))],
                                **LAYOUT))
    return "\n".join(lines)


# The status's names and values, indented under its first line; the continue line, after the
# checkpoints that do not verify, lines up with them.
LAYOUT: dict[str, int] = {"indent": 2, "gap": 1, "key_width": len("last event:")}


def _continue(run_dir: str, status: RunStatus, *, flags: Sequence[str]) -> str:
    ck = status.checkpoints
    if not status.has_config:
        return "not possible: the run dir holds no config.toml"
    if ck.newest is None and ck.skipped:
        return "no checkpoint verifies (above); nothing to continue from"
    rollback = ck.newest is not None and ck.recorded is not None and ck.newest < ck.recorded
    command = continue_command(run_dir, flags=[*flags, *(["--allow-rollback"] if rollback
                                                         else [])])
    if rollback:
        command += (f"  (loses steps {ck.newest + 1}-{ck.recorded}: step {ck.recorded} was "
                    f"committed and no longer verifies)")
    if status.state == NO_END:
        command = f"if its driver is gone: {command}"
    if ck.newest is None and not ck.problem:
        command += "  (no checkpoint yet: from step 0)"
    return command


def _when(t: float, now: float) -> str:
    stamp = datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")
    ago = max(0.0, now - t)
    if ago < 120:
        span = f"{ago:.0f} s"
    elif ago < 7200:
        span = f"{ago / 60:.0f} min"
    elif ago < 172800:
        span = f"{ago / 3600:.0f} h"
    else:
        span = f"{ago / 86400:.0f} days"
    return f"{stamp} ({span} ago)"


def exit_code(status: RunStatus) -> int:
    if status.state == "FINISHED":
        return EXIT_FINISHED
    if status.state == NO_END:
        return EXIT_NO_END
    if status.state in ("STOPPED", "FAILED", "INTERRUPTED"):
        return EXIT_ENDED_EARLY
    raise ValueError(f"unexpected run state {status.state!r}")


def run_status(run_dir: str, *, trust_unsigned: bool = False, key_file: str | None = None,
               trusted_key_files: tuple[str, ...] = ()) -> int:
    """Print the status of `run_dir` (checked by is_run_dir_arg); return the exit code."""
    status = read_status(Path(run_dir), trust_unsigned=trust_unsigned, key_file=key_file,
                         trusted_key_files=trusted_key_files)
    print(describe(run_dir, status, flags=trust_flags(trust_unsigned, key_file,
                                                      trusted_key_files)))
    return exit_code(status)
