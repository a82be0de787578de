"""Snapshot budget: what the in-memory tier costs the reference tiny model's tokens/s with a
snapshot every step, with `checkpoint.snapshot_every = "auto"` and with the tier off, on a
fast link and on a slow one (`--inject slow-link`: rank 1 sends its snapshots at --mbps).

FSDP2 over 2 workers, so that every rank's shard is sent to its peer (data-parallel twins
send nothing). Each runner's tokens/s over the steps after --exclude, against the tier off,
in alternating rounds; for auto runs, the interval the run chose (its last
`snapshot_interval` event) and its own reading of the tier's overhead (the median window's,
the `ended` event). Target: auto within --budget of the tier off on both links.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench import common
from bench.common import FSDP_LAYOUT, fmt
from stalwart.core.events import read_jsonl
from stalwart.report.summary import median

WORKERS = 2
OFF, EVERY, AUTO = "off", "every step", "auto"
SLOW = "slow link"
# name -> (snapshot_every, whether rank 1's link is slowed). The tier off sends nothing: one
# baseline serves both links.
RUNNERS: dict[str, tuple[str, bool]] = {
    OFF: ("0", False),
    EVERY: ("1", False),
    AUTO: ("auto", False),
    f"{EVERY}, {SLOW}": ("1", True),
    f"{AUTO}, {SLOW}": ("auto", True),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.window_parser(__doc__, __spec__, "snapshot_budget.json", rounds=2, steps=100)
    p.set_defaults(exclude=20)
    p.add_argument("--mbps", type=common.positive(float), default=20.0,
                   help="rank 1's link in the slow-link runs, megabits/s (default 20)")
    p.add_argument("--budget", type=float, default=0.02,
                   help="checkpoint.snapshot_budget of the auto runs (default 0.02)")
    p.add_argument("--runners", nargs="+", choices=list(RUNNERS), default=list(RUNNERS),
                   metavar="RUNNER", help=f"runners to run, of {', '.join(map(repr, RUNNERS))} "
                   f"(default all; {OFF!r}, the baseline, always runs)")
    args = p.parse_args(argv)
    args.runners = [n for n in RUNNERS if n in args.runners or n == OFF]
    if args.log_every < 1 or args.exclude < 1 or args.exclude % args.log_every:
        p.error("--exclude must be a positive multiple of --log-every")
    if args.steps <= args.exclude:
        p.error("--steps must be larger than --exclude")
    if not 0 < args.budget < 1:
        p.error("--budget must be between 0 and 1")
    return args


def runner_overrides(name: str, budget: float) -> list[str]:
    every, _ = RUNNERS[name]
    out = [*FSDP_LAYOUT, f"checkpoint.snapshot_every={every}"]
    return out + ([f"checkpoint.snapshot_budget={budget}"] if every == "auto" else [])


def injects(name: str, mbps: float) -> list[str]:
    """The slow link from step 2 (the first step's snapshot is the world's set-up)."""
    return ["--inject", f"slow-link:rank=1,step=2,mbps={mbps:g}"] if RUNNERS[name][1] else []


def schedule_of(events: list[dict[str, Any]]) -> dict[str, Any]:
    """An auto run's schedule from its events: the interval it ended with, its changes, and
    its own reading of the tier's overhead (its first world's `ended` event; None if none)."""
    rows = [e for e in events if e["kind"] == "snapshot_interval"]
    ended = next((e for e in rows if e["change"] == "ended"), None)
    return {"interval": rows[-1]["interval"] if rows else 1,
            "changes": [(e["step"], e["previous"], e["interval"]) for e in rows
                        if e["change"] != "ended"],
            "overhead": ended["overhead"] if ended else None,
            "expected": ended["expected"] if ended else None}


def one_run(name: str, rnd: int, *, args: argparse.Namespace, work: Path, tps: int,
            overrides: list[str]) -> dict[str, Any]:
    run_dir = work / f"r{rnd}-{name.replace(', ', '-').replace(' ', '_')}"
    cmd = common.stalwart_command(args.config, overrides + runner_overrides(name, args.budget),
                                  run_dir) + injects(name, args.mbps)

    def measure() -> dict[str, Any]:
        out = common.stalwart_rate(run_dir, args.exclude, tps, final=True)
        if RUNNERS[name][0] == "auto":
            out["schedule"] = schedule_of(read_jsonl(run_dir / "events.jsonl"))
        return out

    def note(r: dict[str, Any]) -> str:
        s = r.get("schedule")
        return f", interval {s['interval']}" if s else ""

    return common.rate_run(run_dir.name, cmd, args, work, {
        "runner": name, "round": rnd, "run_dir": str(run_dir)}, measure, note)


def summary(results: list[dict[str, Any]], rounds: int,
            runners: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per runner: median tokens/s, the median paired ratio to the tier off, and for
    auto runs the median interval chosen and overhead read."""
    rates = common.by_round(results, "runner")
    rows = []
    for name in runners or list(RUNNERS):
        mine = [r for r in results if r["runner"] == name and "tokens_per_s" in r]
        schedules = [r["schedule"] for r in mine if "schedule" in r]
        paired = common.paired(rates, name, OFF, rounds)
        rows.append({
            "runner": name, "tokens_per_s": median(r["tokens_per_s"] for r in mine),
            "ratio_to_off": median(paired) if paired else None,
            "interval": median(s["interval"] for s in schedules) if schedules else None,
            "overhead_read": median(s["overhead"] for s in schedules
                                    if s["overhead"] is not None) if schedules else None})
    return rows


