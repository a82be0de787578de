"""The recovery benchmark's report (bench/recovery.py): the medians of every row, the targets,
a line per run, the tables and the bar chart."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import fmt, ratio
from bench.recovery_rows import (
    FAULT_STEP,
    HANG_WAIT_S,
    OUTSIDE_KILL,
    PERSIST_EVERY,
    RUNNERS,
    STEPS,
    TARGET_FREEZE_DETECTION_S,
    TARGET_HANG_DETECTION_S,
    TARGET_KILL_RATIO,
    TARGET_NEXT_STEP_SLACK_S,
    TARGET_OUTSIDE_RATIOS,
    WORKERS,
)
from stalwart.report.summary import median


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


def _worst_detection(results: list[dict[str, Any]], fault: str, runner: str | None = None
                     ) -> tuple[float | None, int]:
    """The slowest detection over every round (None if a round detected nothing)."""
    rs = [r for r in results if r["fault"] == fault and runner in (None, r["runner"])]
    if not rs or any(r.get("detection_s") is None for r in rs):
        return None, len(rs)
    return max(r["detection_s"] for r in rs), len(rs)


def _target(target: str, value: float | None, ok: Callable[[float], bool],
            detail: str) -> dict[str, Any]:
    """A target's verdict: not met when nothing was measured."""
    return {"target": target, "value": value, "met": value is not None and ok(value),
            "detail": detail}


def verdicts(results: list[dict[str, Any]], med: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    if "kill" in med:
        rt = med["kill"]["ray-train"]["recovery_s"]
        for runner in ("stalwart", "stalwart+spare", "stalwart+spare/storage"):
            st = med["kill"][runner]["recovery_s"]
            out.append(_target(f"kill: Ray Train recovery_s / {runner} recovery_s >= "
                               f"{TARGET_KILL_RATIO:g} (medians)", ratio(rt, st),
                               lambda v: v >= TARGET_KILL_RATIO,
                               f"Ray Train {fmt(rt, '.2f')} s, {runner} {fmt(st, '.2f')} s"))
    if "hang" in med:
        rt = med["hang"]["ray-train"]
        theirs = (f"{fmt(rt['detection_s'], '.2f')} s" if rt["detected"]
                  else f"not detected within {HANG_WAIT_S:g} s")
        for runner in ("stalwart", "stalwart+spare"):
            worst, n = _worst_detection(results, "hang", runner)
            out.append(_target(f"hang: {runner} detects the hang within "
                               f"{TARGET_HANG_DETECTION_S:g} s (every round)", worst,
                               lambda v: v <= TARGET_HANG_DETECTION_S,
                               f"worst detection {fmt(worst, '.2f')} s over {n} round(s); "
                               f"Ray Train: {theirs}"))
    if "freeze" in med:
        worst, n = _worst_detection(results, "freeze")
        recovery = med["freeze"]["stalwart-elastic"]["recovery_s"]
        out.append(_target(f"freeze: stalwart notices a frozen node within "
                           f"{TARGET_FREEZE_DETECTION_S:g} s (every round)", worst,
                           lambda v: v <= TARGET_FREEZE_DETECTION_S,
                           f"worst detection {fmt(worst, '.2f')} s over {n} round(s); "
                           f"median recovery {fmt(recovery, '.2f')} s"))
    if OUTSIDE_KILL in med:
        out += outside_verdicts(med[OUTSIDE_KILL])
    return [*out, _lost_steps_verdict(results)]


def _lost_steps_verdict(results: list[dict[str, Any]]) -> dict[str, Any]:
    stalwart = [r for r in results if r["system"] == "stalwart"]
    bad = [r for r in stalwart if r.get("lost_steps") is None or r.get("lost_steps_bound") is None
           or r["lost_steps"] > r["lost_steps_bound"]]
    return {
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
                            for r in stalwart)}


