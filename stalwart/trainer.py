"""Trainer: the public entry point. Checks every input, prepares the run directory, connects to
Ray (embedded or a cluster), and hands the run to the controller.

Everything that can be wrong with the input is checked here, before a single worker starts:
the config, the task path, the storage URL, the run directory and what it holds, and the
task's own code, tried on a batch of two samples (stalwart/task_check.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import os
import pickle
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stalwart.callbacks import Callback
from stalwart.checkpointing.errors import CheckpointError, StorageURLError
from stalwart.checkpointing.storage.catalog import (
    CheckpointInfo,
    committed_checkpoints,
    newest_valid,
    read_step_dir,
    verify,
)
from stalwart.checkpointing.storage.layout import filesystem
from stalwart.checkpointing.storage.owner import Owner, claim, read_owner
from stalwart.checkpointing.storage.signing import CheckpointTrust, load_trust_keys
from stalwart.checkpointing.storage.transfer import copy_checkpoint
from stalwart.cluster import check_reachable, connect
from stalwart.core import events as ev
from stalwart.core.config import JobConfig, config_from_dict, flatten, load_config
from stalwart.core.errors import ClusterError, ConfigError, RunDirError
from stalwart.integrations.loggers import TrackerGuard, logger_callbacks
from stalwart.integrations.ray_metrics import RayMetrics
from stalwart.orchestrator.outcome import Outcome
from stalwart.parallel.dims import ParallelDims
from stalwart.places import absolute_storage, probe_run_dir, probe_storage
from stalwart.progress import ProgressDisplay
from stalwart.run_dir import RunDir

# The task contract and the controller load torch: Trainer.fit imports them once the run dir
# is checked, so that a wrong run dir fails in a fraction of a second.
if TYPE_CHECKING:
    from stalwart.core.task import TaskLike, TrainTask
    from stalwart.orchestrator.states import State

# What the run needs once its input is checked (up to a second of imports on the driver:
# torch's DCP and elastic packages, pyarrow's parquet), loaded while Ray starts
# (imported_meanwhile).
RUN_MODULES = ("stalwart.orchestrator.controller", "stalwart.orchestrator.policies",
               "stalwart.orchestrator.worker_group")

# Keys that define what is being trained: changing them on --resume would silently mix two
# different runs (another model, another data order), so it is refused.
IDENTITY_KEYS = ("task.path", "task.args", "train.seed", "train.global_batch_size")


@dataclass(frozen=True)
class Checkpoint:
    """A committed storage checkpoint: its step and the URL of its step directory (what
    `start_from`, `stalwart export` and `--resume` read)."""

    step: int
    path: str


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    state: str
    """FINISHED, STOPPED (Ctrl-C or SIGTERM, last step checkpointed) or FAILED."""
    step: int
    loss: float | None
    val_loss: float | None
    wall_s: float
    tokens_per_s: float | None
    """All tokens trained in this invocation over the time the workers spent in steps."""
    reason: str | None = None
    stop_signal: int | None = None
    """STOPPED by a signal: which (SIGINT, SIGTERM); the CLI exits 128 + it."""
    checkpoint: Checkpoint | None = None
    """The newest committed checkpoint in the run's storage, if any."""
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The last metrics row (as in metrics.jsonl), with the last validation's `val_` columns."""


def config_changes(old: JobConfig, new: JobConfig) -> dict[str, list[Any]]:
    a = flatten(old.to_dict(), keep=("task.args",))
    b = flatten(new.to_dict(), keep=("task.args",))
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


