"""The worker that will be rank 0 hosts its world's rendezvous: from the moment it names the
address, it listens there (on its node's address, not on all interfaces) and nobody else can
take the port; once it leaves the world, it listens there no more. Driven directly as one Ray
actor, through three worlds and a rendezvous asked for twice."""

from __future__ import annotations

import time

import pytest
import ray

from tests.keys import trust
from tests.ray.test_train_worker import (  # noqa: F401 (fixtures)
    DEADLINE_S,
    config_of,
    leave,
    make_actor,
    poll_until,
    steps_in,
)
from tests.unit.test_rendezvous import listeners, listening_on

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]
# A rank lets go of its last world's engine on a thread once it has left (Worker._retire); the
# process group, and the store it holds, go with it, moments later.
LET_GO_S = 10.0


def let_go(port: int, pid: int) -> set[tuple[str, int]]:
    """Who still listens on `port` in `pid` once it stopped, or after LET_GO_S."""
    deadline = time.monotonic() + LET_GO_S
    while (still := listening_on(port, pid=pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return still


def test_each_world_s_store_is_held_on_the_node_address_and_let_go(make_actor) -> None:  # noqa: F811
    actor, _ = make_actor(config_of())
    place = ray.get(actor.warm_up.remote(), timeout=DEADLINE_S)
    pid, ip = place.pid, place.node_ip
    listening_between_worlds = [len(listeners(pid))]
    for generation in range(3):
        rdzv = ray.get(actor.rendezvous_address.remote(), timeout=DEADLINE_S)
        if generation == 1:  # a world that failed while it formed: asked again
            stale, rdzv = rdzv, ray.get(actor.rendezvous_address.remote(), timeout=DEADLINE_S)
            assert listening_on(stale.port, pid=pid) == set()
        assert rdzv.host == ip
        assert listening_on(rdzv.port, pid=pid) == {(ip, rdzv.port)}
        ray.get(actor.setup.remote(0, 1, rdzv, generation, [], [place.node_id],
                                   signing=trust()), timeout=DEADLINE_S)
        ray.get(actor.start.remote(), timeout=DEADLINE_S)
        poll_until(actor, lambda seen: len(steps_in(seen)) >= 2)
        ray.get(actor.request_stop.remote(), timeout=DEADLINE_S)
        poll_until(actor, lambda more: more[-1].done)
        left, _, _ = leave(actor)
        assert left
        assert let_go(rdzv.port, pid) == set()
        listening_between_worlds.append(len(listeners(pid)))
    # Nothing else is left listening by a world either (gloo's own sockets included).
    assert len(set(listening_between_worlds)) == 1, listening_between_worlds
