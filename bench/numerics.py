"""Numerics: what stalwart's numerical-fault checks find, how fast, and what they cost, on the
tiny GPT with 2 workers; and the same NaN in a plain torchrun DDP loop and in Ray Train.

Three injected faults, one `stalwart run --inject` each: a NaN loss on rank 1 (replayed), a
loss spike on rank 0 (replayed, then its batch skipped) and a flipped bit on rank 1 (found by
the replicas' fingerprints, rolled back from memory). Each is timed from its `fault_injected`
event (the controller hearing of it; the rank carries it out after that) to the first
`numerical_fault` decision and to the end of the step that finally completed at the fault's
number. Then the checks' cost: steady-state tokens/s with the NaN check and a fingerprint
every step against every check off, in alternating rounds. Last, bench/peers/numerics_peers.py's
rows (the NaN in torchrun and Ray Train, by default and with their restarts) beside stalwart's.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench import common
from bench.common import DDP_LAYOUT, fmt, ratio
from stalwart.core.events import read_jsonl
from stalwart.report.summary import median

TARGET = 0.98  # tokens/s with the checks on >= 0.98 x with them off
WORKERS = 2
FAULT_RUN_STEPS = 60
# Every run: the tiny GPT, data-parallel twins (a fingerprint compares replicas), no spare
# (nothing is replaced), no validation, a snapshot every step (fingerprints need it).
BASE = [*common.TINY, f"scaling.num_workers={WORKERS}", "scaling.spare_workers=0",
        *DDP_LAYOUT, "data.val_every=0", "run.progress=false", "run.log_every=1",
        "checkpoint.snapshot_every=1"]
# kind -> what --inject gets, the step it strikes at, the config it needs.
FAULTS: dict[str, dict[str, Any]] = {
    "nan": {"inject": "nan:rank=1,step=20", "step": 20, "sets": []},
    "spike": {"inject": "spike:step=30", "step": 30,
              "sets": ["numerics.spike_z=6", "numerics.spike_warmup=10"]},
    "bitflip": {"inject": "bitflip:rank=1,step=40", "step": 40,
                "sets": ["numerics.fingerprint_every=1"]},
}
CHECKS_ON, CHECKS_OFF = "checks on", "checks off"
# The overhead's runners: the NaN check (on by default) and a fingerprint every step, against
# every check off (the spike check is off by default in both).
RUNNERS = {CHECKS_ON: ["numerics.fingerprint_every=1"], CHECKS_OFF: ["numerics.nan_check=false"]}
VERBS = {"replay": "replayed", "skip": "batch skipped", "rollback": "rolled back",
         "evict": "evicted", "stop": "stopped"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__, __spec__)
    p.add_argument("--json", "--out", dest="out", default=str(common.RESULTS / "numerics.json"),
                   help="JSON result file (bench/results/numerics.json)")
    p.add_argument("--steps", type=common.positive(), default=300,
                   help="steps of each overhead run (default 300)")
    p.add_argument("--exclude", type=common.positive(), default=20,
                   help="warm-up steps left out of the overhead's rate (default 20)")
    p.add_argument("--skip-peers", action="store_true",
                   help="leave out the torchrun and Ray Train rows")
    common.add_run_args(p, 300.0, rounds=5)
    args = p.parse_args(argv)
    if args.steps <= args.exclude:
        p.error(f"--steps ({args.steps}) must be larger than --exclude ({args.exclude})")
    return args


# ---------------------------------------------------------------------- reading a fault run


def first_of(events: list[dict[str, Any]], kind: str) -> dict[str, Any] | None:
    return next((e for e in events if e["kind"] == kind), None)


def actions_text(decisions: list[dict[str, Any]]) -> str:
    """The actions in order, e.g. "replay, skip" or "rollback to 38"."""
    return ", ".join(f"rollback to {d['rollback_to']}" if d["action"] == "rollback"
                     and d.get("rollback_to") is not None else d["action"]
                     for d in decisions) or "none"


def normal_step_s(rows: list[dict[str, Any]]) -> float | None:
    """The median seconds a step, over the metrics rows' windows."""
    return median(r["window_s"] / r["steps_in_window"] for r in rows
                  if r.get("window_s") is not None and r.get("steps_in_window"))


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def fault_summary(events: list[dict[str, Any]], rows: list[dict[str, Any]],
                  fault_step: int) -> dict[str, Any]:
    """A fault run's figures from its events.jsonl and metrics.jsonl rows: times are from
    the `fault_injected` event; the next good step is the last row logged at fault_step (a
    rollback logs the steps it trains again)."""
    injected, finished = first_of(events, "fault_injected"), first_of(events, "finished")
    decisions = [e for e in events if e["kind"] == "numerical_fault"]
    t0 = injected["time"] if injected else None
    at_fault = [r for r in rows if r["step"] == fault_step]
    # Each step's last row: a step trained again after a rollback counts once, as it ended.
    after = {r["step"]: r for r in rows if r["step"] > fault_step}
    final = finished["loss"] if finished else (rows[-1]["loss"] if rows else None)
    return {
        "injected": injected["fault"] if injected else None,
        "injected_rank": injected["rank"] if injected else None,
        "fault_time": t0,
        "detection_s": decisions[0]["time"] - t0 if decisions and t0 is not None else None,
        "decided_s": decisions[0]["decided_s"] if decisions else None,
        "actions": actions_text(decisions),
        "decisions": [{k: d.get(k) for k in ("step", "fault", "action", "ranks", "rollback_to",
                                             "decided_s", "detail", "reason")}
                      | {"since_fault_s": d["time"] - t0 if t0 is not None else None}
                      for d in decisions],
        "next_good_step_s": at_fault[-1]["time"] - t0 if at_fault and t0 is not None else None,
        "fault_step_loss": at_fault[-1]["loss"] if at_fault else None,
        "normal_step_s": normal_step_s(rows),
        "finished": finished is not None,
        "failures": sum(e["kind"] == "failure" for e in events),
        "final_loss": final,
        "first_nan_step": min((r["step"] for r in rows if not _finite(r["loss"])), default=None),
        "steps_after_fault": len(after),
        "finite_steps_after_fault": sum(_finite(r["loss"]) for r in after.values()),
        "last_step": rows[-1]["step"] if rows else None,
    }


