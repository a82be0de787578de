"""The pieces that let workers outlive a killed driver, on a real local Ray: a worker's watch
notices its driver's beacon die, and a driver starting a run again finds that run's previous
driver (refused while alive) and its lingering workers (waited for, then killed).
The whole path (SIGKILL of a real driver) is tests/e2e/test_driver_loss.py."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
import ray

from stalwart.core.errors import RunDirError
from stalwart.orchestrator.driver_loss import (
    run_namespace,
    settle_previous_driver,
    start_beacon,
)
from stalwart.workers.driver_watch import DriverBeacon, DriverWatch

pytestmark = [pytest.mark.ray, pytest.mark.timeout(120), pytest.mark.usefixtures("local_ray")]


def test_the_watch_reports_a_dead_beacon_once_and_only_then():
    beacon = start_beacon(uuid.uuid4().hex, ray.get_runtime_context().get_node_id())
    lost = threading.Event()
    calls = []
    watch = DriverWatch(beacon, lambda: (calls.append(1), lost.set()), interval_s=0.1).start()
    time.sleep(1.0)
    assert not lost.is_set()  # a live beacon is never a loss
    ray.kill(beacon, no_restart=True)
    assert lost.wait(30)
    time.sleep(0.5)
    assert calls == [1]
    watch.close()


def test_a_closed_watch_reports_nothing():
    beacon = ray.remote(DriverBeacon).options(num_cpus=0).remote()
    lost = threading.Event()
    watch = DriverWatch(beacon, lost.set, interval_s=0.1).start()
    watch.close()
    ray.kill(beacon, no_restart=True)
    assert not lost.wait(2)


def test_a_run_whose_driver_is_alive_is_refused():
    run_id = uuid.uuid4().hex
    beacon = start_beacon(run_id, ray.get_runtime_context().get_node_id())
    ray.get(beacon.ping.remote())
    with pytest.raises(RunDirError, match="running already: its driver"):
        settle_previous_driver(run_id, wait_s=1, log=print)
    ray.kill(beacon, no_restart=True)


@ray.remote(num_cpus=0)
class Lingering:
    def ping(self) -> bool:
        return True


def test_a_killed_drivers_workers_are_waited_for_then_killed():
    run_id = uuid.uuid4().hex
    assert settle_previous_driver(run_id, wait_s=1, log=print) is False  # nothing there
    leaving = Lingering.options(name="stalwart-worker-1-9", namespace=run_namespace(run_id),
                                lifetime="detached").remote()
    stuck = Lingering.options(name="stalwart-worker-2-9", namespace=run_namespace(run_id),
                              lifetime="detached").remote()
    ray.get([leaving.ping.remote(), stuck.ping.remote()])
    threading.Timer(0.5, lambda: ray.kill(leaving, no_restart=True)).start()
    said = []
    assert settle_previous_driver(run_id, wait_s=3, log=said.append) is True
    assert said and "2 worker(s) of this run's previous driver" in said[0]
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(stuck.ping.remote(), timeout=30)  # past the wait: killed
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True)
                if a["namespace"] == run_namespace(run_id)]
