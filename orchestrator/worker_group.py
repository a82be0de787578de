"""RayWorkerGroup: one generation of worker actors in a placement group.

The controller sees only this small interface (start, rendezvous, restore, launch, poll,
request_stop, shutdown), so it can be tested step by step with a fake group. Every method
turns Ray's errors into a WorkerFailure naming the rank, rather than letting them escape.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from stalwart.config import JobConfig
from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.workers.actor import TrainWorker
from stalwart.workers.reports import WorkerStatus


class GroupFailed(Exception):
    def __init__(self, failure: WorkerFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def _failure_from(exc: BaseException, rank: int | None, default: FailureKind) -> WorkerFailure:
    if isinstance(exc, RayActorError):
        kind, msg = FailureKind.WORKER_DIED, f"worker rank {rank} died: {exc}"
    elif isinstance(exc, RayTaskError):
        kind, msg = default, f"worker rank {rank}: {exc.cause if exc.cause else exc}"
    else:
        kind, msg = default, f"worker rank {rank}: {type(exc).__name__}: {exc}"
    return WorkerFailure(kind=kind, rank=rank, message=msg.strip(), detected_at=time.time())


class RayWorkerGroup:
    def __init__(self, config: JobConfig, storage_url: str, *, generation: int,
                 runtime_env: dict[str, Any] | None = None) -> None:
        self.config = config
        self.storage_url = storage_url
        self.generation = generation
        self.runtime_env = runtime_env
        self.world_size = config.scaling.num_workers
        self.pg = None
        self.actors: list[Any] = []

    def _get(self, refs: list[Any], *, timeout: float | None = None,
             kind: FailureKind = FailureKind.START_ERROR) -> list[Any]:
        """ray.get each rank's result; the first error becomes a GroupFailed naming the rank."""
        out = []
        deadline = None if timeout is None else time.monotonic() + timeout
        for rank, ref in enumerate(refs):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out.append(ray.get(ref, timeout=left))
            except GetTimeoutError:
                raise GroupFailed(WorkerFailure(
                    kind=FailureKind.START_ERROR, rank=rank, detected_at=time.time(),
                    message=f"worker rank {rank} did not answer within {timeout:.0f}s")) from None
            except Exception as exc:
                raise GroupFailed(_failure_from(exc, rank, kind)) from exc
        return out

    def start(self) -> None:
        """Reserve resources in a placement group and start one actor per rank."""
        sc = self.config.scaling
        bundle = {"CPU": sc.cpus_per_worker}
        if sc.gpus_per_worker:
            bundle["GPU"] = sc.gpus_per_worker
        self.pg = placement_group([dict(bundle) for _ in range(self.world_size)],
                                  strategy=sc.placement_strategy)
        if not self.pg.wait(timeout_seconds=sc.start_timeout_s):
            raise GroupFailed(WorkerFailure(
                kind=FailureKind.START_ERROR, rank=None, detected_at=time.time(),
                message=f"the cluster could not place {self.world_size} workers of {bundle} "
                        f"within scaling.start_timeout_s={sc.start_timeout_s:.0f}s "
                        f"(cluster resources: {ray.cluster_resources()})"))
        cls = ray.remote(TrainWorker)
        config = self.config.to_dict()
        for rank in range(self.world_size):
            options: dict[str, Any] = dict(
                num_cpus=sc.cpus_per_worker, num_gpus=sc.gpus_per_worker, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank),
                name=f"stalwart-worker-r{rank}-g{self.generation}-{os.getpid()}",
            )
            if self.runtime_env:
                options["runtime_env"] = self.runtime_env
            self.actors.append(cls.options(**options).remote(config, self.storage_url))

    def rendezvous(self) -> None:
        """Rank 0 names an address; every rank joins the process group and builds its model."""
        timeout = self.config.scaling.start_timeout_s
        (rdzv,) = self._get([self.actors[0].rendezvous_address.remote()], timeout=timeout)
        self._get([a.setup.remote(rank, self.world_size, rdzv)
                   for rank, a in enumerate(self.actors)], timeout=timeout)

    def restore(self, path: str) -> int:
        steps = self._get([a.restore.remote(path) for a in self.actors])
        return steps[0]

    def launch(self) -> None:
        self._get([a.start.remote() for a in self.actors])

    def poll(self, timeout: float) -> list[WorkerStatus]:
        """Every rank's status; raises GroupFailed for a dead worker or a failed step.

        A dead rank outranks errors on the others: when a process dies, its peers' next
        collective fails too, and blaming them (as a user error) would hide the real cause.
        """
        refs = [a.poll.remote() for a in self.actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        statuses: list[WorkerStatus] = []
        died: WorkerFailure | None = None
        for rank, ref in enumerate(refs):
            if ref not in ready:
                raise GroupFailed(WorkerFailure(
                    kind=FailureKind.WORKER_DIED, rank=rank, detected_at=time.time(),
                    message=f"worker rank {rank} did not answer a poll within {timeout:.0f}s"))
            try:
                statuses.append(ray.get(ref))
            except Exception as exc:
                died = died or _failure_from(exc, rank, FailureKind.WORKER_DIED)
        if died is not None:
            raise GroupFailed(died)
        for st in statuses:
            if st.error is not None:
                raise GroupFailed(WorkerFailure(kind=FailureKind.USER_ERROR, rank=st.rank,
                                                message=st.error, detected_at=time.time()))
        return statuses

    def request_stop(self) -> None:
        for a in self.actors:
            a.request_stop.remote()

    def describe(self) -> list[dict[str, Any]]:
        return self._get([a.describe.remote() for a in self.actors])

    def shutdown(self, *, graceful: bool) -> None:
        """Leave the process group cleanly when asked and able; then kill actors, free resources."""
        if graceful and self.actors:
            try:
                self._get([a.shutdown.remote() for a in self.actors], timeout=60)
            except GroupFailed:
                pass  # the actors are killed below either way
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