def outcome(summary: dict[str, Any]) -> str:
    """What stalwart did and how the run ended, e.g. "replayed; run finished, loss finite"."""
    did = ", ".join(dict.fromkeys(VERBS.get(d["action"], d["action"])
                                  for d in summary["decisions"])) or "not detected"
    end = "run finished" if summary["finished"] else "run did not finish"
    loss = "loss finite" if _finite(summary["final_loss"]) else "loss not finite"
    return f"{did}; {end}, {loss}"


def fault_run(kind: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One `stalwart run --inject`, measured from its records (or its error)."""
    from bench.harness import run_watched

    spec = FAULTS[kind]
    run_dir, log = work / kind, work / f"{kind}.log"
    overrides = [*BASE, f"train.steps={FAULT_RUN_STEPS}",
                 f"checkpoint.persist_every={FAULT_RUN_STEPS + 1}", *spec["sets"]]
    cmd = [*common.stalwart_command(str(common.DEFAULT_CONFIG), overrides, run_dir),
           "--inject", spec["inject"]]
    row: dict[str, Any] = {"fault": kind, "inject": spec["inject"], "fault_step": spec["step"],
                           "overrides": spec["sets"], "load_before": os.getloadavg()[0],
                           "log": str(log), "run_dir": str(run_dir)}
    code, wall = run_watched(cmd, log, args.timeout)
    row.update(exit_code=code, wall_s=wall)
    try:
        row.update(fault_summary(read_jsonl(run_dir / "events.jsonl"),
                                 read_jsonl(run_dir / "metrics.jsonl"), spec["step"]))
        row["outcome"] = outcome(row)
    except (OSError, ValueError, KeyError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
    if code != 0:
        row.setdefault("error", f"exit code {code}")
    if "error" in row:
        print(f"  {kind}: FAILED ({row['error']}); last lines of {log}:\n"
              f"{common.tail(log, indent='    ')}", flush=True)
    else:
        print(f"  {kind}: {row['actions']}, detected {fmt(row['detection_s'], '.3f')} s after "
              f"the fault, next good step {fmt(row['next_good_step_s'], '.3f')} s "
              f"(run {wall:.1f} s, load {row['load_before']:.2f})", flush=True)
    return row


def print_faults(rows: list[dict[str, Any]]) -> None:
    table = [["fault", "injected", "detect s", "decided s", "actions", "next good step s",
              "normal step s", "finished", "failures"]]
    for r in rows:
        table.append([r["fault"], r["inject"], fmt(r.get("detection_s"), ".3f"),
                      fmt(r.get("decided_s"), ".3f"), r.get("actions", "-"),
                      fmt(r.get("next_good_step_s"), ".3f"), fmt(r.get("normal_step_s"), ".4f"),
                      "yes" if r.get("finished") else "NO", str(r.get("failures", "-"))])
    print(f"\nnumerical faults ({WORKERS} workers, {FAULT_RUN_STEPS} steps, tiny GPT)")
    common.print_columns(table)
    print("detect: fault_injected (the controller hears of it; the rank carries it out after "
          "its ack) -> the first numerical_fault decision;\ndecided: rank 0's seconds from the "
          "start of the step to that decision (it includes waiting in the all-reduce for the "
          "faulty rank, which waits for the ack);\nnext good step: fault_injected -> the end of "
          "the step that finally completed at the fault's number; normal step: median "
          "window_s / steps_in_window")


# ---------------------------------------------------------------------- the checks' overhead


def overhead_run(runner: str, rnd: int, *, args: argparse.Namespace, work: Path, tps: int,
                 overrides: list[str]) -> dict[str, Any]:
    run_dir = work / f"r{rnd}-{runner.replace(' ', '-')}"
    cmd = common.stalwart_command(str(common.DEFAULT_CONFIG), overrides + RUNNERS[runner],
                                  run_dir)

    def measure() -> dict[str, Any]:
        out = common.stalwart_rate(run_dir, args.exclude, tps, final=True)
        # A decision in a run with no fault is a false positive; read now, the folder goes.
        events = read_jsonl(run_dir / "events.jsonl")
        out["numerical_faults"] = sum(e["kind"] == "numerical_fault" for e in events)
        out["normal_step_s"] = normal_step_s(
            [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] > args.exclude])
        return out

    return common.rate_run(run_dir.name, cmd, args, work, {
        "runner": runner, "round": rnd, "run_dir": str(run_dir)}, measure)


def overhead_summary(results: list[dict[str, Any]], rounds: int) -> dict[str, Any]:
    """The ratio of median tokens/s (checks on / off), the paired ratios of each round, the
    verdict, false positives, and whether the checks changed any loss."""
    names = list(RUNNERS)
    medians = common.medians(results, "runner", names)
    paired = common.paired(common.by_round(results, "runner"), CHECKS_ON, CHECKS_OFF, rounds)
    measured = [r for r in results if "tokens_per_s" in r]
    r = ratio(medians[CHECKS_ON], medians[CHECKS_OFF])
    return {"median_tokens_per_s": medians, "ratio": r,
            "median_step_s": {n: median(x.get("normal_step_s") for x in measured
                                        if x["runner"] == n) for n in names}, "paired_ratios": paired,
            "paired_ratio_median": median(paired), "target": TARGET,
            "target_met": r is not None and r >= TARGET,
            "false_positives": sum(x.get("numerical_faults", 0) for x in measured),
            "loss_max_abs_diff": common.worst_loss_diff(
                (a, b) for a in measured for b in measured
                if a["runner"] == CHECKS_ON and b["runner"] == CHECKS_OFF)}


def print_overhead(results: list[dict[str, Any]], summary: dict[str, Any],
                   args: argparse.Namespace) -> None:
    rates = common.by_round(results, "runner")
    table = [["runner", *(f"round {i + 1}" for i in range(args.rounds)), "median"]]
    for n in RUNNERS:
        table.append([n, *(fmt(rates.get((n, i)), ",.0f") for i in range(args.rounds)),
                      fmt(summary["median_tokens_per_s"][n], ",.0f")])
    print(f"\ntokens/s (steady state, steps {args.exclude + 1}..{args.steps})")
    common.print_columns(table)
    paired = summary["paired_ratios"]
    print(f"{CHECKS_ON} / {CHECKS_OFF} = {fmt(summary['ratio'], '.3f')} (median of "
          f"{args.rounds}); paired (same round): "
          + (f"{common.spread(paired)}" if paired else "none")
          + f"; target >= {TARGET}: {'MET' if summary['target_met'] else 'NOT MET'}")
    step = summary["median_step_s"]
    print("median step: " + ", ".join(f"{n} {fmt(None if step[n] is None else step[n] * 1e3, '.1f')} ms"
                                      for n in RUNNERS))
    diff = summary["loss_max_abs_diff"]
    print(f"false positives (numerical_fault events in these fault-free runs): "
          f"{summary['false_positives']}; loss {CHECKS_ON} vs {CHECKS_OFF}, max |diff| {diff} "
          f"-> {'identical' if diff == 0.0 else 'NOT IDENTICAL' if diff is not None else '-'}")


# ---------------------------------------------------------------------- side by side


def stalwart_side_row(r: dict[str, Any]) -> dict[str, Any]:
    """stalwart's nan run in the peers' row shape."""
    return {"runner": "stalwart", "mode": "default", "outcome": r.get("outcome", "failed"),
            "first_nan_step": r.get("first_nan_step"), "final_loss": r.get("final_loss"),
            "finite_steps_after_fault": r.get("finite_steps_after_fault"),
            "steps_after_fault": r.get("steps_after_fault"), "exit_code": r.get("exit_code"),
            "wall_s": r.get("wall_s"),
            "detail": r.get("error") or (f"decided {r['actions']} {fmt(r['detection_s'], '.3f')} s "
                                         f"after the fault; {r['failures']} failure event(s)")}


def peer_side_row(row: dict[str, Any], fault_step: int) -> dict[str, Any]:
    """A peer's row with its steps logged after the fault counted, without its loss curve."""
    after = sum(int(s) > fault_step for s in row.get("loss_by_step", {}))
    return {k: v for k, v in row.items() if k != "loss_by_step"} | {"steps_after_fault": after}


def side_cells(r: dict[str, Any]) -> list[str]:
    finite, after = r.get("finite_steps_after_fault"), r.get("steps_after_fault")
    loss = r.get("final_loss")
    return [r["runner"], r["mode"], r["outcome"],
            "-" if finite is None else f"{finite}/{after}" if after is not None else str(finite),
            "-" if loss is None else f"{loss:.4f}", fmt(r.get("wall_s"), ".1f")]


def print_side(rows: list[dict[str, Any]], fault_step: int) -> None:
    table = [["runner", "mode", "outcome", "finite steps after fault", "final loss", "wall s"]]
    table += [side_cells(r) for r in rows]
    print(f"\none NaN loss on rank 1 at step {fault_step} of {FAULT_RUN_STEPS}, side by side")
    common.print_columns(table)
    for r in rows:
        print(f"  {r['runner']} ({r['mode']}): {r.get('detail', '')}")


def run_peers(args: argparse.Namespace, work: Path, fault_step: int) -> list[dict[str, Any]]:
    from bench.peers.numerics_peers import run_peer_rows

    print(f"peers: torchrun and Ray Train, {FAULT_RUN_STEPS} steps, NaN on rank 1 at step "
          f"{fault_step}", flush=True)
    rows = run_peer_rows(work, steps=FAULT_RUN_STEPS, fault_step=fault_step,
                         timeout_s=args.timeout)
    return [peer_side_row(r, fault_step) for r in rows]


# ---------------------------------------------------------------------- the whole bench


def settings(args: argparse.Namespace, tps: int, overhead_overrides: list[str]
             ) -> dict[str, Any]:
    return {"workers": WORKERS, "config": str(common.DEFAULT_CONFIG), "base_overrides": BASE,
            "fault_run_steps": FAULT_RUN_STEPS, "faults": FAULTS, "rounds": args.rounds,
            "overhead_steps": args.steps, "excluded_steps": args.exclude,
            "overhead_overrides": overhead_overrides, "runners": RUNNERS,
            "tokens_per_step": tps, "timeout_s": args.timeout, "skip_peers": args.skip_peers}


def measure(args: argparse.Namespace, work: Path, tps: int, overhead_overrides: list[str]
            ) -> dict[str, Any]:
    print("faults: one stalwart run --inject each", flush=True)
    faults = [fault_run(kind, args, work / "faults") for kind in FAULTS]
    print(f"overhead: {args.rounds} round(s) x {list(RUNNERS)}, {args.steps} steps each "
          f"(first {args.exclude} excluded), {tps} tokens/step", flush=True)
    (work / "overhead").mkdir()
    runs = common.run_rounds(list(RUNNERS), args.rounds, partial(
        overhead_run, args=args, work=work / "overhead", tps=tps, overrides=overhead_overrides),
        work=work / "overhead", keep=args.keep, prune_measured=True)
    nan_step = FAULTS["nan"]["step"]
    nan_row = next(r for r in faults if r["fault"] == "nan")
    peers = [] if args.skip_peers else run_peers(args, work / "peers", nan_step)
    return {"faults": faults, "overhead_runs": runs, "side_by_side": [
        stalwart_side_row(nan_row), *peers], "nan_step": nan_step}


def main(argv: list[str] | None = None) -> int:
    from bench.recovery import changed_note, git_revision

    args = parse_args(argv)
    t0, revision = time.time(), git_revision()
    overhead_overrides = [*BASE, f"train.steps={args.steps}",
                          f"checkpoint.persist_every={args.steps + 1}"]
    tps, _ = common.tokens_per_step(str(common.DEFAULT_CONFIG), overhead_overrides)
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-numerics-"))
    (work / "faults").mkdir()
    changes = f" + changes to {', '.join(revision['modified'])}" if revision["modified"] else ""
    print(f"numerics: {WORKERS} workers, {os.cpu_count()} CPUs, commit "
          f"{(revision['commit'] or '?')[:7]}{changes}; runs in {work}", flush=True)
    out = measure(args, work, tps, overhead_overrides)
    summary = overhead_summary(out["overhead_runs"], args.rounds)
    print_faults(out["faults"])
    print_overhead(out["overhead_runs"], summary, args)
    print_side(out["side_by_side"], out["nan_step"])
    end_revision = git_revision()
    if note := changed_note(revision, end_revision):
        print(f"note: {note}")
    failed = [r for r in out["faults"] if "error" in r] + [
        r for r in out["overhead_runs"] if "tokens_per_s" not in r]
    if failed or args.keep:
        print(f"kept {work}" + (f": {len(failed)} run(s) failed" if failed else ""))
    else:
        shutil.rmtree(work, ignore_errors=True)
        for r in out["faults"] + out["side_by_side"]:  # their folders are gone
            for key in ("log", "run_dir", "workdir"):
                r.pop(key, None)
    common.write_report(args.out, {
        "bench": "numerics", "time": t0, "wall_s": time.time() - t0, "faults": out["faults"],
        "overhead": summary, "side_by_side": out["side_by_side"],
        "settings": settings(args, tps, overhead_overrides),
        "git": {"at_start": revision, "at_end": end_revision}}, out["overhead_runs"])
    print(f"whole benchmark: {(time.time() - t0) / 60:.1f} min")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
