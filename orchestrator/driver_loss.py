"""The driver's side of outliving a killed driver: its beacon, and the run's previous driver.

Detached workers (orchestrator/worker_group.py, workers/driver_watch.py) and their driver's
beacon live in a Ray namespace of the run's own, `stalwart-run-<run id>`. A driver that starts
the run again looks there first: a live beacon means another driver runs this run now (two
would write the same checkpoints), so it is refused; live workers are a killed driver's,
committing the step in flight, so it waits for them and only then reads the newest checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from stalwart.core.errors import RunDirError
from stalwart.workers.driver_watch import DriverBeacon

BEACON_PREFIX = "stalwart-driver-"


def run_namespace(run_id: str) -> str:
    return f"stalwart-run-{run_id}"


def start_beacon(run_id: str, driver_node_id: str) -> Any:
    """The beacon the run's workers watch: owned by this driver, on its node, so that Ray
    ends it when the driver dies, and only then."""
    import os

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return ray.remote(DriverBeacon).options(
        num_cpus=0, max_restarts=0, name=f"{BEACON_PREFIX}{os.getpid()}",
        namespace=run_namespace(run_id),
        scheduling_strategy=NodeAffinitySchedulingStrategy(driver_node_id, soft=False)
    ).remote()


def _named(namespace: str) -> list[str]:
    import ray

    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace]


def settle_previous_driver(run_id: str, *, wait_s: float,
                           log: Callable[[str], None]) -> bool:
    """Refuse a run another driver is running; wait up to `wait_s` for a killed driver's
    workers to commit and exit, then kill those still there. True when there were any:
    the newest checkpoint may have changed."""
    namespace = run_namespace(run_id)
    names = _named(namespace)
    drivers = [n for n in names if n.startswith(BEACON_PREFIX)]
    if drivers:
        raise RunDirError(f"this run is running already: its driver (pid "
                          f"{drivers[0][len(BEACON_PREFIX):]}) is alive on this cluster; "
                          f"stop it first (Ctrl-C, `stalwart stop JOB`) or wait for it")
    if not names:
        return False
    log(f"waiting up to {wait_s:.0f}s for {len(names)} worker(s) of this run's previous "
        f"driver (killed) to commit the step in flight")
    deadline = time.monotonic() + wait_s
    while names and time.monotonic() < deadline:
        time.sleep(1.0)
        names = _named(namespace)
    _kill_and_confirm(namespace, names)
    return True


def _kill_and_confirm(namespace: str, names: list[str], timeout_s: float = 30.0) -> None:
    """Kill the workers still there and return once each is dead: `ray.kill` only asks, and
    a stuck worker still writing must be gone before the newest checkpoint is read."""
    import ray

    handles = []
    for name in names:  # stuck: the commit they were making is abandoned, the last one stays
        try:
            handle = ray.get_actor(name, namespace=namespace)
        except ValueError:
            continue  # gone meanwhile
        ray.kill(handle, no_restart=True)
        handles.append(handle)
    deadline = time.monotonic() + timeout_s
    while handles and time.monotonic() < deadline:
        # One probe each, all at once: an answer means the kill has not reached it yet, no
        # answer (stopped, busy) is not known dead either; only Ray's actor error is.
        probes = {handle.__ray_ready__.remote(): handle for handle in handles}
        answered = set(ray.wait(list(probes), num_returns=len(probes), timeout=1.0)[0])
        handles = [h for ref, h in probes.items() if not (ref in answered and _died(ref))]
        if handles:
            time.sleep(0.2)


def _died(ref: object) -> bool:
    """Whether an answered probe says its actor is dead."""
    import ray

    try:
        ray.get(ref)
    except ray.exceptions.RayActorError:
        return True
    return False