class Trainer:
    """One stalwart run.

    `start_from`: URL of a committed checkpoint's step directory (another run's, or one that
    Ray Tune holds for a trial): a new run starts from its model, optimizer, schedule, step
    and data position. It is copied into the run's own storage first, so workers only ever
    read the run's storage. The config's hyperparameters (`train.lr`, `train.weight_decay`)
    apply from there on. `workdir`: where the task's modules are imported from (default: the
    current directory), on the driver and on every worker. `callbacks` see every metrics row
    and event as it is written (see stalwart.callbacks). `trust_unsigned`: also accept
    checkpoints that are not signed with this run's key (see docs/security.md). `key_file`:
    the key that signs and verifies (default: $STALWART_CHECKPOINT_KEY_FILE, else
    ~/.config/stalwart/checkpoint.key); `trusted_key_files`: previous keys that still verify.
    `allow_rollback`: resume even from a checkpoint older than the newest the run dir
    recorded as committed (refused by default: the steps between would be lost silently).

    `config`: a JobConfig, a TOML file's path, a dict of its tables, or None for the
    defaults. `task`: a TrainTask subclass (constructed with task.args) or instance, used
    instead of task.path; one defined in a script or a notebook reaches the workers by value.
    """

    def __init__(self, config: JobConfig | str | Path | dict[str, Any] | None = None, *,
                 task: TaskLike | None = None, run_dir: str | Path | None = None,
                 address: str | None = None, resume: bool = False,
                 live_progress: bool | None = None, start_from: str | None = None,
                 workdir: str | Path | None = None, callbacks: Sequence[Callback] = (),
                 trust_unsigned: bool = False, key_file: str | Path | None = None,
                 trusted_key_files: Sequence[str | Path] = (), allow_rollback: bool = False
                 ) -> None:
        config = as_job_config(config)
        if task is not None:  # recorded by name in config.toml, manifests and events
            from stalwart.core.task import task_path_of

            config = dataclasses.replace(config, task=dataclasses.replace(
                config.task, path=task_path_of(task)))
        self.task = task
        # A relative storage path means the driver's directory; workers elsewhere would read
        # it against their own. config.toml records the absolute path.
        storage = absolute_storage(config.checkpoint.storage)
        if storage != config.checkpoint.storage:
            config = dataclasses.replace(config, checkpoint=dataclasses.replace(
                config.checkpoint, storage=storage))
        self.config = config
        self.run_dir = RunDir(Path(run_dir) if run_dir else RunDir.default_path(config))
        self.address = address
        self.resume = resume
        # run.auto_resume (--auto-resume): --resume, which is strict, wins over it.
        self.auto_resume = config.run.auto_resume and not resume
        self._auto_mode: str | None = None  # what auto-resume found (RunDir.auto_resume_mode)
        self.live_progress = live_progress
        self.start_from = start_from
        self.trust_unsigned = trust_unsigned
        self.key_file, self.trusted_key_files = key_file, tuple(trusted_key_files)
        self.allow_rollback = allow_rollback
        self.workdir = str(Path(workdir).resolve()) if workdir else os.getcwd()
        # run.loggers: each tracker is one more callback (a missing package or key fails
        # here); a tracker's error at run time is a warning in the run dir's events.
        self.callbacks = [*callbacks, *logger_callbacks(config, self.run_dir)]

        self._last_metrics = LastMetrics()

    # ------------------------------------------------------------------ checks

    def _check_storage(self, url: str) -> None:
        """Refuse a URL no worker could use; creates nothing (that waits for every check)."""
        if url.startswith("memory://"):
            raise StorageURLError(
                f"checkpoint.storage {url!r}: memory:// lives inside one process, and "
                f"stalwart's workers are separate processes; use a path or a shared "
                f"filesystem URL (file://, s3://, gs://, ...)")
        filesystem(url)

    def _make_storage(self, url: str) -> None:
        fs, path = filesystem(url)
        try:
            fs.makedirs(path, exist_ok=True)
        except Exception as exc:  # any filesystem's own error type (permissions, auth, ...)
            raise StorageURLError(f"checkpoint.storage {url!r} is not writable: "
                                  f"{type(exc).__name__}: {exc}") from exc

    def _check_run_dir(self, storage_url: str, trust: CheckpointTrust
                       ) -> tuple[CheckpointInfo | None, dict[str, Any], list[str]]:
        """(checkpoint to resume from, config changes, damaged checkpoints skipped); reads only.

        run.auto_resume (unless --resume, which is strict): resume when the run dir holds
        this run and a committed checkpoint of it; start when it holds no run; start again
        from step 0, keeping its run id and logs, when it holds this run with no checkpoint
        committed yet; refuse another run's."""
        rd = self.run_dir
        mode = self._auto_mode = rd.auto_resume_mode(storage_url) if self.auto_resume else None
        if not self.resume and mode in (None, "new"):
            rd.check_new(storage_url)
            if mode == "new":
                _say(f"auto-resume: {rd.path} holds no run yet; starting a new one")
            return None, {}, []
        flag = "--resume" if self.resume else "--auto-resume"
        rd.check_resumable()
        changes = self._check_same_run(flag)
        if mode == "again":
            _refuse_lost_commits(rd, storage_url)
            _say(f"auto-resume: {rd.path} holds this run but no committed checkpoint yet; "
                 f"starting it again from step 0 (its run id and logs are kept)")
            return None, {}, []
        skipped: list[str] = []
        checkpoint = newest_valid(storage_url, trust, on_skip=lambda s, m: skipped.append(m))
        if checkpoint is None and skipped:
            raise RunDirError(f"{flag}: checkpoints were committed under {storage_url} but "
                              f"none verifies (skipped: {'; '.join(skipped)}); nothing to "
                              f"resume from")
        if checkpoint is None:
            raise RunDirError(f"{flag}: no committed checkpoint under {storage_url}; "
                              f"nothing to resume from")
        if not self.allow_rollback:
            _refuse_rollback(rd, flag, checkpoint, skipped)
        if mode == "resume":
            _say(f"auto-resume: continuing {rd.path} from its checkpoint at step "
                 f"{checkpoint.step}")
        return checkpoint, changes, skipped

    def _check_same_run(self, flag: str) -> dict[str, Any]:
        """The config changes since the run dir's config.toml; refused if an identity key
        changed (another model or data order: another run)."""
        rd = self.run_dir
        changes = config_changes(load_config(rd.config_file), self.config)
        identity = [k for k in changes if any(k == i or k.startswith(i + ".")
                                              for i in IDENTITY_KEYS)]
        if not identity:
            return changes
        k = identity[0]
        was = f"{k} was {changes[k][0]!r} in {rd.config_file} and is {changes[k][1]!r} now"
        keys = f"unchangeable: {', '.join(IDENTITY_KEYS)}"
        if flag == "--auto-resume":
            raise RunDirError(f"--auto-resume: run dir {rd.path} holds another run ({was}; "
                              f"{keys}); choose another --run-dir")
        raise ConfigError(f"--resume: {was}; a resumed run must train the same model on the "
                          f"same data order ({keys})")

    def _check_start_from(self, trust: CheckpointTrust) -> CheckpointInfo | None:
        """The checkpoint a new run starts from, read and verified (nothing copied yet): it
        may come from any run signed with this key."""
        if self.start_from is None:
            return None
        if self.resume:
            raise RunDirError("start_from and resume exclude each other: resume continues the "
                              "run dir's own checkpoints")
        if self._auto_mode == "resume":
            # A retried run that began from start_from: it goes on from its own newest
            # checkpoint (start_from's copy was its first).
            _say(f"auto-resume: start_from {self.start_from} is not used; the run continues "
                 f"from its own checkpoint")
            return None
        return verify(read_step_dir(self.start_from), trust.for_any_run())

    def _trust(self) -> CheckpointTrust:
        """The key this run signs with and what it loads: its own checkpoints, by run id.

        A run's id is a uuid in its run dir (`run_id`), kept by --resume and by
        --auto-resume of a run dir that holds a run. A run dir from before run ids gets one
        now."""
        run_id = None
        keeps = self.resume or (self.auto_resume and self.run_dir.config_file.exists())
        if keeps and self.run_dir.run_id_file.exists():
            run_id = self.run_dir.run_id_file.read_text().strip() or None
        key, previous = load_trust_keys(self.key_file, self.trusted_key_files)
        return CheckpointTrust(key=key, previous=previous, accept_unsigned=self.trust_unsigned,
                               run_id=run_id or uuid.uuid4().hex)

    def _check_owner(self, storage_url: str, run_id: str) -> Owner:
        """This run as the storage's owner; refuses storage another run owns. Reads only."""
        me = Owner(run_id=run_id, task=self.config.task.path,
                   run_dir=str(self.run_dir.path.resolve()))
        self.run_dir.check_owner(storage_url, me, read_owner(storage_url))
        return me

    def _claim_storage(self, storage_url: str, me: Owner) -> None:
        """Record this run in its run dir and as the storage's owner, before any worker."""
        if not self.run_dir.run_id_file.exists():
            self.run_dir.write_run_id(me.run_id)
        self.run_dir.check_owner(storage_url, me, claim(storage_url, me))

    def _check_task(self, task: TrainTask) -> None:
        """Try the task's model, a batch and its loss on the driver (task.check): a bug in
        its code fails here in seconds, with its traceback, before Ray or any worker starts."""
        from stalwart.core.task import TrainTask
        from stalwart.task_check import check_task

        if isinstance(self.task, TrainTask):
            # A handed-over instance is shipped to the workers as it is: try a copy, so
            # nothing the check leaves on it (a counter, a cached dataset) goes along.
            import cloudpickle

            task = pickle.loads(cloudpickle.dumps(task))
        note = check_task(task, self.config, where="local" if self._ray_here() else "cluster")
        if note is not None:
            _say(note)

    def _ray_here(self) -> bool:
        """Whether the run's workers are on this machine: its own Ray, started by this run."""
        if self.address is not None:
            return False
        return not ("ray" in sys.modules and sys.modules["ray"].is_initialized())

    # ------------------------------------------------------------------ Ray

    def _connect(self) -> bool:
        """Join or start Ray; returns whether we started it."""
        return connect(self.address, num_cpus=self._embedded_cpus(),
                       dashboard=self.config.run.dashboard)

    def _import_paths(self) -> list[str]:
        """Where workers find the task's modules: next to the user, as the driver does (a
        cluster of other machines ships code with `stalwart submit`). Handed to each worker
        rather than set in a runtime_env, which would make Ray start every worker through a
        second Python (its setup_worker) and bar it from Ray's idle, pre-started workers."""
        return [self.workdir, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]

    def _embedded_cpus(self) -> int:
        """The Ray on this machine has its cores, plus room for the warm spares.

        A spare idles until it replaces a worker, so it costs no compute; giving it logical
        CPUs of its own lets it start ahead instead of waiting for a worker to die.
        """
        sc = self.config.scaling
        spares = math.ceil(sc.spare_workers * sc.cpus_per_worker)
        return max(1, os.cpu_count() or 1) + spares

    def _settle_previous_driver(self, run_id: str) -> bool:
        """On a cluster: refuse a run whose driver runs elsewhere; let a killed driver's
        workers finish committing first (True: the newest checkpoint may be new)."""
        from stalwart.orchestrator.driver_loss import settle_previous_driver

        # The workers' own bound on their stop (workers/worker.py), and a little to exit.
        return settle_previous_driver(run_id, wait_s=self.config.failure.stop_timeout_s + 10,
                                      log=lambda m: _say(f"stalwart: {m}"))

    def _check_resources(self) -> None:
        import ray

        sc = self.config.scaling
        # The fewest workers the run may train on must fit; more come when there is room.
        need_cpu = sc.floor * sc.cpus_per_worker
        need_gpu = sc.floor * sc.gpus_per_worker
        have = ray.cluster_resources()
        if need_cpu > have.get("CPU", 0) or need_gpu > have.get("GPU", 0):
            which = (f"scaling.min_workers={sc.min_workers}" if sc.min_workers else
                     f"scaling.num_workers={sc.num_workers}")
            raise ClusterError(
                f"{which} x (cpus_per_worker={sc.cpus_per_worker}, "
                f"gpus_per_worker={sc.gpus_per_worker}) needs {need_cpu:g} CPUs and "
                f"{need_gpu:g} GPUs; the Ray cluster has {have.get('CPU', 0):g} CPUs and "
                f"{have.get('GPU', 0):g} GPUs (lower scaling.num_workers, scaling.min_workers or "
                f"scaling.cpus_per_worker)")

    # ------------------------------------------------------------------ run

    def fit(self) -> RunResult:
        # Every check first, keeping nothing written (the write probes remove what they
        # make): a refused run leaves the run dir and the storage as they were.
        # The run dir's own checks come before the task, which loads torch (seconds).
        probe_run_dir(self.run_dir.path)
        self.run_dir.check_no_links()
        if self.resume:
            self.run_dir.check_resumable()
        # The task before the storage: its module may register the filesystem the URL names.
        from stalwart.core.task import resolve_task
        from stalwart.data.changes import check_data_files

        task = resolve_task(self.config.task.path, self.config.task.args, self.task)
        task.check_layout(ParallelDims.from_config(self.config.parallel,
                                                   self.config.scaling.num_workers))
        if self.address is None:  # this machine's Ray: its memory is the workers'
            from stalwart.plan.preflight import check_run_memory

            check_run_memory(task, self.config)  # plan's estimate; the model on meta
        storage_url = self.run_dir.storage_url(self.config)
        self._check_storage(storage_url)
        trust = self._trust()
        probe_storage(storage_url)  # first: owner.json is read only where it can be
        owner = self._check_owner(storage_url, trust.run_id)  # before its checkpoints are read
        resume_from, changes, skipped = self._check_run_dir(storage_url, trust)
        origin = self._check_start_from(trust)
        for checkpoint in (resume_from, origin):  # a base model changed since, for one
            if checkpoint is not None:
                task.check_checkpoint(checkpoint.manifest, self.config)
        data_changes = [] if resume_from is None else check_data_files(
            resume_from.manifest, accept=self.config.data.accept_changed_files)
        if self.address is not None:  # in a second, before the task check's seconds
            check_reachable(self.address)
        self._check_task(task)  # last: it runs the task's code (seconds, not a fraction)
        del task  # the driver keeps nothing the check loaded on it (a dataset) for the run
        # The run's own modules load while Ray starts, which mostly waits for its daemons:
        # after every check, so that bad input is refused without them.
        with imported_meanwhile(RUN_MODULES):
            started_ray = self._connect()
        from stalwart.orchestrator.controller import Controller
        from stalwart.orchestrator.policies import default_policies
        from stalwart.orchestrator.worker_group import ElasticGroup, GroupFailed

        display = None
        try:
            if self.address is not None and self._settle_previous_driver(trust.run_id):
                resume_from, changes, skipped = self._check_run_dir(storage_url, trust)
            self._check_resources()
            self._make_storage(storage_url)
            # Needs Ray; guarded like the trackers: metrics that fail never end the run.
            self.callbacks.append(TrackerGuard(RayMetrics(run=self.run_dir.path.name),
                                               self.run_dir.events))
            self.run_dir.metrics.listeners.append(self._last_metrics.on_metrics)
            for cb in self.callbacks:
                self.run_dir.metrics.listeners.append(cb.on_metrics)
                self.run_dir.events.listeners.append(cb.on_event)
            self.run_dir.write_config(self.config)
            self._claim_storage(storage_url, owner)
            for message in skipped:
                self.run_dir.events.emit(ev.CheckpointSkipped(message=message))
            if data_changes:  # accepted: data.accept_changed_files
                self.run_dir.events.emit(ev.DataFilesChanged(changes=data_changes))
            if resume_from is not None:
                self._note_unsigned(resume_from)
                self.run_dir.events.emit(ev.Resumed(from_step=resume_from.step,
                                         path=resume_from.path, config_changes=changes))
            if origin is not None:
                self._note_unsigned(origin)
                resume_from = copy_checkpoint(origin, storage_url,
                                              adopt=(trust.key, owner.run_id))
                self.run_dir.events.emit(ev.StartedFrom(from_step=origin.step,
                                         origin=origin.path, path=resume_from.path))
            t0 = time.time()
            display = ProgressDisplay(
                total_steps=self.config.train.steps,
                start_step=resume_from.step if resume_from else 0,
                log_every=self.config.run.log_every,
                live=self.live_progress if self.config.run.progress else False)
            controller = Controller(
                self.config, storage_url=storage_url,
                group=ElasticGroup(self.config, storage_url, import_paths=self._import_paths(),
                                   trust=trust, outlive_driver=self.address is not None,
                                   task=self.task),
                group_error=GroupFailed, trust=trust, events=self.run_dir.events,
                metrics=self.run_dir.metrics, display=display, resume_from=resume_from,
                policies=default_policies(self.config, storage_url=storage_url))
            try:
                final = controller.run()
            except BaseException as exc:  # a second Ctrl-C; Tune stopping a trial; a callback
                self.run_dir.events.emit(ev.Interrupted(step=controller.outcome().step,
                                         reason=f"{type(exc).__name__}: {exc}".rstrip(": ")))
                raise
        finally:
            if display is not None:
                display.close()
            if started_ray:
                import ray

                ray.shutdown()
        result = self._result(final, controller.outcome(), time.time() - t0, storage_url)
        for cb in self.callbacks:
            cb.on_end(result)
        return result

    def _note_unsigned(self, checkpoint: CheckpointInfo) -> None:
        if checkpoint.unsigned:
            self.run_dir.events.emit(ev.UnsignedCheckpointAccepted(
                step=checkpoint.step, path=checkpoint.path, why=checkpoint.unsigned))

    def _result(self, final: State, outcome: Outcome, wall_s: float,
                storage_url: str) -> RunResult:
        from stalwart.orchestrator.states import Failed, Finished, Stopped

        reason = None
        if isinstance(final, Failed):
            reason = final.reason
            self.run_dir.events.emit(ev.Failed(reason=final.reason, step=outcome.step))
        elif not isinstance(final, Finished | Stopped):
            raise ValueError(f"unexpected final state {final!r}")
        return RunResult(run_dir=self.run_dir.path, state=final.name, step=outcome.step,
                         loss=outcome.loss, val_loss=outcome.val_loss, wall_s=wall_s,
                         reason=reason, stop_signal=outcome.stop_signal,
                         tokens_per_s=outcome.tokens_per_s,
                         checkpoint=_newest_committed(storage_url),
                         metrics=self._last_metrics.row)


