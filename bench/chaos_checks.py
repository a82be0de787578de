"""The chaos soak's checks of a run, from its run directory: it finished, its final weights equal
the reference's bit for bit, its checkpoints verify and export, every fault fired was recorded."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from bench import common
from stalwart.core import events as ev
from stalwart.core.events import read_events, read_jsonl


def last_logged_step(run_dir: Path) -> int:
    """The newest step in metrics.jsonl or committed (a commit may come before those rows)."""
    steps = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")]
    steps += [e["step"] for e in read_jsonl(run_dir / "events.jsonl")
              if e["kind"] == "checkpoint_committed"]
    return max(steps, default=0)


def worker_fault_record(row: dict[str, Any], events: list[ev.Event]
                        ) -> ev.Failure | ev.Resized | None:
    """The first `failure` after a worker fault naming its process, or its rank in the world
    of that moment (a recovery may renumber survivors); for a SIGTERM also a `preempted`
    `resized` of a world that held the process."""
    world: ev.WorkersStarted | None = None
    for e in events:
        if isinstance(e, ev.WorkersStarted):
            world = e
        if e.time < row["time"] or world is None:
            continue
        if isinstance(e, ev.Failure) and row["pid"] in e.pids:
            return e  # named by its process: also a world that failed while forming
        if (rank := next((w.rank for w in world.workers if w.pid == row["pid"]), None)) is None:
            continue
        if isinstance(e, ev.Failure) and rank in e.ranks:
            return e
        if row["kind"] == "term" and isinstance(e, ev.Resized) and e.reason == "preempted":
            return e
    return None


def check_faults(run_dir: Path, fired: list[dict[str, Any]]) -> dict[str, Any]:
    events = read_events(run_dir / "events.jsonl")
    rows = read_jsonl(run_dir / "metrics.jsonl")
    for row in (r for r in fired if r.get("fired")):
        if row["kind"] == "driver":
            resumed = next((e for e in events[row["events_before_resume"]:]  # resumed's
                            if isinstance(e, ev.Resumed)), None)
            row["recorded"] = resumed is not None
            if resumed is not None:
                row["resumed_from"] = resumed.from_step
                row["lost_steps"] = max(0, row["step"] - resumed.from_step)
                # Recovery: from the kill to the first step the resumed run logged.
                if after := [r["time"] for r in rows if r["time"] > resumed.time]:
                    row["recovery_s"] = round(after[0] - row["time"], 2)
        else:
            failure = worker_fault_record(row, events)
            row["recorded"] = failure is not None
            if failure is not None:
                row["recorded_as"] = (f"failure {failure.failure_kind}"
                                      if isinstance(failure, ev.Failure)
                                      else f"resized {failure.reason}")
                row["detection_s"] = round(failure.time - row["time"], 2)
    drivers = [r for r in fired if r["kind"] == "driver"]
    driver_recovery = [r["recovery_s"] for r in drivers if "recovery_s" in r]
    recovered = [e for e in events if isinstance(e, ev.Recovered)]
    return {
        "fired": sum(1 for r in fired if r.get("fired")),
        "not_fired": sum(1 for r in fired if r.get("fired") is False),
        "detected": sum(bool(r.get("recorded")) for r in fired),
        "failures": sum(isinstance(e, ev.Failure) for e in events),
        "recoveries": len(recovered),
        "lost_steps": sum(e.lost_steps for e in recovered)
        + sum(r.get("lost_steps", 0) for r in drivers),
        "recovery_s": round(sum(e.recovery_s for e in recovered) + sum(driver_recovery), 2),
        "recovery_s_each": [round(e.recovery_s, 2) for e in recovered] + driver_recovery,
        "restored_from": [e.source for e in recovered],
    }


def check_finished(run_dir: Path, steps: int, exit_codes: list[int]) -> dict[str, Any]:
    finished = [e for e in read_events(run_dir / "events.jsonl") if isinstance(e, ev.Finished)]
    ok = bool(finished) and finished[-1].step == steps and exit_codes[-1] == 0
    return {"finished": ok, "final_step": finished[-1].step if finished else None,
            "exit_codes": exit_codes}


def export(run_dir: Path, out: Path, step: int | None = None) -> str | None:
    """`stalwart export`; None when it worked, else the tail of its output."""
    cmd = [str(common.STALWART), "export", str(run_dir), "--out", str(out)]
    proc = subprocess.run(cmd + (["--step", str(step)] if step is not None else []),
                          capture_output=True, text=True, cwd=common.ROOT,
                          env=common.child_env(), timeout=300)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return None if proc.returncode == 0 else lines[-1] if lines else f"exit {proc.returncode}"


def weights_equal(a: Path, b: Path) -> tuple[bool, str]:
    """(bit for bit equal, what differs) of two exported .pt files: dtypes, shapes and bytes
    (torch.equal would take -0.0 for 0.0, and a NaN for unequal to itself)."""
    import torch

    x, y = torch.load(a), torch.load(b)
    if x.keys() != y.keys():
        return False, f"keys differ: {sorted(set(x) ^ set(y))[:4]}"
    if differ := [k for k in x if not _same_bits(x[k], y[k])]:
        worst = max(differ, key=lambda k: _max_diff(x[k], y[k]))
        return False, (f"{len(differ)}/{len(x)} tensors differ, most in {worst}: "
                       f"{_max_diff(x[worst], y[worst]):.3g}")
    return True, f"{len(x)} tensors equal"


def _same_bits(s: Any, t: Any) -> bool:
    import torch

    return s.dtype == t.dtype and s.shape == t.shape and torch.equal(
        *(u.detach().contiguous().reshape(-1).view(torch.uint8) for u in (s, t)))


def _max_diff(s: Any, t: Any) -> float:
    if s.shape != t.shape:
        return float("inf")
    return float((s.double() - t.double()).abs().max()) if s.numel() else 0.0


def check_checkpoints(run_dir: Path, scratch: Path) -> dict[str, Any]:
    """Every committed checkpoint in the run's storage verifies and exports."""
    from stalwart.checkpointing.errors import CheckpointError
    from stalwart.checkpointing.storage.catalog import list_step_dirs, read_checkpoint, verify
    from stalwart.checkpointing.storage.signing import CheckpointTrust, load_key

    url = str((run_dir / "checkpoints").resolve())
    dirs, problems = list_step_dirs(url), []
    committed = [s for s, done in dirs if done]
    trust = CheckpointTrust(key=load_key(None))  # the key the soak's runs signed with
    for step in committed:
        try:
            verify(read_checkpoint(url, step), trust)
        except CheckpointError as exc:
            problems.append(f"step {step}: {exc}")
            continue
        out = scratch / f"step{step}.pt"
        err = export(run_dir, out, step)
        out.unlink(missing_ok=True)
        if err:
            problems.append(f"step {step}: export: {err}")
    return {"checkpoints": committed, "uncommitted_dirs": [s for s, done in dirs if not done],
            "checkpoints_ok": not problems and bool(committed), "checkpoint_problems": problems}
