"""The worker group's abstract base is the one interface: ElasticGroup (on Ray) and the unit
tests' FakeGroup both subclass it, with every method's signature as the base declares it, so
a method changed in one place and not the others fails here rather than drifting apart."""

from __future__ import annotations

import inspect

import pytest

from stalwart.orchestrator.group import WorkerGroup
from tests.fake_group import FakeGroup

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

METHODS = sorted(WorkerGroup.__abstractmethods__)


def parameters(cls: type, name: str) -> list[tuple[str, object, object]]:
    """Names, kinds and defaults (annotations are strings here and may be spelt apart)."""
    return [(p.name, p.kind, p.default)
            for p in inspect.signature(getattr(cls, name)).parameters.values()]


@pytest.mark.parametrize("group", ["FakeGroup", "ElasticGroup"])
def test_every_group_subclasses_the_base_with_its_signatures(group: str) -> None:
    if group == "FakeGroup":
        cls: type = FakeGroup
    else:
        from stalwart.orchestrator.worker_group import ElasticGroup

        cls = ElasticGroup
    assert issubclass(cls, WorkerGroup)
    assert not getattr(cls, "__abstractmethods__", set())
    for name in METHODS:
        assert parameters(cls, name) == parameters(WorkerGroup, name), name


def test_the_base_declares_what_the_controller_asks() -> None:
    assert METHODS == sorted([
        "top_up", "refresh", "take_unhealthy", "pool_view", "best_world", "draining_nodes",
        "pick", "form", "places", "restore", "memory_inventory", "restore_memory", "launch",
        "settle",
        "poll", "ack_faults", "request_stop", "remove", "exclude_nodes", "disband",
        "shutdown"])
