"""The recovery benchmark's measurements (bench/recovery.py): one stalwart run's numbers from
its run directory (typed events and metrics rows), the medians of every row, and the targets."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from bench import common
from bench.recovery_setup import (
    HANG_WAIT_S,
    NODE_FAULTS,
    OUTSIDE_KILL,
    PERSIST_EVERY,
    RUNNERS,
    TARGET_FREEZE_DETECTION_S,
    TARGET_HANG_DETECTION_S,
    TARGET_KILL_RATIO,
    TARGET_NEXT_STEP_SLACK_S,
    TARGET_OUTSIDE_RATIOS,
)
from stalwart.core import events as ev
from stalwart.core.events import read_events, read_metrics
from stalwart.report.summary import median

E = TypeVar("E", bound=ev.Event)


def analyse_stalwart(run_dir: Path, fault: str, memory_tier: bool) -> dict[str, Any]:
    """The measurements of one stalwart run, from its events.jsonl and metrics.jsonl."""
    events = read_events(run_dir / "events.jsonl")
    rows = read_metrics(run_dir / "metrics.jsonl")
    kinds = [e.kind for e in events]

    def first(cls: type[E]) -> E | None:
        return next((e for e in events if isinstance(e, cls)), None)

    injected, failure = first(ev.FaultInjected), first(ev.Failure)
    recovered = first(ev.Recovered)
    out: dict[str, Any] = {
        "events": [e.to_row() for e in events], "event_kinds": kinds,
        "fault_time": None, "detected": failure is not None, "failure_kind": None,
        "detection_s": None, "restart_s": None, "recovery_s": None,
        "recovery_s_from_metrics": None, "lost_steps": None, "restored_from_step": None,
        "source": None, "phases": None, "steps_before_fault": None,
        "last_checkpoint_before_fault": None, "lost_steps_bound": None,
        "resized": [{"old_world_size": e.old_world_size, "new_world_size": e.new_world_size,
                     "reason": e.reason, "step": e.step, "time": e.time}
                    for e in events if isinstance(e, ev.Resized)],
        "world_sizes": sorted({r.world_size for r in rows}),
        "final_step": max((r.step for r in rows), default=0),
        "finished": bool(kinds) and kinds[-1] == "finished",
        "missing_events": [k for k, e in (("fault_injected", injected), ("failure", failure),
                                          ("recovered", recovered)) if e is None],
    }
    if fault in NODE_FAULTS and not out["resized"]:
        out["missing_events"].append("resized")
    if not kinds or kinds[-1] != "finished":
        out["missing_events"].append("finished (last event: "
                                     f"{kinds[-1] if kinds else 'none'})")
    if injected is None:
        return out
    ft = injected.time
    out["fault_time"] = ft
    out["fault_rank"] = injected.rank
    started = [e for e in events if isinstance(e, ev.WorkersStarted)]
    if fault in NODE_FAULTS and started:
        workers = started[0].workers
        if injected.rank < len(workers):
            out["killed_node_id"] = workers[injected.rank].node_id
        out["first_world_nodes"] = {w.rank: w.node_id for w in workers}
    committed = [e.step for e in events[:events.index(injected)]
                 if isinstance(e, ev.CheckpointCommitted)]
    out["last_checkpoint_before_fault"] = max(committed, default=None)
    if failure is not None:
        out["failure_kind"] = failure.failure_kind
        out["detection_s"] = failure.detection_s
        out["steps_before_fault"] = failure.step
        # With the memory tier: none (every completed step is in memory); without it, the
        # steps since the last storage checkpoint due (every persist_every steps).
        out["lost_steps_bound"] = 0 if memory_tier else failure.step % PERSIST_EVERY
        out["failure"] = {k: v for k, v in failure.to_row().items() if k != "message"}
    if kinds and kinds[-1] == "finished":
        out["finished_s"] = events[-1].time - ft
    later_starts = [e.time for e in started if e.time > ft]
    if later_starts:
        out["restart_s"] = min(later_starts) - ft
    if recovered is not None:
        out["recovery_s"] = recovered.recovery_s
        out["lost_steps"] = recovered.lost_steps
        out["restored_from_step"] = recovered.from_step
        out["source"] = recovered.source
        out["phases"] = recovered.phases
        out["restore_s"] = recovered.phases.get("restore")
        out["world_size_after"] = recovered.world_size
        # The same from metrics.jsonl: fault -> the first row of the restored step + 1.
        again = [r.time for r in rows if r.time > ft and r.step == recovered.from_step + 1]
        if again:
            out["recovery_s_from_metrics"] = min(again) - ft
    return out


def summarise(results: list[dict[str, Any]], faults: list[str]) -> dict[str, Any]:
    """Medians per fault and runner."""
    out: dict[str, Any] = {}
    for fault in faults:
        out[fault] = {}
        for runner, label in RUNNERS[fault]:
            rs = [r for r in results if r["fault"] == fault and r["runner"] == runner]
            out[fault][runner] = {
                "label": label, "runs": len(rs),
                "detected": sum(bool(r.get("detected")) for r in rs),
                "completed": sum(bool(r.get("completed")) for r in rs),
                **{k: median([r.get(k) for r in rs])
                   for k in ("detection_s", "restart_s", "recovery_s", "restore_s", "lost_steps",
                             "restored_from_step", "lost_steps_bound", "normal_step_s")},
                "sources": sorted({str(r.get("source")) for r in rs}),
                "max_detection_s": max((r["detection_s"] for r in rs
                                        if r.get("detection_s") is not None), default=None),
            }
    return out


def verdicts(results: list[dict[str, Any]], med: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    if "kill" in med:
        rt = med["kill"]["ray-train"]["recovery_s"]
        for runner in ("stalwart", "stalwart+spare", "stalwart+spare/storage"):
            st = med["kill"][runner]["recovery_s"]
            ratio = rt / st if rt is not None and st else None
            out.append({
                "target": f"kill: Ray Train recovery_s / {runner} recovery_s >= "
                          f"{TARGET_KILL_RATIO:g} (medians)",
                "value": ratio, "met": ratio is not None and ratio >= TARGET_KILL_RATIO,
                "detail": f"Ray Train {common.fmt(rt, '.2f')} s, {runner} "
                          f"{common.fmt(st, '.2f')} s"})
    if "hang" in med:
        for runner in ("stalwart", "stalwart+spare"):
            rs = [r for r in results if r["fault"] == "hang" and r["runner"] == runner]
            worst = (max(r["detection_s"] for r in rs) if rs and all(
                r.get("detection_s") is not None for r in rs) else None)
            out.append({
                "target": f"hang: {runner} detects the hang within "
                          f"{TARGET_HANG_DETECTION_S:g} s (every round)",
                "value": worst,
                "met": worst is not None and worst <= TARGET_HANG_DETECTION_S,
                "detail": f"worst detection {common.fmt(worst, '.2f')} s over {len(rs)} "
                          f"round(s); Ray Train: " + (
                              "not detected within "
                              f"{HANG_WAIT_S:g} s" if not med["hang"]["ray-train"]["detected"]
                              else f"{common.fmt(med['hang']['ray-train']['detection_s'], '.2f')}"
                                   " s")})
    if "freeze" in med:
        rs = [r for r in results if r["fault"] == "freeze"]
        worst = (max(r["detection_s"] for r in rs) if rs and all(
            r.get("detection_s") is not None for r in rs) else None)
        recovery = med["freeze"]["stalwart-elastic"]["recovery_s"]
        out.append({
            "target": f"freeze: stalwart notices a frozen node within "
                      f"{TARGET_FREEZE_DETECTION_S:g} s (every round)",
            "value": worst, "met": worst is not None and worst <= TARGET_FREEZE_DETECTION_S,
            "detail": f"worst detection {common.fmt(worst, '.2f')} s over {len(rs)} round(s); "
                      f"median recovery {common.fmt(recovery, '.2f')} s"})
    if OUTSIDE_KILL in med:
        out += outside_verdicts(med[OUTSIDE_KILL])
    stalwart = [r for r in results if r["system"] == "stalwart"]
    bad = [r for r in stalwart if r.get("lost_steps") is None or r.get("lost_steps_bound") is None
           or r["lost_steps"] > r["lost_steps_bound"]]
    out.append({
        "target": "lost steps: 0 with the memory tier, <= steps since the last storage "
                  f"checkpoint due (checkpoint.persist_every={PERSIST_EVERY}) without; every "
                  "stalwart run",
        "value": max((r["lost_steps"] for r in stalwart if r.get("lost_steps") is not None),
                     default=None),
        "met": bool(stalwart) and not bad,
        "detail": "; ".join(f"r{r['round']}-{r['fault']}-{r['runner']}: lost "
                            f"{r.get('lost_steps')} > bound {r.get('lost_steps_bound')}"
                            for r in bad) or
                  ", ".join(f"{r['fault']}/{r['runner']} {r['lost_steps']}<={r['lost_steps_bound']}"
                            for r in stalwart)})
    return out


def outside_verdicts(rows: dict[str, Any], stalwart: str = "stalwart+spare"
                     ) -> list[dict[str, Any]]:
    """The outside-kill targets, on the medians of each row: stalwart's kill -> next completed
    step within one normal step (of its own run, before the kill) + the slack, and each peer's
    time at least its ratio over stalwart's."""
    st = rows[stalwart]["recovery_s"]
    normal = rows[stalwart]["normal_step_s"]
    bound = normal + TARGET_NEXT_STEP_SLACK_S if normal is not None else None
    out = [{
        "target": f"{OUTSIDE_KILL}: stalwart kill -> next completed step <= one normal step + "
                  f"{TARGET_NEXT_STEP_SLACK_S:g} s (medians)",
        "value": st, "met": st is not None and bound is not None and st <= bound,
        "detail": f"{common.fmt(st, '.2f')} s against {common.fmt(bound, '.2f')} s (normal "
                  f"step {common.fmt(normal, '.3f')} s)"}]
    for peer, target in TARGET_OUTSIDE_RATIOS.items():
        theirs = rows[peer]["recovery_s"]
        ratio = theirs / st if theirs is not None and st else None
        out.append({
            "target": f"{OUTSIDE_KILL}: {rows[peer]['label']} / stalwart kill -> next "
                      f"completed step >= {target:g}x (medians)",
            "value": ratio, "met": ratio is not None and ratio >= target,
            "detail": f"{rows[peer]['label']} {common.fmt(theirs, '.2f')} s, stalwart "
                      f"{common.fmt(st, '.2f')} s"})
    return out