class LastMetrics:
    """The newest metrics row, with the last validation's `val_` columns (RunResult.metrics)."""

    def __init__(self) -> None:
        self.row: dict[str, Any] = {}
        self._validation: dict[str, Any] = {}

    def on_metrics(self, row: ev.MetricsRow) -> None:
        columns = row.to_row()
        self._validation.update({k: v for k, v in columns.items() if k.startswith("val_")})
        self.row = {**self._validation, **columns}


def as_job_config(config: JobConfig | str | Path | dict[str, Any] | None) -> JobConfig:
    """The Trainer's `config` as a JobConfig: a TOML file read, a dict of tables checked as the
    file's would be, None the defaults."""
    if isinstance(config, JobConfig):
        return config
    if config is None or isinstance(config, str | Path):
        return load_config(config)
    if isinstance(config, dict):
        return config_from_dict(config)
    raise ConfigError(f"Trainer config must be a JobConfig, a TOML file's path, a dict of its "
                      f"tables or None; got {type(config).__name__}")


def _newest_committed(storage_url: str) -> Checkpoint | None:
    try:
        committed = committed_checkpoints(storage_url)
    except (CheckpointError, OSError):  # the run's storage went away: nothing to point at
        return None
    return Checkpoint(step=committed[-1].step, path=committed[-1].path) if committed else None


