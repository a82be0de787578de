"""Recovery: how fast stalwart, Ray Train's TorchTrainer and torchrun recover from a fault."""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import common
from bench import recovery_rows as rows
from bench.common import fmt, ratio
from bench.harness import OUTSIDE_KILL
from stalwart.report.summary import median

OUTSIDE_STALWART = "stalwart+spare"  # the stalwart row of the outside-kill table

def parse_args() -> argparse.Namespace:
    p = common.parser(__doc__, __spec__, "recovery.json")
    p.add_argument("--faults", nargs="+", choices=rows.FAULTS, default=list(rows.FAULTS),
                   help="faults to measure (default: all)")
    common.add_config_args(p, sets=False)
    p.add_argument("--png", default=str(common.RESULTS / "recovery.png"), help="bar chart")
    common.add_run_args(p, 600.0, rounds=1)
    args = p.parse_args()
    args.faults = [f for f in rows.FAULTS if f in args.faults]
    return args


def summarise(results: list[dict[str, Any]], faults: list[str]) -> dict[str, Any]:
    """Medians per fault and runner."""
    return {fault: {runner: _side(label, [r for r in results
                                          if r["fault"] == fault and r["runner"] == runner])
                    for runner, label in rows.RUNNERS[fault]} for fault in faults}


def _side(label: str, rs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"label": label, "runs": len(rs), **{k: sum(bool(r.get(k)) for r in rs)
                                                for k in ("detected", "completed")},
            **{k: median([r.get(k) for r in rs])
               for k in ("detection_s", "restart_s", "recovery_s", "restore_s", "lost_steps",
                         "restored_from_step", "lost_steps_bound", "normal_step_s",
                         "first_step_ratio")},
            "sources": sorted({str(r.get("source")) for r in rs}),
            "max_detection_s": max((r["detection_s"] for r in rs
                                    if r.get("detection_s") is not None), default=None)}


def _detection_target(results: list[dict[str, Any]], fault: str, runner: str | None,
                      what: str, limit: float, detail: str) -> dict[str, Any]:
    """`what` within limit s in every round: the slowest detection (None: a round had none)."""
    rs = [r for r in results if r["fault"] == fault and runner in (None, r["runner"])]
    worst = (None if not rs or any(r.get("detection_s") is None for r in rs)
             else max(r["detection_s"] for r in rs))
    return _target(f"{fault}: {what} within {limit:g} s (every round)", worst, lambda v: v <= limit,
                   f"worst detection {fmt(worst, '.2f')} s over {len(rs)} round(s); {detail}")


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
                               f"{rows.TARGET_KILL_RATIO:g} (medians)", ratio(rt, st),
                               lambda v: v >= rows.TARGET_KILL_RATIO,
                               f"Ray Train {fmt(rt, '.2f')} s, {runner} {fmt(st, '.2f')} s"))
    if "hang" in med:
        rt = med["hang"]["ray-train"]
        theirs = (f"{fmt(rt['detection_s'], '.2f')} s" if rt["detected"]
                  else f"not detected within {rows.HANG_WAIT_S:g} s")
        out += [_detection_target(results, "hang", runner, f"{runner} detects the hang",
                                  rows.TARGET_HANG_DETECTION_S, f"Ray Train: {theirs}")
                for runner in ("stalwart", "stalwart+spare")]
    if "node" in med:
        out += node_verdicts(med["node"])
    if "freeze" in med:
        recovery = med["freeze"]["stalwart-elastic"]["recovery_s"]
        out.append(_detection_target(results, "freeze", None, "stalwart notices a frozen node",
                                     rows.TARGET_FREEZE_DETECTION_S,
                                     f"median recovery {fmt(recovery, '.2f')} s"))
    if OUTSIDE_KILL in med:
        out += outside_verdicts(med[OUTSIDE_KILL])
    return [*out, _lost_steps_verdict(results)]


