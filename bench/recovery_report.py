"""The recovery benchmark's report (bench/recovery.py): a line per run, the table of medians
and the bar chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import common
from bench.recovery_setup import (
    FAULT_STEP,
    HANG_WAIT_S,
    OUTSIDE_KILL,
    PERSIST_EVERY,
    STEPS,
    TARGET_HANG_DETECTION_S,
    TARGET_KILL_RATIO,
    WORKERS,
)


def one_line(r: dict[str, Any]) -> str:
    def s(x: Any, spec: str = "6.2f") -> str:
        return common.fmt(x, spec)

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
    if r["fault"] == OUTSIDE_KILL:
        if r.get("restarts", 0) > 1:  # torchrun: a restart that failed too
            extra += f"  {r['restarts']} restarts for one kill"
        return (f"  {tag}: killed pid {r.get('killed_pid')} after step "
                f"{r.get('kill_after_step_logged')} was logged; kill -> next completed step "
                f"{s(r['recovery_s'])} s (normal step {s(r.get('normal_step_s'), '.3f')} s), "
                f"lost {common.fmt(r['lost_steps'], '3d')} steps (last {r.get('last_step_of_killed_world')}, "
                f"resumed from {r.get('resumed_from')}), load {r['load_before']:.2f}{extra}")
    return (f"  {tag}: detection {s(r['detection_s'])} s, recovery {s(r['recovery_s'])} s, "
            f"lost {common.fmt(r['lost_steps'], '3d')} steps, load "
            f"{r['load_before']:.2f}{extra}")


def print_table(med: dict[str, Any]) -> None:
    head = (f"{'fault':<12} | {'system':<30} | {'detect s':>8} | {'restart s':>9} | "
            f"{'restore s':>9} | {'recover s':>9} | {'lost':>4} | {'from':>4} | {'bound':>5} | "
            f"{'source':<8} | {'ok':>5}")
    print("\nrecovery (medians)\n" + head + "\n" + "-" * len(head))
    for fault, rows in med.items():
        for runner, m in rows.items():
            detect = common.fmt(m["detection_s"], "8.2f")
            if runner == "ray-train" and fault == "hang" and not m["detected"]:
                detect = f">{HANG_WAIT_S:g} n/d".rjust(8)
            source = ",".join(x for x in m.get("sources", []) if x != "None") or "-"
            print(f"{fault:<12} | {m['label']:<30} | {detect} | "
                  f"{common.fmt(m['restart_s'], '9.2f')} | {common.fmt(m.get('restore_s'), '9.2f')} | "
                  f"{common.fmt(m['recovery_s'], '9.2f')} | "
                  f"{common.fmt(m['lost_steps'], '4.0f')} | "
                  f"{common.fmt(m['restored_from_step'], '4.0f')} | "
                  f"{common.fmt(m['lost_steps_bound'], '5.0f')} | {source:<8} | "
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
    """The issue's table: kill from outside -> next completed step, side by side, each
    system's time over stalwart's."""
    rows = med[OUTSIDE_KILL]
    st = rows[stalwart]["recovery_s"]
    head = (f"{'system':<30} | {'kill -> next step s':>19} | {'normal step s':>13} | "
            f"{'lost':>4} | {'from':>4} | {'x stalwart':>10} | {'ok':>5}")
    print(f"\n{OUTSIDE_KILL}: SIGKILL of rank 1's process by the harness after step {FAULT_STEP} "
          "was logged (medians)\n" + head + "\n" + "-" * len(head))
    for m in rows.values():
        ratio = m["recovery_s"] / st if m["recovery_s"] is not None and st else None
        print(f"{m['label']:<30} | {common.fmt(m['recovery_s'], '19.2f')} | "
              f"{common.fmt(m['normal_step_s'], '13.3f')} | {common.fmt(m['lost_steps'], '4.0f')} | "
              f"{common.fmt(m['restored_from_step'], '4.0f')} | {common.fmt(ratio, '10.1f')} | "
              f"{m['completed']}/{m['runs']:<3}")
    print("-" * len(head))
    print("kill -> next step: from the harness's SIGKILL to the end of the first step completed "
          "by the restarted world (each system's own step log);\nnormal step: median step "
          "time of the same run before the kill; lost: the killed world's last step - the step "
          "resumed from")


def plot(png: str, med: dict[str, Any]) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no chart")
        return None
    faults = list(med)
    colors = {"stalwart": "#1f77b4", "stalwart+spare": "#6baed6",
              "stalwart+spare/storage": "#9e9ac8", "stalwart-elastic": "#08519c",
              "stalwart-elastic/storage": "#756bb1", "ray-train": "#ff7f0e",
              "torchrun": "#2ca02c"}
    labels = {"stalwart": "stalwart (memory tier)",
              "stalwart+spare": "stalwart + warm spare (memory tier)",
              "stalwart+spare/storage": "stalwart + warm spare, storage only",
              "stalwart-elastic": "stalwart, shrinks on node loss (memory tier)",
              "stalwart-elastic/storage": "stalwart, shrinks, storage only",
              "ray-train": "Ray Train TorchTrainer", "torchrun": "torchrun --max-restarts"}
    width = 0.8 / max(len(med[f]) for f in faults)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, key, title in ((axes[0], "detection_s", "detection (fault -> failure decided)"),
                           (axes[1], "recovery_s", "recovery (fault -> first step after)")):
        labelled: set[str] = set()
        for j, fault in enumerate(faults):
            runners = list(med[fault])
            for i, runner in enumerate(runners):
                m, color = med[fault][runner], colors[runner]
                x = j - width * len(runners) / 2 + width * (i + 0.5)
                value = m[key]
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
                       label=None if runner in labelled else labels[runner])
                labelled.add(runner)
                ax.text(x, max(value, 1e-3) * 1.1, f"{value:.2g}", ha="center", va="bottom",
                        fontsize=7)
        ax.set_yscale("log")
        ax.set_ylim(1e-2, HANG_WAIT_S * 8)
        ax.set_xticks(range(len(faults)), [{"kill": "kill (SIGKILL)", "hang": "hang (SIGSTOP)",
                                            "node": "node loss",
                                            "freeze": "frozen node",
                                            OUTSIDE_KILL: "SIGKILL from outside"}[f]
                                for f in faults])
        ax.set_ylabel("seconds (log scale)")
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3, which="both")
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