@contextlib.contextmanager
def imported_meanwhile(modules: Sequence[str]) -> Iterator[None]:
    """Import `modules` on a thread while the block runs (the block waits, mostly: the
    imports take its idle time); done when the block ends. A module that fails to import
    raises its error where the caller imports it itself."""
    importlib.import_module("ray")  # here first: Ray's start imports more of it meanwhile

    def load() -> None:
        for name in modules:
            with contextlib.suppress(Exception):  # raised again by the caller's own import
                importlib.import_module(name)

    thread = threading.Thread(target=load, name="stalwart-imports", daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join()


def _say(message: str) -> None:
    """A line for the user before the run's display exists (what auto-resume decided)."""
    print(message, flush=True)


def _refuse_lost_commits(rd: RunDir, storage_url: str) -> None:
    """A run dir whose events record committed checkpoints that its storage no longer holds
    is not started again: that would silently throw their work away."""
    newest = rd.newest_recorded_commit()
    if newest is not None:
        raise RunDirError(f"--auto-resume: {rd.events.path} records committed checkpoints "
                          f"(newest step {newest}) but {storage_url} holds none; "
                          f"nothing to resume from, and starting again would discard them "
                          f"(restore the checkpoints, or choose another --run-dir)")


def _refuse_rollback(rd: RunDir, flag: str, checkpoint: CheckpointInfo,
                     skipped: list[str]) -> None:
    """Resuming from a checkpoint older than the newest the run dir recorded as committed
    would silently lose the steps between (the newer ones deleted or damaged in storage)."""
    newest = rd.newest_recorded_commit()
    if newest is None or checkpoint.step >= newest:
        return
    why = f" (skipped: {'; '.join(skipped)})" if skipped else " (it is no longer there)"
    raise RunDirError(f"{flag}: {rd.events.path} records step {newest} as committed, but the "
                      f"newest checkpoint that verifies is step {checkpoint.step}{why}; "
                      f"resuming would lose steps {checkpoint.step + 1}-{newest}. Restore "
                      f"step {newest}, or pass --allow-rollback to resume from step "
                      f"{checkpoint.step}")