def _lost_steps_verdict(results: list[dict[str, Any]]) -> dict[str, Any]:
    stalwart = [r for r in results if r["system"] == "stalwart"]
    bad = [r for r in stalwart if r.get("lost_steps") is None or r.get("lost_steps_bound") is None
           or r["lost_steps"] > r["lost_steps_bound"]]
    # No stalwart run leaves the value None: not met.
    return _target(
        "lost steps: 0 with the memory tier, <= steps since the last storage checkpoint due "
        f"(checkpoint.persist_every={rows.PERSIST_EVERY}) without; every stalwart run",
        max((r["lost_steps"] for r in stalwart if r.get("lost_steps") is not None), default=None),
        lambda v: not bad,
        "; ".join(f"r{r['round']}-{r['fault']}-{r['runner']}: lost {r.get('lost_steps')} > bound "
                  f"{r.get('lost_steps_bound')}" for r in bad) or
        ", ".join(f"{r['fault']}/{r['runner']} {r['lost_steps']}<={r['lost_steps_bound']}"
                  for r in stalwart))


def node_verdicts(side: dict[str, Any]) -> list[dict[str, Any]]:
    """A lost node: fault -> the next completed step within a normal step + the slack."""
    out = []
    for runner, slack in rows.TARGET_NODE_SLACK_S.items():
        st, normal = side[runner]["recovery_s"], side[runner]["normal_step_s"]
        bound = normal + slack if normal is not None else None
        out.append(_target(f"node: {side[runner]['label']} -> next completed step <= one "
                           f"normal step + {slack:g} s (medians)", st,
                           lambda v, b=bound: b is not None and v <= b,
                           f"{fmt(st, '.2f')} s against {fmt(bound, '.2f')} s (normal step "
                           f"{fmt(normal, '.3f')} s; Ray Train "
                           f"{fmt(side['ray-train']['recovery_s'], '.2f')} s)"))
    return out


def outside_verdicts(side: dict[str, Any]) -> list[dict[str, Any]]:
    """Outside-kill targets: stalwart within a normal step + slack, peers a ratio over it."""
    st, normal = side[OUTSIDE_STALWART]["recovery_s"], side[OUTSIDE_STALWART]["normal_step_s"]
    bound = normal + rows.TARGET_NEXT_STEP_SLACK_S if normal is not None else None
    out = [_target(f"{OUTSIDE_KILL}: stalwart kill -> next completed step <= one normal step "
                   f"+ {rows.TARGET_NEXT_STEP_SLACK_S:g} s (medians)", st,
                   lambda v: bound is not None and v <= bound,
                   f"{fmt(st, '.2f')} s against {fmt(bound, '.2f')} s (normal step "
                   f"{fmt(normal, '.3f')} s)")]
    first = side[OUTSIDE_STALWART]["first_step_ratio"]
    out.append(_target(f"{OUTSIDE_KILL}: stalwart's first step after the kill <= "
                       f"{rows.TARGET_FIRST_STEP_RATIO:g}x a normal step (medians)", first,
                       lambda v: v <= rows.TARGET_FIRST_STEP_RATIO,
                       f"{fmt(first, '.2f')}x (the recovered event's first_step phase over "
                       f"the normal step)"))
    for peer, target in rows.TARGET_OUTSIDE_RATIOS.items():
        theirs, label = side[peer]["recovery_s"], side[peer]["label"]
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
        f"{rows.HANG_WAIT_S:g} s, then stopped the run.",
        "Node loss: both sides on a local ray.cluster_utils.Cluster (a 0-CPU head, one 1-CPU "
        f"node per worker plus one: room for a replacement, or stalwart's spare) with Ray's default node health checks (health_check_period_ms="
        f"{period}, failure_threshold={threshold}); the stalwart cluster also sets "
        "worker_niceness=0. A replacement 1-CPU node is added as soon as the GCS reports the "
        "lost node dead, on both sides.",
        f"{OUTSIDE_KILL}: the harness SIGKILLs rank 1's process by its PID once step "
        f"{rows.FAULT_STEP} is in the system's own step log (read every 50 ms), so the kill lands "
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
                f"round {r['round'] + 1}, node: stalwart detected the loss by probing the raylet, "
                f"shrank to 1 worker and finished the run {fmt(r.get('finished_s'), '.1f')} s "
                f"after the fault on the surviving worker, {why}: it did not grow back (the grow "
                "path is what tests/ray/test_cli_node_loss.py covers, on a longer run).")
    return out


