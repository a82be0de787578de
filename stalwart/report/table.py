"""The summary as the plain-text table `stalwart report` prints."""

from __future__ import annotations

from collections import Counter

from stalwart.progress import metrics_text
from stalwart.report.summary import Summary
from stalwart.tables import key_values


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, s = divmod(seconds, 60)
    if minutes < 60:
        return f"{int(minutes)}m {s:04.1f}s"
    hours, m = divmod(int(minutes), 60)
    return f"{hours}h {m:02d}m {s:02.0f}s"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}s"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def numerical_line(faults: list[dict]) -> str:
    """`numerical faults: 3 (nan 1, spike 2; replay 2, skip 1)`."""
    by_fault = Counter(f["fault"] for f in faults)
    by_action = Counter(f["action"] for f in faults)
    return (f"numerical faults: {len(faults)} ({_counts(dict(by_fault))}; "
            f"{_counts(dict(by_action))})")


def format_summary(s: Summary, run_dir: str) -> str:
    total = "?" if s.steps_total is None else str(s.steps_total)
    started = f" (from step {s.start_step})" if s.start_step else ""
    counted = "-" if s.tokens is None else f"{s.tokens:,} ({s.tokens_per_step:,} per step)"
    if s.goodput is None:
        goodput = "unknown"
    else:
        goodput = (f"{s.goodput:.3f}  (productive step time {_duration(s.productive_s or 0.0)}"
                   f" of {_duration(s.wall_s)} wall)")
    resizes = ", ".join(f"step {r['step']} {r['old_world_size']}->{r['new_world_size']} "
                        f"({r['reason']})" for r in s.resizes)
    when = ("in the background while training went on, not a pause" if s.async_save
            else "synchronous: training waited, inside the step times")
    lines = [
        ("run", f"{run_dir} ({s.state})"),
        ("wall time", _duration(s.wall_s) + (" so far" if s.state == "running" else "")),
        ("steps", f"{s.steps_done} / {total}{started}"),
        (s.throughput_unit, counted),
        ("goodput", goodput),
        ("failures", f"{len(s.failures)}" + (f": {_counts(s.failures_by_kind)}"
                                             if s.failures else "")),
        ("recoveries", _counts(s.recoveries_by_source)),
        ("detection", f"median {_seconds(s.detection_s_median)}"),
        ("recovery", f"median {_seconds(s.recovery_s_median)}"),
        ("lost steps", str(s.lost_steps)),
        ("resizes", f"{len(s.resizes)}" + (f": {resizes}" if resizes else "")),
        ("checkpointing", f"{s.checkpoints} saves, {_duration(s.checkpoint_save_s)} writing "
                          f"({when})"),
    ]
    if s.last_metrics:
        lines.insert(3, ("last metrics", metrics_text(s.last_metrics)))
    out = [key_values(lines)]
    if s.data_wait is not None:
        out.append(f"data wait: {100 * s.data_wait:.1f}% of step time")
    if s.numerical_faults:
        out.append(numerical_line(s.numerical_faults))
    out += [f"note: {n}" for n in s.notes]
    return "\n".join(out)