def outside_verdicts(rows: dict[str, Any], stalwart: str = "stalwart+spare"
                     ) -> list[dict[str, Any]]:
    """The outside-kill targets, on the medians of each row: stalwart's kill -> next completed
    step within one normal step (of its own run, before the kill) + the slack, and each peer's
    time at least its ratio over stalwart's."""
    st, normal = rows[stalwart]["recovery_s"], rows[stalwart]["normal_step_s"]
    bound = normal + TARGET_NEXT_STEP_SLACK_S if normal is not None else None
    out = [_target(f"{OUTSIDE_KILL}: stalwart kill -> next completed step <= one normal step "
                   f"+ {TARGET_NEXT_STEP_SLACK_S:g} s (medians)", st,
                   lambda v: bound is not None and v <= bound,
                   f"{fmt(st, '.2f')} s against {fmt(bound, '.2f')} s (normal step "
                   f"{fmt(normal, '.3f')} s)")]
    for peer, target in TARGET_OUTSIDE_RATIOS.items():
        theirs, label = rows[peer]["recovery_s"], rows[peer]["label"]
        out.append(_target(f"{OUTSIDE_KILL}: {label} / stalwart kill -> next completed step "
                           f">= {target:g}x (medians)", ratio(theirs, st),
                           lambda v, t=target: v >= t,
                           f"{label} {fmt(theirs, '.2f')} s, stalwart {fmt(st, '.2f')} s"))
    return out


def notes(results: list[dict[str, Any]], health: dict[str, Any]) -> list[str]:
    """What a reader of the figures needs to know about how they were taken."""
    period, threshold = health["health_check_period_ms"], health["health_check_failure_threshold"]
    out = [
        "Ray Train runs with commit_checkpoints=True: rank 0 waits until each checkpoint is "
        "registered by the controller, so that Ray Train restores from its newest checkpoint "
        "(the plain loop of its docs loses the step-20 checkpoint to a registration race "
        "when the fault comes before the controller's next 2 s poll).",
        "Ray Train detection_s is its controller's FailurePolicy decision (controller_failure_s); "
        "restart_s is the first train-loop start of a new attempt (run_raytrain's detection_s).",
        f"Ray Train does not detect the hang: its worker health check times out after "
        f"600 s by default and the torch process group after 1800 s; the harness waited "
        f"{HANG_WAIT_S:g} s, then stopped the run.",
        "Node loss: both sides on a local ray.cluster_utils.Cluster (a 0-CPU head, one 1-CPU "
        f"node per worker) with Ray's default node health checks (health_check_period_ms="
        f"{period}, failure_threshold={threshold}); the stalwart cluster also sets "
        "worker_niceness=0. A replacement 1-CPU node is added as soon as the GCS reports the "
        "lost node dead, on both sides.",
        f"{OUTSIDE_KILL}: the harness SIGKILLs rank 1's process by its PID once step "
        f"{FAULT_STEP} is in the system's own step log (read every 50 ms), so the kill lands "
        "a step or two later on every side; the kill time is read just before the signal. "
        "torchrun: its elastic agent's defaults (--monitor-interval 0.1) with --max-restarts 3.",
        "stalwart's fault time is the controller's acknowledgement of the fault (the worker "
        "carries it out right after); Ray Train's is written by the worker just before it.",
        "freeze: stalwart only, on the node-loss cluster. A frozen raylet still accepts "
        f"connections and Ray's node health check gives up on it after about "
        f"{period * threshold / 1000:g} s; stalwart's rule is its node agent, "
        "failure.node_silent_timeout_s late while the other nodes' agents answer.",
    ]
    for r in results:
        if (r["runner"] == "stalwart-elastic" and r["fault"] == "node" and r.get("completed")
                and not any(e["reason"] == "grow" for e in r.get("resized", []))):
            why = ("before the GCS reported the lost node dead (Ray's default node health "
                   "checks), so no replacement node was added"
                   if r.get("replacement_added_s") is None else
                   f"though a replacement node was added {r['replacement_added_s']:.1f} s "
                   "after the fault")
            out.append(
                f"round {r['round'] + 1}, node: stalwart detected the loss by probing the "
                f"raylet, shrank to 1 worker and finished the run "
                f"{fmt(r.get('finished_s'), '.1f')} s after the fault on the surviving "
                f"worker, {why}: it did not grow back (the grow path is what "
                "tests/ray/test_cli_node_loss.py covers, on a longer run).")
    return out


