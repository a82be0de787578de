"""The cold-start bench's timing probe: on PYTHONPATH with STALWART_STARTUP_PROBE=FILE, every
Python process of a run (the driver and Ray's workers) appends to FILE when it started, and
when each of the start-up calls below began and ended, one JSON line each.

It wraps functions as their modules load (an import hook), so stalwart's code is measured as
it is, with nothing added to it. Self-contained: Ray's workers do not have the repository on
sys.path. Without the variable it does nothing.
"""

from __future__ import annotations

import functools
import importlib.abc
import json
import os
import sys
import time
from typing import Any

FILE = os.environ.get("STALWART_STARTUP_PROBE")

# module -> the callables to time in it ("Class.method" or "function").
WATCHED: dict[str, tuple[str, ...]] = {
    "stalwart.cli.main": ("_main",),
    "stalwart.trainer": ("Trainer._check_memory",),
    "stalwart.plan.preflight": ("check_run_memory",),
    "stalwart.task_check": ("check_task",),
    "ray._private.worker": ("init",),
    "stalwart.orchestrator.controller": ("Controller.run",),
    "stalwart.workers.actor": ("TrainWorker.__init__",),
    "stalwart.workers.worker": ("Worker.warm_up", "Worker.setup", "Worker.start"),
    "stalwart.parallel.distributed": ("init_process_group",),
    "stalwart.workers.engine": ("TrainEngine.__init__",),
    "stalwart.examples.gpt.task": ("GPTTask.prepare_data",),
}
# Modules whose import itself is timed (their first import in a process).
IMPORTS = ("torch", "ray", "stalwart.orchestrator.controller")


def _write(row: dict[str, Any]) -> None:
    row["pid"] = os.getpid()
    with open(FILE, "ab", buffering=0) as f:  # one write(2): lines never interleave
        f.write((json.dumps(row) + "\n").encode())


def _process_start() -> float | None:
    """When the kernel started this process (its exec may come a little later)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration):
        return None


def _timed(name: str, fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.time()
        try:
            return fn(*args, **kwargs)
        finally:
            _write({"call": name, "t0": t0, "t1": time.time()})

    wrapper.__wrapped_by_probe__ = True
    return wrapper


def _patch(module: Any, names: tuple[str, ...]) -> None:
    for dotted in names:
        owner, _, attr = dotted.rpartition(".")
        target = getattr(module, owner) if owner else module
        fn = getattr(target, attr, None)
        if fn is not None and not getattr(fn, "__wrapped_by_probe__", False):
            setattr(target, attr, _timed(f"{module.__name__}:{dotted}", fn))


class _Finder(importlib.abc.MetaPathFinder):
    """Finds the watched modules through the other finders and wraps their execution."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in WATCHED and name not in IMPORTS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                _wrap_loader(spec.loader, name)
                return spec
        return None


def _wrap_loader(loader: Any, name: str) -> None:
    exec_module = loader.exec_module

    def exec_and_patch(module: Any) -> None:
        t0 = time.time()
        exec_module(module)
        if name in IMPORTS:
            _write({"import": name, "t0": t0, "t1": time.time()})
        if name in WATCHED:
            _patch(module, WATCHED[name])

    loader.exec_module = exec_and_patch


if FILE:
    _write({"process": " ".join(sys.argv)[:200], "t0": _process_start(), "t1": time.time()})
    sys.meta_path.insert(0, _Finder())
