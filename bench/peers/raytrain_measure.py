"""Ray Train's side of the recovery benchmark, the measuring half: when the fault came, when
Ray Train noticed it (its controller's log), restarted, restored and trained again, from the
files the workers left in workdir (bench/peers/raytrain_worker.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.peers.raytrain_worker import CHECKPOINTS_FILE, FAULT_FILE, STEPS_FILE
from stalwart.core.events import read_jsonl


def read_fault(workdir: Path) -> dict[str, Any] | None:
    """What rank 1 wrote just before its fault; None before it (or while it is written)."""
    try:
        return json.loads((workdir / FAULT_FILE).read_text())
    except (OSError, ValueError):
        return None


def session_dir() -> str | None:
    try:
        import ray

        return ray._private.worker._global_node.get_session_dir_path()
    except Exception:
        return None


def controller_events(session_dir: str | None, fault_time: float | None,
                       abort_time: float | None) -> dict[str, Any]:
    """From Ray Train's controller log: when it decided on the failure, and what came after.

    controller_failure_s: fault -> the controller's FailurePolicy decision (Ray Train's own
    detection, including the up to health_check_interval_s until its next poll); only a
    decision before the harness aborted the run (abort_time) counts.
    """
    out: dict[str, Any] = {"controller_failure_s": None, "controller_events": []}
    if session_dir is None or fault_time is None:
        return out
    for log in sorted(Path(session_dir, "logs", "train").glob("ray-train-sys-controller-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
                t = row["timestamp_ns"] / 1e9
            except (ValueError, KeyError, TypeError):
                continue
            if t < fault_time:
                continue
            msg = row.get("message", "").splitlines()
            first = " ".join(m.strip() for m in msg[:2]) if msg else ""
            out["controller_events"].append([round(t - fault_time, 3), first[:140]])
            if (out["controller_failure_s"] is None and first.startswith("[FailurePolicy]")
                    and (abort_time is None or t < abort_time)):
                out["controller_failure_s"] = t - fault_time
    out["controller_events"].sort()
    return out


def analyse(workdir: Path, attempts: list[dict[str, Any]], info: dict[str, Any] | None,
             fault: str, steps: int, node_info: dict[str, Any]) -> dict[str, Any]:
    rows = read_jsonl(workdir / STEPS_FILE)
    ckpts = read_jsonl(workdir / CHECKPOINTS_FILE)
    starts = [a for a in attempts if a["event"] == "start" and not a["stopping"]]
    readies = [a for a in attempts if a["event"] == "ready"]
    out: dict[str, Any] = {
        "fault_time": None, "detection_s": None, "recovery_s": None, "lost_steps": None,
        "restored_from_step": None, "completed": False,
        "final_step": max((r["step"] for r in rows), default=0),
        "steps_before_fault": None, "attempt_starts": sorted({round(a["time"], 3)
                                                              for a in starts}),
        "torch_pg_timeout_s": next((a["pg_timeout_s"] for a in readies), None),
        "step_times": [[r["step"], r["time"]] for r in rows],
        "notes": ["detection_s is an upper bound of detection: fault -> the first train-loop "
                  "start of a new attempt, so it includes tearing down the old worker group "
                  "and starting the new one (actors and process group).",
                  "recovery_s: fault -> the first step completed after the fault (rank 0)."],
    }
    ft = info["time"] if info is not None else float("inf")
    # Before/after the fault by process, not by clock: rank 0 of the faulty attempt may log
    # its last step a few ms after rank 1 has already started the next one and faulted.
    old = {a["pid"] for a in starts if a["time"] < ft}
    first_nodes = {a["rank"]: a["node_id"] for a in starts if a["pid"] in old}
    out["first_attempt_nodes"] = first_nodes
    if info is None:
        out["notes"].append("the fault was never injected")
        return out
    out["fault_time"] = ft
    out["steps_before_fault"] = max((r["step"] for r in rows if r["pid"] in old), default=0)
    out["last_checkpoint_before_fault"] = max((c["step"] for c in ckpts if c["pid"] in old),
                                              default=None)
    later = [a for a in starts if a["pid"] not in old]
    if later:
        out["detection_s"] = min(a["time"] for a in later) - ft
    restored = [a for a in readies if a["pid"] not in old and a["rank"] == 0]
    if restored:
        first = min(restored, key=lambda a: a["time"])
        out["restored_from_step"] = first["restored_from"] or 0
        out["lost_steps"] = out["steps_before_fault"] - out["restored_from_step"]
    after = [r for r in rows if r["pid"] not in old]
    if after:
        first_row = min(after, key=lambda r: r["time"])
        out["recovery_s"] = first_row["time"] - ft
        out["first_step_after_fault"] = first_row["step"]
    if fault == "node":
        out["ranks_on_distinct_nodes"] = len(set(first_nodes.values())) == len(first_nodes) > 1
        out["killed_node_id"] = info.get("node_id")
        out["node_dead_s"] = (node_info["dead_time"] - ft) if "dead_time" in node_info else None
        out["replacement_added_s"] = (node_info["replacement_added"] - ft
                                      if "replacement_added" in node_info else None)
        out["replace_node_after"] = node_info.get("replace_node_after")
    return out