def one_line(r: dict[str, Any]) -> str:
    tag = f"r{r['round']}-{r['fault']}-{r['runner']}"
    if r.get("error"):
        return f"  {tag}: FAILED ({r['error']})"
    extra = ""
    if r["system"] == "ray-train" and r["fault"] == "hang" and not r["detected"]:
        extra = f"  (not detected within {HANG_WAIT_S:g} s)"
    if r.get("resized"):
        extra += "  resized " + ", ".join(f"{e['old_world_size']}->{e['new_world_size']} "
                                          f"({e['reason']})" for e in r["resized"])
    if r.get("missing_events"):
        extra += f"  MISSING EVENTS: {', '.join(r['missing_events'])}"
    if not r.get("completed"):
        extra += "  NOT COMPLETED"
    lost = fmt(r["lost_steps"], "3d")
    if r["fault"] != OUTSIDE_KILL:
        return (f"  {tag}: detection {fmt(r['detection_s'], '6.2f')} s, recovery "
                f"{fmt(r['recovery_s'], '6.2f')} s, lost {lost} steps, load "
                f"{r['load_before']:.2f}{extra}")
    if r.get("restarts", 0) > 1:  # torchrun: a restart that failed too
        extra += f"  {r['restarts']} restarts for one kill"
    return (f"  {tag}: killed pid {r.get('killed_pid')} after step "
            f"{r.get('kill_after_step_logged')} was logged; kill -> next completed step "
            f"{fmt(r['recovery_s'], '6.2f')} s (normal step {fmt(r.get('normal_step_s'), '.3f')}"
            f" s), lost {lost} steps (last {r.get('last_step_of_killed_world')}, resumed from "
            f"{r.get('resumed_from')}), load {r['load_before']:.2f}{extra}")


def print_table(med: dict[str, Any]) -> None:
    head = (f"{'fault':<12} | {'system':<30} | {'detect s':>8} | {'restart s':>9} | "
            f"{'restore s':>9} | {'recover s':>9} | {'lost':>4} | {'from':>4} | {'bound':>5} | "
            f"{'source':<8} | {'ok':>5}")
    print("\nrecovery (medians)\n" + head + "\n" + "-" * len(head))
    for fault, rows in med.items():
        for runner, m in rows.items():
            detect = fmt(m["detection_s"], "8.2f")
            if runner == "ray-train" and fault == "hang" and not m["detected"]:
                detect = f">{HANG_WAIT_S:g} n/d".rjust(8)
            source = ",".join(x for x in m.get("sources", []) if x != "None") or "-"
            print(f"{fault:<12} | {m['label']:<30} | {detect} | {fmt(m['restart_s'], '9.2f')} | "
                  f"{fmt(m.get('restore_s'), '9.2f')} | {fmt(m['recovery_s'], '9.2f')} | "
                  f"{fmt(m['lost_steps'], '4.0f')} | {fmt(m['restored_from_step'], '4.0f')} | "
                  f"{fmt(m['lost_steps_bound'], '5.0f')} | {source:<8} | "
                  f"{m['completed']}/{m['runs']:<3}")
    print("-" * len(head))
    print("detect: fault -> the controller decides it is a failure (n/d: not detected); "
          "restart: fault -> the new world is up;\nrestore: the load of the checkpoint "
          "(memory or storage); recover: fault -> the first step completed after it;\n"
          "lost: steps trained again; from: step restored from; bound: the most lost steps "
          f"allowed (0 with the memory tier, else steps since the last storage checkpoint due, "
          f"every {PERSIST_EVERY});\nsource: where the restore came from; ok: runs that "
          f"completed all {STEPS} steps")


def print_outside(med: dict[str, Any], stalwart: str = "stalwart+spare") -> None:
    """Kill from outside -> next completed step, side by side, each over stalwart's."""
    rows = med[OUTSIDE_KILL]
    st = rows[stalwart]["recovery_s"]
    head = (f"{'system':<30} | {'kill -> next step s':>19} | {'normal step s':>13} | "
            f"{'lost':>4} | {'from':>4} | {'x stalwart':>10} | {'ok':>5}")
    print(f"\n{OUTSIDE_KILL}: SIGKILL of rank 1's process by the harness after step {FAULT_STEP} "
          "was logged (medians)\n" + head + "\n" + "-" * len(head))
    for m in rows.values():
        print(f"{m['label']:<30} | {fmt(m['recovery_s'], '19.2f')} | "
              f"{fmt(m['normal_step_s'], '13.3f')} | {fmt(m['lost_steps'], '4.0f')} | "
              f"{fmt(m['restored_from_step'], '4.0f')} | "
              f"{fmt(ratio(m['recovery_s'], st), '10.1f')} | {m['completed']}/{m['runs']:<3}")
    print("-" * len(head))
    print("kill -> next step: from the harness's SIGKILL to the end of the first step completed "
          "by the restarted world (each system's own step log);\nnormal step: median step "
          "time of the same run before the kill; lost: the killed world's last step - the step "
          "resumed from")


