"""A survivor stuck in a gloo collective with a stopped peer (a frozen node closes nothing,
and gloo's abort wakes nothing) gets out by cutting the connections its world's setup opened.

The processes are started here, not by the launcher: one of them stops itself (SIGSTOP)
and never returns, and the test kills it (a process it started). They come from the
launcher's fork server all the same, with torch imported once.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from stalwart.parallel.world_sockets import cut, tcp_connections
from tests.dist.launcher import start_forked

pytestmark = [pytest.mark.dist, pytest.mark.timeout(120),
              pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="needs /proc")]

WORLD = 3
STOPPED = 2


def _rank(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                            world_size=WORLD)
    before = tcp_connections()
    group = dist.new_group(backend="gloo")  # a world's groups, opened during its setup
    opened = tcp_connections() - before
    dist.all_reduce(torch.ones(4), group=group)
    if rank == STOPPED:
        Path(out_dir, "stopped.pid").write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, silent, holding its connections
        return
    errors: list[str] = []

    def collective() -> None:
        try:
            dist.all_reduce(torch.ones(4), group=group)
        except RuntimeError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=collective, daemon=True)
    thread.start()
    thread.join(2.0)
    stuck = thread.is_alive()
    cut_count = cut(opened)
    started = time.monotonic()
    thread.join(30.0)
    Path(out_dir, f"{rank}.json").write_text(json.dumps({
        "opened": len(opened), "stuck_before_cut": stuck, "cut": cut_count,
        "ended": not thread.is_alive(), "after_cut_s": time.monotonic() - started,
        "errors": errors}))
    os._exit(0)  # the groups' teardown would wait on the stopped peer


def test_cutting_its_world_connections_frees_a_rank_stuck_with_a_stopped_peer(tmp_path):
    context = start_forked(_rank, (str(tmp_path),), WORLD, join=False)
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"{r}.json").exists() for r in range(WORLD) if r != STOPPED):
            assert time.monotonic() < deadline, "the survivors did not report"
            time.sleep(0.1)
    finally:
        for process in context.processes:  # the stopped one takes SIGKILL at once
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join(10)
    for rank in range(WORLD):
        if rank == STOPPED:
            continue
        report = json.loads((tmp_path / f"{rank}.json").read_text())
        assert report["opened"] >= WORLD - 1  # a connection to each peer, at least
        assert report["stuck_before_cut"], report  # gloo alone would wait for its timeout
        assert report["cut"] >= 1 and report["ended"], report
        assert report["errors"], report  # the collective failed: the rank can leave