def one_line(r: dict[str, Any]) -> str:
    tag = f"r{r['round']}-{r['fault']}-{r['runner']}"
    if r.get("error"):
        return f"  {tag}: FAILED ({r['error']})"
    extra = ""
    if r["system"] == "ray-train" and r["fault"] == "hang" and not r["detected"]:
        extra = f"  (not detected within {rows.HANG_WAIT_S:g} s)"
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
    for fault, side in med.items():
        for runner, m in side.items():
            detect = fmt(m["detection_s"], "8.2f")
            if runner == "ray-train" and fault == "hang" and not m["detected"]:
                detect = f">{rows.HANG_WAIT_S:g} n/d".rjust(8)
            source = ",".join(x for x in m.get("sources", []) if x != "None") or "-"
            print(f"{fault:<12} | {m['label']:<30} | {detect} | {fmt(m['restart_s'], '9.2f')} | "
                  f"{fmt(m.get('restore_s'), '9.2f')} | {fmt(m['recovery_s'], '9.2f')} | "
                  f"{fmt(m['lost_steps'], '4.0f')} | {fmt(m['restored_from_step'], '4.0f')} | "
                  f"{fmt(m['lost_steps_bound'], '5.0f')} | {source:<8} | "
                  f"{m['completed']}/{m['runs']:<3}")
    print("-" * len(head))
    print("detect: fault -> the controller decides it is a failure (n/d: not detected); restart: "
          "fault -> the new world is up;\nrestore: the load of the checkpoint (memory or storage); "
          "recover: fault -> the first step completed after it;\nlost: steps trained again; from: "
          "step restored from; bound: the most lost steps allowed (0 with the memory tier, else "
          f"steps since the last storage checkpoint due, every {rows.PERSIST_EVERY});\nsource: "
          f"where the restore came from; ok: runs that completed all {rows.STEPS} steps")


def print_outside(side: dict[str, Any]) -> None:
    """Kill from outside -> next completed step, side by side, each over stalwart's."""
    st = side[OUTSIDE_STALWART]["recovery_s"]
    head = (f"{'system':<30} | {'kill -> next step s':>19} | {'normal step s':>13} | "
            f"{'first step x':>12} | {'lost':>4} | {'from':>4} | {'x stalwart':>10} | {'ok':>5}")
    print(f"\n{OUTSIDE_KILL}: SIGKILL of rank 1's process by the harness after step "
          f"{rows.FAULT_STEP} was logged (medians)\n" + head + "\n" + "-" * len(head))
    for m in side.values():
        print(f"{m['label']:<30} | {fmt(m['recovery_s'], '19.2f')} | "
              f"{fmt(m['normal_step_s'], '13.3f')} | {fmt(m.get('first_step_ratio'), '12.2f')} | "
              f"{fmt(m['lost_steps'], '4.0f')} | "
              f"{fmt(m['restored_from_step'], '4.0f')} | "
              f"{fmt(ratio(m['recovery_s'], st), '10.1f')} | {m['completed']}/{m['runs']:<3}")
    print("-" * len(head))
    print("kill -> next step: from the harness's SIGKILL to the end of the first step completed by "
          "the restarted world (each system's own step log);\nnormal step: median step time of the "
          "same run before the kill; first step x: stalwart's first step after the recovery "
          "(its recovered event) over the normal step;\nlost: the killed world's last step - "
          "the step resumed from")


