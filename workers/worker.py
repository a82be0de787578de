"""Worker: what one rank's process does. The loop runs on a thread; the actor keeps answering.

One worker lives through many generations of the world. The controller drives it through
warm_up (once: import and load the task, prepare the data) and then, per generation,
setup -> restore -> start, polling it meanwhile; a poll drains the step reports (the
heartbeat), checkpoint commits and injected faults gathered since the last one. After a
failure or a resize, a surviving worker leaves its process group and joins the next one with
its process, imports, task and data intact: no restart and no re-import.
Because training runs on its own thread, the actor answers polls and stop requests even in
the middle of a long step or a stuck collective. The Ray actor is the shell in
workers/actor.py, which builds a Worker in its process.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from stalwart.checkpointing.memory.store import Inventory
from stalwart.checkpointing.memory.tier import MemoryTier, StateAccess
from stalwart.checkpointing.snapshot import ShardLayout
from stalwart.checkpointing.snapshot_schedule import snapshot_schedule
from stalwart.checkpointing.storage.retention import BestRule
from stalwart.checkpointing.storage.signing import CheckpointTrust
from stalwart.checkpointing.storage.writer import StorageCheckpointer
from stalwart.core.config import FaultSpec, JobConfig, config_from_dict
from stalwart.core.errors import DataUnavailable
from stalwart.core.events import WorkerPlace
from stalwart.core.ray_private import actor_name_log_marker
from stalwart.core.task import TaskLike, TrainTask, resolve_task, shipped_task
from stalwart.core.task_errors import (
    PREPARE,
    TaskCodeError,
    frames_of,
    infer_phase,
    task_failure,
    task_phase,
)
from stalwart.parallel.data_parallel import unwrapped
from stalwart.parallel.distributed import (
    RendezvousAddress,
    RendezvousHost,
    abort_process_groups,
    destroy_process_group,
    forget_dtensor_caches,
    init_process_group,
    pick_device,
    shorten_timeouts,
)
from stalwart.parallel.nccl import drain_device, summarise_flight_record, take_flight_record
from stalwart.parallel.world_sockets import cut, tcp_connections
from stalwart.workers.driver_watch import DriverWatch, end_this_actor
from stalwart.workers.engine import TrainEngine
from stalwart.workers.errors import classify_exception
from stalwart.workers.faults import FaultInjector
from stalwart.workers.heap import freeze_imports
from stalwart.workers.model_warm_up import warm_model
from stalwart.workers.node_agent import mark_failed
from stalwart.workers.numerics import NumericsEscalation, NumericsRollback
from stalwart.workers.profiling import StepProfiler, init_profiler_here
from stalwart.workers.reports import (
    CommitReport,
    LeaveReport,
    MemoryRestoreReport,
    ProfileReport,
    StepReport,
    WorkerStatus,
)


def announce_name(name: str) -> None:
    """Make the worker's log lines on the driver carry `name` as their prefix from now on.

    Ray's log monitor takes the prefix of a worker's lines from the last `:actor_name:` line
    in each of its output files (Ray prints one itself, with the actor's repr, when the actor
    is created), and never shows that line. The marker is a private Ray constant: if it moves,
    the prefix stays the creation-time name.
    """
    import ray

    marker = actor_name_log_marker()
    if marker is None:
        return
    if not ray.is_initialized():  # constructed outside a Ray worker (tests): no log monitor
        return
    for stream in (sys.stdout, sys.stderr):
        print(f"{marker}{name}", file=stream, flush=True)


def keep_best_rule(config: JobConfig) -> BestRule | None:
    ck = config.checkpoint
    return BestRule(ck.keep_best, ck.best_metric, ck.best_mode) if ck.keep_best else None


def step_metrics(report: StepReport) -> dict[str, float]:
    """What a checkpoint's manifest records of its step: the loss, the validation loss on a
    validation step, and the task's metrics (what checkpoint.keep_best ranks by)."""
    val = {} if report.val_loss is None else {"val_loss": report.val_loss}
    return {"loss": report.loss, **val, **report.metrics}


