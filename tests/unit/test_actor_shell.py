"""The Ray actor TrainWorker is a shell: each of its methods is a Worker method, same name and
signature, so nothing a rank can do is missing from the actor or differs from it."""

from __future__ import annotations

import inspect

import pytest

from stalwart.workers.actor import TrainWorker
from stalwart.workers.worker import Worker

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _signature(fn) -> inspect.Signature:
    """Without the `_ray_trace_ctx` that ray.remote adds to the class's methods in place
    (when an earlier test in this process made TrainWorker an actor)."""
    sig = inspect.signature(fn)
    return sig.replace(parameters=[p for p in sig.parameters.values()
                                   if p.name != "_ray_trace_ctx"])


def _methods(cls: type) -> dict[str, inspect.Signature]:
    return {name: _signature(fn) for name, fn in vars(cls).items()
            if callable(fn) and (not name.startswith("_") or name == "__init__")}


def test_the_actor_has_every_public_method_of_the_worker_with_its_signature():
    assert _methods(TrainWorker) == _methods(Worker)


def test_the_comparison_survives_ray_remote():
    import ray

    ray.remote(TrainWorker)  # no Ray is started: only the class is decorated
    assert _methods(TrainWorker) == _methods(Worker)


def test_the_actor_shows_the_workers_name(tmp_path):
    import signal

    from stalwart.core.config import load_config
    from tests.cli_helpers import REFERENCE_CONFIG

    sigterm = signal.getsignal(signal.SIGTERM)  # the worker installs its own handler
    try:
        actor = TrainWorker(load_config(REFERENCE_CONFIG, []).to_dict(),
                            str(tmp_path / "storage"), 3)
        assert repr(actor) == repr(actor.worker) == "stalwart-worker-3"
    finally:
        signal.signal(signal.SIGTERM, sigterm)
