"""Whose fault an exception is (workers/errors.py), and finding a process's children
(workers/faults.py, used by the kill-node fault)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch.distributed as dist

from stalwart.workers.errors import classify_exception
from stalwart.workers.faults import InjectedFault, children_of

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

GLOO_PEER_GONE = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
                  "Connection closed by peer [127.0.0.1]:41235")
GLOO_TIMEOUT = ("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
                "waiting 300000ms for recv operation to complete")


@pytest.mark.parametrize("exc", [
    RuntimeError(GLOO_PEER_GONE),
    RuntimeError(GLOO_TIMEOUT),
    dist.DistBackendError("NCCL communicator was aborted"),
], ids=["peer-gone", "timeout", "dist-error"])
def test_failed_collectives_are_not_the_users_fault(exc):
    assert classify_exception(exc) == "collective"


def test_a_collective_error_wrapped_by_another_exception_is_found():
    try:
        try:
            raise RuntimeError(GLOO_PEER_GONE)
        except RuntimeError as inner:
            raise ValueError("checkpoint write failed") from inner
    except ValueError as outer:
        assert classify_exception(outer) == "collective"


@pytest.mark.parametrize("exc", [
    ValueError("bad batch"), KeyError("weight"), InjectedFault("injected fault raise"),
    RuntimeError("the request timed out"),  # user code's words, not a process group's
])
def test_everything_else_is_the_tasks(exc):
    assert classify_exception(exc) == "user"


def test_children_of_finds_a_child_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in children_of(os.getpid())
        assert child.pid not in children_of(child.pid)
    finally:
        child.kill()
        child.wait()
