"""TrainWorker: the Ray actor of one rank. The loop runs on a thread; the actor keeps answering.

The controller drives each worker through setup -> restore -> start, then polls it: a poll
drains the step reports (the heartbeat) and checkpoint commits gathered since the last one.
Because training runs on its own thread, the actor answers polls and stop requests even in
the middle of a long step or a stuck collective.
"""

from __future__ import annotations

import os
import threading
import traceback
from collections import deque
from dataclasses import replace
from typing import Any

import torch

from stalwart.checkpointing.storage import StorageCheckpointer
from stalwart.config import JobConfig, config_from_dict
from stalwart.parallel.distributed import (
    Rendezvous,
    destroy_process_group,
    free_port,
    init_process_group,
    pick_device,
)
from stalwart.task import build_task
from stalwart.workers.engine import TrainEngine
from stalwart.workers.reports import CommitReport, StepReport, WorkerStatus


class TrainWorker:
    def __init__(self, config: dict[str, Any], storage_url: str) -> None:
        self.config: JobConfig = config_from_dict(config)
        self.storage_url = storage_url
        # Never more compute threads than the CPUs Ray reserved for this actor.
        torch.set_num_threads(max(1, int(self.config.scaling.cpus_per_worker)))
        self.rank = -1
        self.engine: TrainEngine | None = None
        self.checkpointer: StorageCheckpointer | None = None
        self._steps: deque[StepReport] = deque()
        self._commits: deque[CommitReport] = deque()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._done = False
        self._stopped_early = False
        self._error: str | None = None

    # ------------------------------------------------------------------ set-up

    def rendezvous_address(self) -> Rendezvous:
        """Called on rank 0 only: this node's address and a port free on it right now."""
        import ray

        return Rendezvous(host=ray.util.get_node_ip_address(), port=free_port())

    def describe(self) -> dict[str, Any]:
        """Where this rank runs, for the event log (and for tests that kill it)."""
        import ray

        return {"rank": self.rank, "pid": os.getpid(), "node_ip": ray.util.get_node_ip_address()}

    def setup(self, rank: int, world_size: int, rdzv: Rendezvous) -> None:
        """Join the process group, then build the task, model, optimizer and data."""
        self.rank = rank
        device = pick_device(self.config.scaling.gpus_per_worker > 0)
        init_process_group(rdzv, rank=rank, world_size=world_size, device=device,
                           timeout_s=self.config.failure.collective_timeout_s)
        task = build_task(self.config.task.path, self.config.task.args)
        task.prepare_data(self.config)
        self.engine = TrainEngine(self.config, task, rank=rank, world_size=world_size,
                                  device=device)
        self.checkpointer = StorageCheckpointer(
            self.storage_url, rank=rank, keep_last=self.config.checkpoint.keep_last,
            async_save=self.config.checkpoint.async_save,
            manifest_extra={"world_size": world_size, "task": self.config.task.path})

    def restore(self, path: str) -> int:
        """Load a committed checkpoint (resharded to this world); returns its step."""
        assert self.engine is not None and self.checkpointer is not None
        state = self.engine.state_dict()
        self.checkpointer.load(path, state)
        self.engine.load_state_dict(state)
        return self.engine.step

    # ------------------------------------------------------------------ running

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="stalwart-train", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        engine, ckpt, cfg = self.engine, self.checkpointer, self.config
        assert engine is not None and ckpt is not None
        try:
            while engine.step < cfg.train.steps:
                report, stop = engine.train_step(stop_requested=self._stop.is_set())
                step = engine.step
                last = step == cfg.train.steps
                if cfg.data.val_every and (step % cfg.data.val_every == 0 or last):
                    report = replace(report, val_loss=engine.validate())
                self._steps.append(report)
                if step % cfg.checkpoint.persist_every == 0 or last or stop:
                    self._commits.extend(ckpt.save(step, engine.state_dict()))
                self._commits.extend(ckpt.poll())
                if stop:
                    self._stopped_early = True
                    break
            self._commits.extend(ckpt.wait())
            self._done = True
        except BaseException:  # reported to the controller by poll(); the thread just ends
            self._error = traceback.format_exc()

    def request_stop(self) -> None:
        """Stop after the step in flight (all ranks agree on which) and checkpoint it."""
        self._stop.set()

    def poll(self) -> WorkerStatus:
        steps = [self._steps.popleft() for _ in range(len(self._steps))]
        commits = [self._commits.popleft() for _ in range(len(self._commits))]
        return WorkerStatus(rank=self.rank, steps=steps, commits=commits, done=self._done,
                            stopped_early=self._stopped_early, error=self._error)

    def shutdown(self) -> None:
        """Leave the world cleanly (the controller kills the actor if this does not return)."""
        if self._thread is not None:
            self._thread.join()
        if self.checkpointer is not None:
            self.checkpointer.close()
        destroy_process_group()