class Worker:
    def __init__(self, config: dict[str, Any], storage_url: str, number: int = 0, *,
                 driver_beacon: Any = None, task: TaskLike | bytes | None = None,
                 import_paths: Sequence[str] = ()) -> None:
        """`driver_beacon`: the driver's DriverBeacon when this worker is detached and must
        outlive a killed driver (workers/driver_watch.py); None when it dies with it.
        `task`: the task class or instance handed to the Trainer, if it was not named by
        task.path; pickled (bytes) when the group ships it, loaded here once
        `import_paths` (where the driver finds the task's modules) are on sys.path."""
        self.config: JobConfig = config_from_dict(config)
        self.storage_url = storage_url
        # The checkpoint key, only while this worker is rank 0 (it commits for everyone);
        # from the driver, only ever in memory.
        self.trust: CheckpointTrust | None = None
        self.number = number  # the n-th actor of the run: names it while it has no rank
        # Never more compute threads than the CPUs Ray reserved for this actor.
        torch.set_num_threads(max(1, int(self.config.scaling.cpus_per_worker)))
        self.rank = -1
        self.generation = -1
        self.task: TrainTask | None = None
        self._supplied_task = shipped_task(task, import_paths)
        self._tied: list[list[str]] = []  # tied parameter names (warm_model), for exporters
        self.engine: TrainEngine | None = None
        self.checkpointer: StorageCheckpointer | None = None
        self._retiring: threading.Thread | None = None
        """Lets go of the last world's engine and checkpointer (leave)."""
        # The memory tier outlives the worlds this worker joins: after a failure it still
        # holds this worker's snapshots and its peers' replicas for the next world.
        self.tier = MemoryTier()
        self._tiered = False
        self._steps: deque[StepReport] = deque()
        # Step reports a poll has taken, kept until the world ends: the answer that carried
        # them may be dropped then (leave returns those after the controller's last step).
        self._sent: deque[StepReport] = deque(maxlen=256)
        self._commits: deque[CommitReport] = deque()
        # Commits a poll took, until the world ends: that answer may be dropped with it.
        self._sent_commits: deque[CommitReport] = deque(maxlen=256)
        self._profiles: deque[ProfileReport] = deque()
        # The faults armed in this world; it outlives the worlds (a `slow` fault lasts).
        self.faults = FaultInjector()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._done = False
        self._stopped_early = False
        self._error: str | None = None
        self._error_kind: str | None = None
        self._evict: tuple[int, ...] = ()
        self._busy: str | None = None
        self._preempted = False
        # The rendezvous this worker hosts for the next world, from rendezvous_address()
        # until it joins that world as rank 0 (the world holds the store from then on).
        self._rendezvous: RendezvousHost | None = None
        # The TCP connections this world's setup opened (parallel/world_sockets.py).
        self._world_connections: set[int] = set()
        # The flight recorder while the training thread completes no step (poll): since
        # when it is quiet, and the last summary with the time it was taken.
        self._world_ns = time.time_ns()
        self._quiet_since = time.monotonic()
        self._record: tuple[float, str | None] = (0.0, None)
        self._install_sigterm_handler()
        self._driver_watch = (DriverWatch(driver_beacon, self._on_driver_lost).start()
                              if driver_beacon is not None else None)

    def __repr__(self) -> str:
        """What Ray shows for this actor: in its log prefix, as the dashboard's Repr.

        `stalwart-worker-r<rank>-g<generation>` in a world, `stalwart-worker-spare-<n>` when
        warm and idle (a warm spare, or a survivor between worlds), `stalwart-worker-<n>`
        while starting. Ray reads it once, when __init__ returns (the dashboard's Repr and
        task names keep that one: `stalwart-worker-<n>`); announce_name() moves the log
        prefix along.
        """
        if self.rank >= 0:
            return f"stalwart-worker-r{self.rank}-g{self.generation}"
        if self.task is not None:
            return f"stalwart-worker-spare-{self.number}"
        return f"stalwart-worker-{self.number}"

    def _install_sigterm_handler(self) -> None:
        """SIGTERM is a preemption notice: tell the controller, which checkpoints and resizes
        without this worker. (Ray's default handler would exit at once and lose the steps.)"""
        def on_sigterm(signum: int, frame: Any) -> None:
            self._preempted = True

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, on_sigterm)

    def _on_driver_lost(self) -> None:
        """The driver died without stopping the run (on the watch's thread): stop after the
        step in flight as on a stop request, so that step is committed (rank 0 writes the
        manifest once every rank saved its shard), then end this actor: nobody else will."""
        print(f"stalwart: {self!r}: the driver is gone; checkpointing the step in flight, "
              f"then exiting", file=sys.stderr, flush=True)
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._stop.set()
            thread.join(self.config.failure.stop_timeout_s)  # as a stop is bounded
        if self.rank == 0 and self._commits:
            print(f"stalwart: committed step {self._commits[-1].step} for the next driver "
                  f"(--auto-resume continues from it)", file=sys.stderr, flush=True)
        end_this_actor()

    # ------------------------------------------------------------------ set-up

    def warm_up(self) -> WorkerPlace:
        """Once per actor: check its GPU if it has one (a failed check raises DeviceUnhealthy),
        import the task, prepare its data and build the model once (one training
        micro-step), so that joining a world costs only the process group and the restore.
        Warm spares stop here and wait."""
        if self.task is None:
            if self.config.scaling.gpus_per_worker > 0:  # a CPU worker checks nothing
                from stalwart.workers.device_health import check_device

                # First: a bad GPU is found in a second, not after the imports and the data.
                # Ray's CUDA_VISIBLE_DEVICES makes the actor's GPU index 0 (pick_device).
                # DeviceUnhealthy makes the group drop this worker: a node failure.
                health = check_device(torch.device("cuda", 0), node_ip=self.describe().node_ip)
                if health is not None:
                    print(f"stalwart: {self!r}: {health.summary()}", file=sys.stderr,
                          flush=True)
            task = resolve_task(self.config.task.path, self.config.task.args,
                                self._supplied_task)
            with task_phase(PREPARE):
                task.prepare_data(self.config)
            freeze_imports()  # before the warm model, which is garbage once it has run
            self._tied = warm_model(task, self.config)
            if self.config.run.profile_window is not None:
                init_profiler_here()  # on the actor's thread, not the training thread
            self.task = task
            announce_name(repr(self))  # warm: a spare until it joins a world
        return self.describe()

    def rendezvous_address(self) -> RendezvousAddress:
        """Called on the next rank 0 only: host the next world's store, listening on this
        node's address at a port the OS picked, and say where it is.

        The port is held from now until the world is left, so nothing else can take it.
        Asked again (a world that failed while it formed), the last rendezvous closes first.
        """
        import ray

        self._close_rendezvous()
        self._rendezvous = RendezvousHost(ray.util.get_node_ip_address() or None,
                                          timeout_s=self.config.failure.collective_timeout_s)
        return self._rendezvous.address

    def _close_rendezvous(self) -> None:
        if self._rendezvous is not None:
            self._rendezvous.close()
            self._rendezvous = None

    def describe(self) -> WorkerPlace:
        """Where this worker runs, for the event log, fault injection and tests that kill it."""
        import ray

        return WorkerPlace(rank=self.rank, pid=os.getpid(),
                           node_ip=ray.util.get_node_ip_address(),
                           node_id=ray.get_runtime_context().get_node_id())

    def setup(self, rank: int, world_size: int, rdzv: RendezvousAddress, generation: int,
              faults: Sequence[FaultSpec], nodes: list[str], *,
              signing: CheckpointTrust | None) -> None:
        """Join generation `generation`'s process group, then build the model and optimizer.

        `faults` are those this rank carries out in this world. `nodes` is each rank's node
        id: snapshots are replicated to ranks on other nodes. `signing`: the checkpoint key,
        for rank 0 only, which signs the commits; other ranks load with the file table the
        driver verified and need no key.
        """
        self.warm_up()
        assert self.task is not None
        self.rank, self.generation = rank, generation
        announce_name(repr(self))
        self._reset_run_state()
        self.faults.arm(rank, faults)
        self.trust = signing if rank == 0 else None  # a former rank 0 lets go of the key
        device = pick_device(self.config.scaling.gpus_per_worker > 0)
        host, self._rendezvous = self._rendezvous, None
        if rank != 0 and host is not None:
            host.close()  # hosted for a world that never formed; rank 0 hosts this one
            host = None
        # The last world's process groups (an NCCL communicator holds GPU memory) are gone
        # before this world's are made.
        self._retired()
        before = tcp_connections()
        init_process_group(rdzv, rank=rank, world_size=world_size, device=device,
                           timeout_s=self.config.failure.collective_timeout_s, host=host)
        forget_dtensor_caches()  # the last world's meshes must not come back (see there)
        self.engine = TrainEngine(self.config, self.task, rank=rank, world_size=world_size,
                                  device=device)
        self.checkpointer = StorageCheckpointer(
            self.storage_url, rank=rank, keep_last=self.config.checkpoint.keep_last,
            async_save=self.config.checkpoint.async_save,
            manifest_extra={"world_size": world_size, "task": self.config.task.path,
                            **({"tied": self._tied} if self._tied else {}),
                            **(self.task.checkpoint_identity(self.config) if rank == 0
                               else {}),
                            **(self.engine.data_identity() if rank == 0 else {})},
            trust=self.trust, keep_best=keep_best_rule(self.config),
            export_files=self.task.export_files(self.config) if rank == 0 else None)
        ck = self.config.checkpoint
        self._tiered = ck.memory_tier
        if self._tiered:
            self.tier.join(self._engine_view(), rank=rank, generation=generation, nodes=nodes,
                           replicas=ck.replicas, limit_gb=ck.memory_limit_gb,
                           replica_class=self.engine.replica_classes(),
                           keep=self.config.numerics.snapshots_kept,
                           schedule=snapshot_schedule(self.config, device))
        self._world_connections = tcp_connections() - before

    def _engine_view(self) -> StateAccess:
        assert self.engine is not None
        return self.engine.tier_view()

    def _reset_run_state(self) -> None:
        self._steps.clear()
        self._sent.clear()
        self._commits.clear()
        self._sent_commits.clear()
        self._profiles.clear()
        self._stop.clear()
        self._done = self._stopped_early = False
        self._error = self._error_kind = self._busy = None
        self._evict = ()
        self._thread = None
        self._world_ns = time.time_ns()
        self._record = (0.0, None)

    def restore(self, path: str, files: dict[str, Any]) -> int:
        """Load a committed checkpoint (resharded to this world); returns its step. `files`:
        its manifest's file table, verified by the driver; each file is checked against it
        as it is read."""
        assert self.engine is not None and self.checkpointer is not None
        state = self.engine.state_dict()
        self.checkpointer.load(path, files, state)
        self.engine.load_state_dict(state)
        return self.engine.step

    def restore_memory(self, generation: int, step: int, layouts: dict[int, ShardLayout],
                       sources: dict[int, Any]) -> MemoryRestoreReport:
        """Load step `step` of generation `generation` from the memory tier, resharded to
        this world. `sources` maps each source rank to an ObjectRef of its exported shard;
        only those this worker does not hold itself are fetched. Not collective."""
        import ray

        assert self.engine is not None
        fetched = self.tier.restore(self._engine_view(), generation=generation, step=step,
                                    layouts=layouts, fetch=lambda src: ray.get(sources[src]))
        return MemoryRestoreReport(step=self.engine.step, fetched=tuple(fetched))

    def memory_inventory(self) -> Inventory:
        return self.tier.inventory()

    def export_snapshot(self, generation: int, source: int, step: int
                        ) -> tuple[Any, Any, int | None]:
        return self.tier.export(generation, source, step)

    def forget_snapshots(self, before_generation: int) -> None:
        """Drop snapshots of generations older than this one (a newer world holds its own)."""
        self.tier.store.drop_before(before_generation)

    # ------------------------------------------------------------------ running

    def start(self, *, restored: bool = False) -> None:
        """Start the training loop. `restored`: this world restored a step (or starts afresh
        after an earlier world), which the loop first checks and stages (_take_restored)."""
        self._thread = threading.Thread(target=self._run, args=(restored,),
                                        name="stalwart-train", daemon=True)
        self._thread.start()

    def _take_restored(self) -> None:
        """Collective, on the training thread: every rank restored the same step, which is
        staged in this world and replicated while the first step runs (not before it: that
        would add the exchange to the recovery's critical path)."""
        assert self.engine is not None
        self.engine.check_restored_step()
        if self._tiered:
            self.tier.stage_restored(self.engine.step)

    def _run(self, restored: bool) -> None:
        engine, ckpt, cfg = self.engine, self.checkpointer, self.config
        assert engine is not None and ckpt is not None
        profiler = StepProfiler(cfg.run.profile_window, rank=self.rank,
                                generation=self.generation, device=engine.device)
        try:
            tier = self.tier if self._tiered else None
            ck = cfg.checkpoint
            if restored:
                self._take_restored()
            older_held = restored and tier is not None
            while engine.step < cfg.train.steps:
                self.faults.at_step(engine.step + 1)
                profiler.begin(engine.step + 1)
                try:
                    report, stop = engine.train_step(
                        stop_requested=self._stop.is_set() or self._preempted,
                        before_update=tier.wait_copy_done if tier else None,
                        before_summary=tier.wait_replicated if tier else None,
                        after_local_work=self.faults.after_local_work, hooks=self.faults)
                except NumericsRollback as rollback:
                    self._roll_back(rollback)
                    continue
                if older_held:  # past the all-reduce: the restored step is on its holders
                    tier.drop_older()
                    older_held = False
                step = engine.step
                last = step == cfg.train.steps
                persist = step % ck.persist_every == 0 or last or stop
                shard = None
                if tier is not None and (tier.due(step, report.step_time_s) or persist):
                    shard = tier.snapshot(step, hooks=self.faults)
                if cfg.data.val_every and (step % cfg.data.val_every == 0 or last):
                    self._busy = "validating"
                    validation = engine.validate()
                    if validation is not None:
                        val_loss, val_metrics = validation
                        report = replace(report, val_loss=val_loss,
                                         metrics={**report.metrics, **val_metrics})
                    samples = self.task.validation_samples(engine.model)  # every rank
                    if samples and self.rank == 0:
                        report = replace(report, samples=samples)
                self._steps.append(report)
                if persist:  # from the staged snapshot when there is one
                    self._busy = "saving a checkpoint"  # waits for the save before it
                    metrics = step_metrics(report)
                    self._commits.extend(ckpt.save_snapshot(shard, metrics) if shard is not None
                                         else ckpt.save(step, engine.state_dict(), metrics))
                self._busy = None
                self._commits.extend(ckpt.poll())
                self._profiles.extend(profiler.end(step, stop=stop))
                if stop:
                    self._stopped_early = True
                    break
            self._busy = "saving a checkpoint"
            self._commits.extend(ckpt.wait())
            self._busy = None
            if engine.data_failure is not None:
                # After the checkpoint of the last whole step: the run resumes from it.
                raise DataUnavailable(f"stopped after step {engine.step} (checkpointed): "
                                      f"{engine.data_failure}; resume the run once the data "
                                      f"is readable again")
            self._done = True
        except BaseException as exc:  # reported to the controller by poll(); the thread ends
            self._error_kind = classify_exception(exc)
            if isinstance(exc, NumericsEscalation):
                self._evict = exc.evict
                self._forget_suspects(exc)
            if self._error_kind == "collective":  # which collective, and in which group
                error = traceback.format_exc()
                record = self._flight_summary()
                error += f"flight recorder: {record}\n" if record else ""
            elif self._error_kind == "numerics":
                error = str(exc)
            else:  # the task's code (or ours): where it failed, in the task's frames
                error = str(self._step_failure(exc))
            self._error = error
            if self._error_kind == "collective":  # a peer, or its node, may be gone: the
                mark_failed()  # node's agent polls this rank again at once (the driver probes)
        finally:
            profiler.discard()  # a failure inside the window: no trace (see StepProfiler)

    def _roll_back(self, rollback: NumericsRollback) -> None:
        """Every rank of the world restores its own snapshot of the step the checks trust,
        and forgets the newer ones (they may hold the fault); training goes on from there
        (the driver's console line for it comes from rank 0's `numerical_fault`). Without
        that snapshot the world cannot mend the fault: the run stops."""
        assert self.engine is not None
        step = rollback.decision.rollback_to
        if not self._tiered or step is None or not self.tier.roll_back(self._engine_view(),
                                                                        step):
            raise NumericsEscalation(rollback.decision, why=f"no snapshot of step {step} is "
                                     f"held on rank {self.rank} to roll back to")

    def _forget_suspects(self, exc: NumericsEscalation) -> None:
        """Before the world ends on an eviction: forget the snapshots newer than the step the
        checks trust, so the next world restores from that one, not from the fault."""
        step = exc.decision.rollback_to
        if self._tiered and step is not None:
            self.tier.forget_after(step)

    def _step_failure(self, exc: BaseException) -> TaskCodeError:
        """What the training thread's error was, in the task's terms: the rank and step, the
        phase its traceback shows (the forward pass of which module, the loss, a batch, ...)
        and its frames in the task's code."""
        engine = self.engine
        model = unwrapped(engine.model) if engine is not None else None
        frames = frames_of(exc, model)
        where = f"worker rank {self.rank}"
        if engine is not None and engine.step < self.config.train.steps:
            where += f", step {engine.step + 1}"
        return task_failure(infer_phase(frames), exc, frames).where(where)

    def ack_faults(self) -> None:
        """The controller has the poll that reported the faults: carry them out now."""
        self.faults.ack()

    def request_stop(self) -> None:
        """Stop after the step in flight (all ranks agree on which) and checkpoint it."""
        self._stop.set()

    def poll(self, generation: int | None = None) -> WorkerStatus:
        """What happened since the last poll. A poll for another `generation` (left over from
        a world that ended) drains nothing: its reports belong to this world's polls."""
        if generation is not None and generation != self.generation:
            return WorkerStatus(rank=self.rank, generation=self.generation, steps=[],
                                commits=[], done=False)
        # Read the end of the thread before draining: whatever it queued before it ended is
        # then in this answer (a trace or a commit queued last is never left behind).
        done, error = self._done, self._error
        steps = [self._steps.popleft() for _ in range(len(self._steps))]
        self._sent.extend(steps)  # until the world ends: this answer may be dropped
        commits = [self._commits.popleft() for _ in range(len(self._commits))]
        self._sent_commits.extend(commits)
        faults = self.faults.drain()
        profiles = [self._profiles.popleft() for _ in range(len(self._profiles))]
        engine = self.engine
        numerics = engine.numerics.drain() if engine is not None else []
        return WorkerStatus(rank=self.rank, generation=self.generation, steps=steps,
                            commits=commits, done=done, stopped_early=self._stopped_early,
                            error=error, error_kind=self._error_kind, faults=faults,
                            evict=self._evict, numerics=numerics if self.rank == 0 else [],
                            profiles=profiles, preempted=self._preempted,
                            snapshot_bytes=self.tier.nbytes(), tier_limit=self.tier.limit,
                            snapshot_schedule=self.tier.schedule_report(),
                            busy=self._busy or self._reading(),
                            flight_record=self._record_if_quiet(bool(steps)))

    def _reading(self) -> str | None:
        engine = self.engine
        return "reading data" if engine is not None and engine.feeder.waiting else None

    # Seconds between two flight records of a quiet thread (each one costs a dump).
    RECORD_EVERY_S = 5.0

    def _record_if_quiet(self, progressed: bool) -> str | None:
        """Where the training thread is stuck, once it has completed no step for half the
        hang limit (its own steps' median stands for the controller's): the poll that
        reports the hang then names the collective this rank waits in (or that it waits in
        none). Taken at most every RECORD_EVERY_S, only while the thread runs."""
        now = time.monotonic()
        thread = self._thread
        if progressed or thread is None or not thread.is_alive():
            self._quiet_since, self._record = now, (0.0, None)
            return None
        fc = self.config.failure
        times = sorted(r.step_time_s for r in list(self._sent)[-20:])
        median = times[len(times) // 2] if times else 0.0
        if now - self._quiet_since < max(fc.hang_timeout_floor_s, fc.hang_factor * median) / 2:
            return None
        if now - self._record[0] >= self.RECORD_EVERY_S:
            self._record = (now, self._flight_summary())
        return self._record[1]

    def _flight_summary(self) -> str | None:
        """One line from this process's flight recorder: the collective it is stuck in."""
        record = take_flight_record(since_ns=self._world_ns)
        return None if record is None else summarise_flight_record(
            record, self.rank, time.time_ns(), since_ns=self._world_ns)

    # ------------------------------------------------------------------ leaving

    def leave(self, timeout_s: float, after_step: int | None = None) -> LeaveReport:
        """Leave this generation's world and keep the process for the next one.

        The training thread has ended by now or soon will: a failed peer's collectives
        fail on every rank (the controller kills failed ranks before asking survivors to
        leave). The report says left=False if the thread is still stuck after `timeout_s`:
        the process is then not reusable and the controller replaces it. Steps after
        `after_step` (the controller's last) are returned, so none goes unrecorded.
        """
        step = self.engine.step if self.engine is not None else 0
        if self._thread is not None:
            deadline = time.monotonic() + timeout_s
            self.tier.abandon()  # a snapshot exchange with a lost peer must not hold us
            # A world whose thread is stuck in it, or ended with its error, failed.
            failed = self._thread.is_alive() or self._error is not None
            if failed:
                self._abort_world(timeout_s)
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                # Say where it is stuck (the worker's log), before the controller kills us.
                print(f"stalwart worker rank {self.rank}: the training thread did not end "
                      f"within {timeout_s:.0f}s of leaving its world; its stacks:",
                      file=sys.stderr, flush=True)
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                return LeaveReport(left=False, step=step, steps=self._steps_after(after_step))
            if failed and not drain_device(max(1.0, deadline - time.monotonic())):
                # A kernel that never ends: no world can use this GPU (nor this process).
                print(f"stalwart worker rank {self.rank}: the GPU did not finish its queued "
                      f"work within {timeout_s:.0f}s of the abort; not reusable",
                      file=sys.stderr, flush=True)
                return LeaveReport(left=False, step=step, steps=self._steps_after(after_step))
            step = self.engine.step if self.engine is not None else step
        # This world's commits, polled or not (an answer that carried some may have been
        # dropped as the world ended), and the save in flight if it completes: they are on
        # storage, so they go on record (rank 0 reports them for everyone; the driver logs
        # each once).
        commits = [*self._sent_commits, *self._commits]
        if self.checkpointer is not None:
            try:
                commits.extend(self.checkpointer.wait())
            except Exception:
                pass  # a save that failed with its world; the last commit stays valid
        self.tier.leave()  # its store stays: the next world may restore from it
        if self.engine is not None:
            self.engine.close()
        self._retire(self.engine, self.checkpointer)
        self.engine, self.checkpointer = None, None
        destroy_process_group()
        self._close_rendezvous()  # hosted for a world that never formed
        late = self._steps_after(after_step)
        self._reset_run_state()
        self.rank = -1
        self.faults.disarm()
        announce_name(repr(self))
        return LeaveReport(left=True, step=step, commits=tuple(commits), steps=late)

    def _abort_world(self, timeout_s: float) -> None:
        """Leave a failed world: every group is aborted, never destroyed (destroying an NCCL
        group flushes its communicators, which waits for what a dead peer never sends).
        First, where the thread is stuck goes to the log, and whatever else waits in the
        world gives up within `timeout_s`. gloo's abort wakes nothing: then its connections
        are cut (a silent peer closes nothing); NCCL's are closed by its abort by then."""
        if self._thread is not None and self._thread.is_alive():
            record = self._flight_summary()
            if record is not None:
                print(f"stalwart: {self!r} leaves its world stuck; flight recorder: {record}",
                      file=sys.stderr, flush=True)
        shorten_timeouts(timeout_s)
        abort_process_groups()
        cut(self._world_connections)

    def _steps_after(self, after_step: int | None) -> tuple[StepReport, ...]:
        """This world's step reports after `after_step`, sent or not, once each."""
        if after_step is None:
            return ()
        by_step = {r.step: r for r in (*self._sent, *self._steps) if r.step > after_step}
        return tuple(by_step[s] for s in sorted(by_step))

    def _retire(self, engine: TrainEngine | None,
                checkpointer: StorageCheckpointer | None) -> None:
        """Let go of a world's engine and checkpointer on a thread: freeing the model,
        optimizer and DDP's reducer and closing the save thread took about 30 ms on the
        reference GPT, with every peer waiting for the survivors to leave. The next world
        forms meanwhile; its setup waits for this before it makes its process groups and
        engine (two models, or two worlds' communicators, at once could exhaust a GPU). No
        gc.collect(): refcounts free them."""
        self._retired()
        held = [engine, checkpointer]

        def let_go() -> None:
            if held[1] is not None:
                with contextlib.suppress(Exception):
                    held[1].close()
            held.clear()

        self._retiring = threading.Thread(target=let_go, name="stalwart-retire", daemon=True)
        self._retiring.start()

    def _retired(self) -> None:
        """Wait until the last world's engine is let go (_retire)."""
        if self._retiring is not None:
            self._retiring.join()
            self._retiring = None

    def shutdown(self) -> None:
        """Leave the world cleanly (the controller kills the actor if this does not return)."""
        self._retired()
        if self._thread is not None:
            self._thread.join()
        if self.checkpointer is not None:
            self.checkpointer.close()
        self.tier.leave()
        destroy_process_group()
        self._close_rendezvous()