def table(rows: list[dict[str, Any]], budget: float) -> list[list[str]]:
    head = ["runner", "tokens/s", "x off", "interval", "overhead (run's own)"]
    out = [head]
    for r in rows:
        overhead = r["overhead_read"]
        out.append([r["runner"], fmt(r["tokens_per_s"], ",.0f"), fmt(r["ratio_to_off"], ".3f"),
                    "-" if r["interval"] is None else f"{r['interval']:g}",
                    "-" if overhead is None else f"{overhead:.2%} (budget {budget:.0%})"])
    return out


def verdict(rows: list[dict[str, Any]], budget: float) -> dict[str, bool | None]:
    """Auto within the budget of the tier off, per link (None: not measured)."""
    by = {r["runner"]: r for r in rows}
    out: dict[str, bool | None] = {}
    for name in (AUTO, f"{AUTO}, {SLOW}"):
        x = by[name]["ratio_to_off"] if name in by else None
        out[name] = None if x is None else x >= 1 - budget
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    overrides = [*common.TINY, *common.window_overrides(args, WORKERS),
                 "scaling.spare_workers=0", "run.progress=false"]
    results, settings = common.window_rounds(
        "snapshot_budget", args, args.runners, WORKERS, overrides, one_run,
        notes=[f"  {n}: {' '.join(runner_overrides(n, args.budget) + injects(n, args.mbps))}"
               for n in args.runners])
    rows = summary(results, args.rounds, args.runners)
    print(f"\ntokens/s (steps {args.exclude + 1}..{args.steps}), medians of {args.rounds} "
          f"round(s); x off: paired by round")
    common.print_columns(table(rows, args.budget))
    met = verdict(rows, args.budget)
    for name, ok in met.items():
        print(f"{name}: >= {1 - args.budget:.2f} x off: "
              + ("not measured" if ok is None else "MET" if ok else "NOT MET"))
    common.write_report(args.out, {
        "bench": "snapshot_budget", "time": time.time(), "budget": args.budget,
        "mbps": args.mbps, "rows": rows, "target_met": met,
        "settings": {**settings, "runners": {n: runner_overrides(n, args.budget)
                                             + injects(n, args.mbps) for n in args.runners}}},
        results)
    return 0 if all(r["tokens_per_s"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
