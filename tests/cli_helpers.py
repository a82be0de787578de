"""Running the `stalwart` console script exactly as a user types it."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from stalwart.core.events import read_jsonl

STALWART = str(Path(sys.executable).with_name("stalwart"))
REFERENCE_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "gpt" / "config.toml"

# A tiny GPT on the reference task: seconds per run on 2 CPU cores. No warm spare: one
# costs a process that imports torch and builds the model, wasted in a run nothing fails
# (the tests of spares ask for one).
TINY = [
    "task.args.seq_len=64", "task.args.d_model=64", "task.args.n_layers=2",
    "task.args.n_heads=2", "train.global_batch_size=8", "train.micro_batch_size=2",
    "train.warmup_steps=5", "data.val_batches=1", "scaling.spare_workers=0",
]


_SPAWN_LOCK = threading.Lock()


def run_from_thread(cmd: list[str], *, timeout: float, **popen_kwargs
                    ) -> subprocess.CompletedProcess[str]:
    """subprocess.run for tests that run several CLIs at once from threads.

    Only the spawn is serialised: concurrent fork/exec from threads failed once here with
    EFAULT ('Bad address') in CI. The processes themselves still run side by side.
    """
    with _SPAWN_LOCK:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                **popen_kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def sets(*overrides: str) -> list[str]:
    return [arg for o in overrides for arg in ("--set", o)]


def stalwart(*args: str, cwd: Path, timeout: float = 240,
             check: int | None = 0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([STALWART, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    return _checked(proc, check)


def _checked(proc: subprocess.CompletedProcess[str], check: int | None
             ) -> subprocess.CompletedProcess[str]:
    """`proc`, if it exited `check` (None: any code); else an error showing its output."""
    if check is not None and proc.returncode != check:
        raise AssertionError(f"stalwart {' '.join(proc.args[1:])} exited {proc.returncode}, "
                             f"expected {check}\n--- stdout\n{proc.stdout}\n--- stderr\n"
                             f"{proc.stderr}")
    return proc


def stalwart_here(*args: str, cwd: Path, check: int | None = 0,
                  during: Callable[[], None] | None = None) -> subprocess.CompletedProcess[str]:
    """`stalwart ARGS` as the console script runs it (its own `main`), in this process: on the
    Ray that is already up here (tests/ray/conftest.py starts one per module) rather than a
    new one, and without a Python start and torch import of its own. That is about 10
    CPU-seconds and 8 s less per run; the e2e tier keeps the real console script.

    `during` runs in a thread alongside (the run keeps the main thread for its signal
    handlers): what a test does to the run while it trains. Its exception is raised here."""
    from stalwart.cli.main import main

    errors: list[BaseException] = []

    def alongside() -> None:
        try:
            during()
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=alongside, daemon=True) if during else None
    out, err = io.StringIO(), io.StringIO()
    before_cwd, before_path = os.getcwd(), list(sys.path)
    os.chdir(cwd)
    try:
        if thread:
            thread.start()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(list(args))
        if thread:
            thread.join(timeout=60)
            if thread.is_alive():
                errors.append(AssertionError("what the test did during the run had not "
                                             "ended 60 s after the run"))
    finally:
        os.chdir(before_cwd)
        sys.path[:] = before_path  # main() adds the cwd for a task, or drops it for export
        _forget_modules_under(cwd)
    if errors:
        raise errors[0]
    return _checked(subprocess.CompletedProcess(["stalwart", *args], code, out.getvalue(),
                                                err.getvalue()), check)


def _forget_modules_under(folder: Path) -> None:
    """Tasks that tests write next to a run (`task.py` in each test's folder) are imported
    afresh by the next run, as a new process would."""
    root = str(folder.resolve())
    for name, module in list(sys.modules.items()):
        if (getattr(module, "__file__", None) or "").startswith(root):
            del sys.modules[name]


def exported_weights(run_dir: Path, cwd: Path, name: str) -> dict[str, torch.Tensor]:
    """The weights `stalwart export` writes for the run's newest checkpoint (its own code, in
    this process: the export command itself is tested by tests/e2e/test_cli_export.py)."""
    out = cwd / f"{name}.pt"
    stalwart_here("export", str(run_dir), "--out", str(out), cwd=cwd)
    return torch.load(out)


def wait_until(done: Callable[[], bool], what: str, proc: subprocess.Popen | None,
               timeout: float) -> None:
    """Block until done(). `proc`: the run's process, or None for a run in this process
    (stalwart_here); one that ends first fails the wait, with its output when piped."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if done():
            return
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the run ended before {what}:\n"
                                 f"{proc.stdout.read() if proc.stdout else ''}")
        time.sleep(0.05)
    raise AssertionError(f"{what} not reached in {timeout}s")


def wait_for_event(events: Path, kind: str, proc: subprocess.Popen | None,
                   timeout: float = 180) -> dict[str, Any]:
    """The first `kind` event in `events` (events.jsonl) of the run `proc` is making."""
    found: list[dict[str, Any]] = []

    def done() -> bool:
        found[:] = [e for e in read_jsonl(events) if e["kind"] == kind] if events.exists() else []
        return bool(found)
    wait_until(done, f"a {kind} event", proc, timeout)
    return found[0]


def wait_for_step(metrics: Path, step: int, proc: subprocess.Popen | None,
                  timeout: float = 180) -> None:
    """Block until a running CLI process has logged `step` in metrics.jsonl."""
    def done() -> bool:
        rows = read_jsonl(metrics) if metrics.exists() else []
        return bool(rows) and rows[-1]["step"] >= step
    wait_until(done, f"step {step}", proc, timeout)


def wait_for_commit(run_dir: Path, proc: subprocess.Popen | None,
                    timeout: float = 180) -> None:
    """Block until a running CLI process has logged a `checkpoint_committed` event. Storage
    writes are asynchronous: on a loaded machine training runs steps past a save before it
    commits, so a test that needs a committed checkpoint must wait for it, not for a step."""
    events = run_dir / "events.jsonl"
    wait_until(lambda: events.exists() and any(
        e["kind"] == "checkpoint_committed" for e in read_jsonl(events)),
        "a committed checkpoint", proc, timeout)
