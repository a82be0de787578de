"""The run report's figure: loss against step and against wall time, world size over time,
with failures and resizes marked. Needs matplotlib (the `report` extra); rendered with the
Agg backend, so no display is needed."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from stalwart.core import events as ev
from stalwart.core.errors import StalwartError
from stalwart.core.safe_files import replacing
from stalwart.report.summary import END_EVENTS, Summary, kept_rows


class MatplotlibMissing(StalwartError):
    """The figure was asked for, but matplotlib (the `report` extra) is not installed."""


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MatplotlibMissing("matplotlib is not installed: pip install "
                                "'stalwart[report]' (or matplotlib) for the figure") from exc
    matplotlib.use("Agg")  # a file, never a window: works over ssh and in CI
    import matplotlib.pyplot as plt

    return plt


def _world_sizes(events: list[ev.Event], t0: float, end: float
                 ) -> tuple[list[float], list[int]]:
    """(seconds since t0, world size) at every change: a world's size from its start, 0 from
    a failure or the run's end until the next world starts."""
    xs: list[float] = []
    ys: list[int] = []
    for e in events:
        at = e.time
        if isinstance(e, ev.WorkersStarted):
            size = e.world_size
        elif isinstance(e, ev.Failure):  # the world stopped training when it happened
            size, at = 0, at - (e.detection_s or 0.0)
        elif isinstance(e, (*END_EVENTS, ev.Resumed)):
            size = 0
        else:
            continue
        xs.append(at - t0)
        ys.append(size)
    xs.append(end - t0)
    ys.append(ys[-1] if ys else 0)
    return xs, ys


def _by_world(rows: list[ev.MetricsRow], events: list[ev.Event], t0: float
              ) -> tuple[list[float], list[float]]:
    """(time, loss) with a gap between worlds, so no line is drawn across a recovery."""
    starts = [e.time for e in events if isinstance(e, ev.WorkersStarted)]
    xs: list[float] = []
    ys: list[float] = []
    world = None
    for r in rows:
        now_in = sum(1 for s in starts if s <= r.time)
        if world is not None and now_in != world:
            xs.append(math.nan)
            ys.append(math.nan)
        world = now_in
        xs.append(r.time - t0)
        ys.append(r.loss)
    return xs, ys


def write_png(path: Path, events: list[ev.Event], rows: list[ev.MetricsRow],
              summary: Summary, *, title: str, now: float) -> Path:
    plt = _pyplot()
    t0 = events[0].time
    end = now if summary.state == "running" else max([events[-1].time, *(r.time for r in rows)])
    kept = kept_rows(events, rows)
    fig, (by_step, by_time, world) = plt.subplots(3, 1, figsize=(9, 9.5),
                                                  height_ratios=[3, 3, 1.4])
    fig.suptitle(title, fontsize=11)

    for keep, style in ((True, {"color": "tab:blue", "label": "train loss"}),
                        (False, {"color": "tab:gray", "alpha": 0.6, "linestyle": "none",
                                 "marker": "x", "label": "train loss, lost attempt"})):
        sel = [r for r, k in zip(rows, kept, strict=True) if k == keep]
        if sel:
            by_step.plot([r.step for r in sel], [r.loss for r in sel], **style)
            by_time.plot(*_by_world(sel, events, t0), **style)
    val = [r for r, k in zip(rows, kept, strict=True) if k and r.val_loss is not None]
    if val:
        losses = [r.val_loss for r in val]
        by_step.plot([r.step for r in val], losses, "o-", color="tab:orange", label="val loss")
        by_time.plot([r.time - t0 for r in val], losses, "o-", color="tab:orange",
                     label="val loss")

    # Failures (red, by kind) at the last step done and when they happened (detection
    # latency before their event); resizes (green) at their step and event.
    for f in summary.failures:
        at = f["time"] - (f["detection_s"] or 0.0) - t0
        for ax, x in ((by_step, f["step"]), (by_time, at), (world, at)):
            ax.axvline(x, color="tab:red", linewidth=1, alpha=0.8)
        for ax, x in ((by_step, f["step"]), (by_time, at)):
            ax.text(x, 0.98, f" {f['kind']}", transform=ax.get_xaxis_transform(),
                    rotation=90, va="top", ha="left", fontsize=8, color="tab:red")
    for r in summary.resizes:
        label = f" {r['old_world_size']}->{r['new_world_size']} {r['reason']}"
        for ax, x in ((by_step, r["step"]), (by_time, r["time"] - t0), (world, r["time"] - t0)):
            ax.axvline(x, color="tab:green", linewidth=1, linestyle="--")
        for ax, x in ((by_step, r["step"]), (by_time, r["time"] - t0)):
            ax.text(x, 0.02, label, transform=ax.get_xaxis_transform(), rotation=90,
                    va="bottom", ha="left", fontsize=8, color="tab:green")

    xs, ys = _world_sizes(events, t0, end)
    world.step(xs, ys, where="post", color="tab:purple")
    world.set_ylim(0, max(ys, default=1) + 1)
    world.set_ylabel("world size")
    world.set_xlabel("wall time (s since the first event)")
    world.sharex(by_time)
    by_time.set_xlim(left=0)
    by_step.set_xlabel("step")
    by_time.set_xlabel("wall time (s since the first event)")
    for ax in (by_step, by_time):
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Drawn into a new file renamed over `path`: a symbolic link planted there (a run dir
    # from someone else) is replaced, never written through.
    try:
        with replacing(path) as f:
            fig.savefig(f, format="png", dpi=100)
    finally:
        plt.close(fig)
    return path