COLORS = {"stalwart": "#1f77b4", "stalwart+spare": "#6baed6",
          "stalwart+spare/storage": "#9e9ac8", "stalwart-elastic": "#08519c",
          "stalwart-elastic/storage": "#756bb1", "ray-train": "#ff7f0e", "torchrun": "#2ca02c"}
LABELS = {"stalwart": "stalwart (memory tier)",
          "stalwart+spare": "stalwart + warm spare (memory tier)",
          "stalwart+spare/storage": "stalwart + warm spare, storage only",
          "stalwart-elastic": "stalwart, shrinks on node loss (memory tier)",
          "stalwart-elastic/storage": "stalwart, shrinks, storage only",
          "ray-train": "Ray Train TorchTrainer", "torchrun": "torchrun --max-restarts"}
FAULT_NAMES = {"kill": "kill (SIGKILL)", "hang": "hang (SIGSTOP)", "node": "node loss",
               "freeze": "frozen node", OUTSIDE_KILL: "SIGKILL from outside"}


def _bars(ax: Any, med: dict[str, Any], key: str, title: str) -> None:
    """One panel: a bar per row and fault, log scale."""
    faults = list(med)
    width = 0.8 / max(len(med[f]) for f in faults)
    labelled: set[str] = set()
    for j, fault in enumerate(faults):
        for i, (runner, m) in enumerate(med[fault].items()):
            x, color, value = j - width * len(med[fault]) / 2 + width * (i + 0.5), \
                COLORS[runner], m[key]
            if value is None and fault != "hang":
                continue  # not measured for this row (torchrun has no detection event)
            if value is None:
                # Not detected / not recovered within the harness's wait: a hollow bar.
                ax.bar(x, HANG_WAIT_S, width, color="none", edgecolor=color, hatch="//")
                what = "detected" if key == "detection_s" else "recovered"
                ax.text(x, HANG_WAIT_S * 1.1, f"not {what}\nwithin {HANG_WAIT_S:g} s",
                        ha="center", va="bottom", fontsize=7)
                continue
            ax.bar(x, max(value, 1e-3), width, color=color,
                   label=None if runner in labelled else LABELS[runner])
            labelled.add(runner)
            ax.text(x, max(value, 1e-3) * 1.1, f"{value:.2g}", ha="center", va="bottom",
                    fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(1e-2, HANG_WAIT_S * 8)
    ax.set_xticks(range(len(faults)), [FAULT_NAMES[f] for f in faults])
    ax.set_ylabel("seconds (log scale)")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3, which="both")


def plot(png: str, med: dict[str, Any]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no chart")
        return None
    faults = list(med)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    _bars(axes[0], med, "detection_s", "detection (fault -> failure decided)")
    _bars(axes[1], med, "recovery_s", "recovery (fault -> first step after)")
    # Each target as a line over its own group of bars.
    if "kill" in med and med["kill"]["ray-train"]["recovery_s"]:
        j = faults.index("kill")
        axes[1].hlines(med["kill"]["ray-train"]["recovery_s"] / TARGET_KILL_RATIO, j - 0.45,
                       j + 0.45, color="black", ls=":", lw=1.2,
                       label=f"kill target: Ray Train / {TARGET_KILL_RATIO:g}")
    if "hang" in med:
        j = faults.index("hang")
        axes[0].hlines(TARGET_HANG_DETECTION_S, j - 0.45, j + 0.45, color="black", ls="--",
                       lw=1.2, label=f"hang target: {TARGET_HANG_DETECTION_S:g} s")
    legend: dict[str, Any] = {}  # one legend for both panels, below them
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center",
               ncol=min(4, len(legend)), fontsize=8, frameon=False)
    models = [m for m, here in (("tiny GPT", any(f != OUTSIDE_KILL for f in faults)),
                                ("SIGKILL from outside: the reference GPT",
                                 OUTSIDE_KILL in faults)) if here]
    fig.suptitle(f"Recovery on the reference task ({'; '.join(models)}; {WORKERS} workers, "
                 f"fault on rank 1 at step {FAULT_STEP}), medians", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png
