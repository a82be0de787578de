"""The run directory: the files a run leaves for its user (an interface; see docs/run-directory.md).

    config.toml     the resolved JobConfig (defaults filled in, overrides applied)
    events.jsonl    one JSON object per line: {"time", "kind", ...fields}
    run_id          the run's id (a uuid), kept by --resume; its storage's owner.json names it
    metrics.jsonl   one row per logged step: step, loss, lr, tokens_per_s, world_size, time,
                    window_s, ...
    checkpoints/    storage checkpoints, unless checkpoint.storage points elsewhere

A run directory that already holds checkpoints is never reused without --resume (or
--auto-resume, which continues only the same run), so no run can overwrite another's work.
No write here follows a symbolic link (stalwart/core/safe_files.py): whole files replace a
link at their name, the logs refuse one.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from stalwart.checkpointing.storage.catalog import list_step_dirs
from stalwart.core import events as ev
from stalwart.core.config import JobConfig, dump_config
from stalwart.core.errors import RunDirError
from stalwart.core.run_logs import EventLog, MetricsLog
from stalwart.core.safe_files import write_file_atomically

if TYPE_CHECKING:
    from stalwart.checkpointing.storage.owner import Owner

__all__ = ["RunDir"]

# The directories a run writes files into (run.profile_steps, run.tensorboard, the W&B
# logger, MLflow's default store): a link at one is refused, whether or not this run
# writes there.
FILE_DIRS = ("profile", "tensorboard", "wandb", "mlruns")


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.config_file = path / "config.toml"
        self.events = EventLog(path / "events.jsonl")
        self.metrics = MetricsLog(path / "metrics.jsonl")
        self.run_id_file = path / "run_id"

    @staticmethod
    def default_path(config: JobConfig) -> Path:
        return Path("runs") / f"{config.run.name}-{datetime.now():%Y%m%d-%H%M%S}"

    def storage_url(self, config: JobConfig) -> str:
        return config.checkpoint.storage or self.own_storage()

    def own_storage(self) -> str:
        """Where checkpoints go unless checkpoint.storage says otherwise."""
        return str((self.path / "checkpoints").resolve())

    def check_owner(self, storage_url: str, me: Owner, owner: Owner | None) -> None:
        """Refuse storage that another run owns, in the words of what the user chose: the
        run dir (its own checkpoints/), or checkpoint.storage when that was set."""
        if owner is None or owner.run_id == me.run_id:
            return
        if storage_url != self.own_storage():
            raise RunDirError(
                f"checkpoint.storage {storage_url} belongs to another run (run dir "
                f"{_shown(owner.run_dir)}, task {owner.task}); one storage holds one run's "
                f"checkpoints: --resume that run, or choose another checkpoint.storage")
        if self.run_id_file.exists() and self.run_id_file.read_text().strip() == me.run_id:
            raise RunDirError(f"run dir {self.path}: its checkpoints belong to another run "
                              f"(run dir {_shown(owner.run_dir)}, task {owner.task}) than its "
                              f"run_id names; choose another --run-dir")
        if owner.run_dir != str(self.path.resolve()):
            raise RunDirError(f"run dir {self.path} holds the checkpoints of the run in run dir "
                              f"{_shown(owner.run_dir)} (task {owner.task}); continue that run "
                              f"with --resume --run-dir {_shown(owner.run_dir)}, or choose "
                              f"another --run-dir")
        if self.config_file.exists():
            self.check_new(storage_url)  # it holds a run: refused as any run dir that does
        raise RunDirError(f"run dir {self.path} holds another run's checkpoints (task "
                          f"{owner.task}) and no config.toml, so that run cannot be continued; "
                          f"choose another --run-dir")

    def check_new(self, storage_url: str) -> None:
        """Refuse to start a fresh run where one already left checkpoints."""
        steps = list_step_dirs(storage_url)
        if steps:
            raise RunDirError(f"{storage_url} already holds checkpoints (steps "
                              f"{[s for s, _ in steps][-3:]}); pass --resume to continue that "
                              f"run, or choose another --run-dir")
        if self.config_file.exists():
            raise RunDirError(f"run dir {self.path} already holds a run (config.toml); pass "
                              f"--resume to continue it, or choose another --run-dir")

    def auto_resume_mode(self, storage_url: str) -> Literal["new", "again", "resume"]:
        """What --auto-resume does here (reads only): "resume" when the run dir holds a run
        and its storage a committed checkpoint; "again" when the run dir holds a run that
        committed none yet (a retried job that died before its first commit: it starts
        again from step 0 in the same run dir); "new" when the run dir holds no run. Whether
        the run dir's run is this one (its identity keys) is the caller's check.

        Checkpoints with no run dir's config.toml beside them are refused: nothing tells
        whose they are."""
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"run dir {self.path} is a file, not a directory")
        steps = list_step_dirs(storage_url)
        if not self.config_file.exists():
            if steps:
                raise RunDirError(
                    f"--auto-resume: {storage_url} holds checkpoints (steps "
                    f"{[s for s, _ in steps][-3:]}) but run dir {self.path} holds no "
                    f"config.toml, so nothing says which run they are; choose another "
                    f"--run-dir{'' if storage_url == self.own_storage() else ' or checkpoint.storage'}")
            return "new"
        return "resume" if any(done for _, done in steps) else "again"

    def check_resumable(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"run dir {self.path} is a file, not a directory")
        if not self.path.is_dir():
            raise RunDirError(f"run dir {self.path} does not exist")
        if not self.config_file.exists():
            raise RunDirError(f"run dir {self.path} holds no config.toml, so no "
                              f"run to resume")

    def check_no_links(self) -> None:
        """Refuse, before the run starts, a symbolic link where the run would refuse one
        later: at its logs and at the directories it writes files into."""
        for name in (self.events.path.name, self.metrics.path.name, *FILE_DIRS):
            if (self.path / name).is_symlink():
                raise RunDirError(f"run dir {self.path}: {name} is a symbolic link; stalwart "
                                  f"never writes through one: remove it, or choose another "
                                  f"--run-dir")

    def write_config(self, config: JobConfig) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_file_atomically(self.config_file, dump_config(config))

    def write_run_id(self, run_id: str) -> None:
        write_file_atomically(self.run_id_file, run_id + "\n")

    def newest_recorded_commit(self) -> int | None:
        """The newest step the events record as committed on the run's current timeline: a
        resume starts the timeline again at its step (one allowed to roll back leaves the
        newer commits behind), and commits go on from there. Reads only."""
        if not self.events.path.exists():
            return None
        newest = None
        for e in ev.read_jsonl(self.events.path):
            if e.get("kind") == ev.Resumed.kind and isinstance(e.get("from_step"), int):
                newest = e["from_step"]
            elif e.get("kind") == ev.CheckpointCommitted.kind and isinstance(e.get("step"), int):
                newest = e["step"] if newest is None else max(newest, e["step"])
        return newest


def _shown(path: str) -> str:
    """A path as short as it reads: relative to the working directory when under it."""
    try:
        return str(Path(path).relative_to(Path.cwd()))
    except ValueError:
        return path