# runner -> (its bars' colour, its legend label)
STYLES = {"stalwart": ("#1f77b4", "stalwart (memory tier)"),
          "stalwart+spare": ("#6baed6", "stalwart + warm spare (memory tier)"),
          "stalwart+spare/storage": ("#9e9ac8", "stalwart + warm spare, storage only"),
          "stalwart-elastic": ("#08519c", "stalwart, shrinks on node loss (memory tier)"),
          "stalwart-elastic+spare": ("#4292c6", "stalwart + a spare on another node (memory tier)"),
          "stalwart-elastic/storage": ("#756bb1", "stalwart, shrinks, storage only"),
          "ray-train": ("#ff7f0e", "Ray Train TorchTrainer"),
          "torchrun": ("#2ca02c", "torchrun --max-restarts")}
FAULT_NAMES = {"kill": "kill (SIGKILL)", "hang": "hang (SIGSTOP)", "node": "node loss",
               "freeze": "frozen node", OUTSIDE_KILL: "SIGKILL from outside"}


def _bars(ax: Any, med: dict[str, Any], key: str, title: str) -> None:
    """One panel: a bar per row and fault, log scale."""
    faults = list(med)
    width = 0.8 / max(len(med[f]) for f in faults)
    for j, fault in enumerate(faults):
        for i, (runner, m) in enumerate(med[fault].items()):
            (color, label), value = STYLES[runner], m[key]
            x = j - width * len(med[fault]) / 2 + width * (i + 0.5)
            if value is None and fault != "hang":
                continue  # not measured for this row (torchrun has no detection event)
            if value is None:
                # Not detected / not recovered within the harness's wait: a hollow bar.
                ax.bar(x, rows.HANG_WAIT_S, width, color="none", edgecolor=color, hatch="//")
                what = "detected" if key == "detection_s" else "recovered"
                ax.text(x, rows.HANG_WAIT_S * 1.1, f"not {what}\nwithin {rows.HANG_WAIT_S:g} s",
                        ha="center", va="bottom", fontsize=7)
                continue
            ax.bar(x, max(value, 1e-3), width, color=color, label=label)  # one per label: plot()
            ax.text(x, max(value, 1e-3) * 1.1, f"{value:.2g}", ha="center", va="bottom", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(1e-2, rows.HANG_WAIT_S * 8)
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
        axes[1].hlines(med["kill"]["ray-train"]["recovery_s"] / rows.TARGET_KILL_RATIO, j - 0.45,
                       j + 0.45, color="black", ls=":", lw=1.2,
                       label=f"kill target: Ray Train / {rows.TARGET_KILL_RATIO:g}")
    if "hang" in med:
        j = faults.index("hang")
        axes[0].hlines(rows.TARGET_HANG_DETECTION_S, j - 0.45, j + 0.45, color="black", ls="--",
                       lw=1.2, label=f"hang target: {rows.TARGET_HANG_DETECTION_S:g} s")
    legend: dict[str, Any] = {}  # one legend for both panels, below them, each label once
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(label, handle)
    fig.legend(list(legend.values()), list(legend), loc="lower center",
               ncol=min(4, len(legend)), fontsize=8, frameon=False)
    models = [m for m, here in (("tiny GPT", any(f != OUTSIDE_KILL for f in faults)),
                                ("SIGKILL from outside: the reference GPT",
                                 OUTSIDE_KILL in faults)) if here]
    fig.suptitle(f"Recovery on the reference task ({'; '.join(models)}; {rows.WORKERS} workers, "
                 f"fault on rank 1 at step {rows.FAULT_STEP}), medians", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    Path(png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"wrote {png}")
    return png


def git_revision() -> dict[str, Any]:
    """The commit the runs used (stalwart is installed in editable mode) and tracked changes."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=common.ROOT, capture_output=True, text=True).stdout

    return {"commit": git("rev-parse", "HEAD").strip() or None, "modified": sorted(
        line[3:] for line in git("status", "--porcelain", "--untracked-files=no").splitlines())}


def run_all(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for fault in args.faults:
            runners = [r for r, _ in rows.RUNNERS[fault]]
            # The order flips every round, so a drift in machine load favours no side.
            order = runners if rnd % 2 == 0 else runners[::-1]
            print(f"round {rnd + 1}/{args.rounds}, {fault}: {' -> '.join(order)}", flush=True)
            for runner in order:
                results.append(r := rows.run_row(runner, fault, args, work, rnd))
                print(one_line(r), flush=True)
                if r.get("log_tail"):
                    print(f"    last lines of {r['log']}:\n" + "\n".join(
                        "      " + line for line in r["log_tail"].splitlines()), flush=True)
    return results


def ray_health_checks() -> dict[str, Any]:
    from ray._raylet import Config

    return {name: getattr(Config, name)() for name in (
        "health_check_period_ms", "health_check_failure_threshold",
        "health_check_initial_delay_ms", "health_check_timeout_ms")}


def changed_note(start: dict[str, Any], end: dict[str, Any]) -> str | None:
    """Someone committed or edited files while the benchmark ran."""
    changed = sorted(set(start["modified"]) ^ set(end["modified"]))
    what = [f"commit {start['commit']} -> {end['commit']}"] * (start["commit"] != end["commit"])
    what += [f"files modified or reverted: {', '.join(changed)}"] * bool(changed)
    return (f"the checkout changed during the benchmark: {'; '.join(what)} (runs after the "
            "change may have used different code)") if what else None


def main() -> int:
    args = parse_args()
    t_start, revision = time.time(), git_revision()
    tps, _ = common.tokens_per_step(args.config, rows.stalwart_overrides("stalwart"))
    work = Path(tempfile.mkdtemp(prefix="stalwart-recovery-"))
    print(f"recovery: {args.rounds} round(s) x faults {args.faults}, {rows.STEPS} steps, fault "
          f"on rank 1 at step {rows.FAULT_STEP}, checkpoint every {rows.PERSIST_EVERY}, "
          f"{rows.WORKERS} workers, {os.cpu_count()} CPUs; runs in {work}", flush=True)
    results = run_all(args, work)
    med = summarise(results, args.faults)
    print_table(med)
    if OUTSIDE_KILL in med:
        print_outside(med[OUTSIDE_KILL])
    checks = verdicts(results, med)
    print()
    for v in checks:
        print(f"target {v['target']}: {'MET' if v['met'] else 'NOT MET'} "
              f"(value {common.fmt(v['value'], '.2f')}; {v['detail']})")
    health, end_revision = ray_health_checks(), git_revision()
    run_notes = notes(results, health) + [n for n in [changed_note(revision, end_revision)] if n]
    print("\nnotes:\n" + "\n".join(f"- {n}" for n in run_notes))
    png = plot(args.png, med)
    # Runs that went wrong (Ray Train not noticing the hang is the measurement, not a failure).
    failed = [r for r in results if r.get("error") or r.get("missing_events") or (
        not r.get("completed") and not (r["system"] == "ray-train" and r["fault"] == "hang"
                                        and not r.get("detected")))]
    wall = time.time() - t_start
    out = {"bench": "recovery", "time": t_start, "wall_s": wall, "targets": checks,
           "all_targets_met": all(v["met"] for v in checks), "medians": med, "notes": run_notes,
           "settings": rows.settings(args, tps, health),
           "git": {"at_start": revision, "at_end": end_revision},
           "versions": {name: importlib.metadata.version(name)
                        for name in ("stalwart", "torch", "ray", "matplotlib")}, "png": png}
    if not args.keep and not failed:
        common.drop_work(work, results)
    elif failed:
        print(f"kept {work}: {len(failed)} run(s) did not complete or missed events")
    common.write_report(args.out, out, results)
    print(f"whole benchmark: {wall / 60:.1f} min")
    return 1 if any(r.get("error") or r.get("fault_time") is None for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
