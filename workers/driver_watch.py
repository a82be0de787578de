"""Workers that outlive their driver: the driver's beacon, and each worker's watch on it.

On a cluster the driver joined (`--address`, `stalwart submit`), the workers are detached
actors, so a driver killed outright (SIGKILL, the OOM killer, a lost pod) does not take their
memory with it. The beacon is a tiny actor the driver owns and nobody else: Ray ends it when
its owner dies. A worker that finds the beacon dead knows the driver is gone, not merely
slow, and acts as on a stop request: every rank stops after the step in flight, that step is
committed to storage, and the workers exit. The next driver (`--auto-resume`) continues
from that step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class DriverBeacon:
    """Lives exactly as long as the driver that created it (non-detached, driver-owned)."""

    def ping(self) -> bool:
        return True


class DriverWatch:
    """Pings the driver's beacon every `interval_s` on a thread of its own; calls `on_lost`
    once, on that thread, when the beacon is dead.

    Only a dead beacon counts: an answer that is late or an actor that is briefly
    unreachable means a busy or restarting node, and the watch asks again.
    """

    def __init__(self, beacon: Any, on_lost: Callable[[], None], *, interval_s: float = 1.0,
                 answer_timeout_s: float = 30.0) -> None:
        self.beacon = beacon
        self.on_lost = on_lost
        self.interval_s = interval_s
        self.answer_timeout_s = answer_timeout_s
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalwart-driver-watch",
                                        daemon=True)

    def start(self) -> DriverWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

        while not self._closed.wait(self.interval_s):
            try:
                ray.get(self.beacon.ping.remote(), timeout=self.answer_timeout_s)
            except ActorDiedError:
                if not self._closed.is_set():
                    self.on_lost()
                return
            except (GetTimeoutError, ActorUnavailableError):
                continue


def end_this_actor(grace_s: float = 10.0) -> None:
    """End the calling actor from any of its threads (exit_actor works only on the thread
    running a task): through Ray, so its actor table says it was killed, else at once."""
    import os
    import time

    import ray

    try:
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        time.sleep(grace_s)
    finally:
        os._exit(1)
