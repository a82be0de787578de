"""Cold start: from the command to the first completed step, `stalwart run` against torchrun
and Ray Train's TorchTrainer, the same model, data and batch on 2 workers (stalwart as the
config has it, with its warm spare, and without the spare); then where stalwart's start-up
goes, phase by phase.

Each run is the command a user types, launched with subprocess.Popen (its clock starts just
before), and timed to the end of its first step in its own step log: stalwart's
metrics.jsonl (run.log_every = 1), rank 0's steps.jsonl for torchrun
(bench/peers/torchrun_recovery.py under `torchrun --standalone`) and for Ray Train
(bench/peers/raytrain_cold.py: `ray.init`, then `TorchTrainer.fit()` over
bench/peers/raytrain_worker.py's loop), and with the CPU seconds its whole process tree had
used by then (the run's daemons, workers and ranks), which load from other work hardly
moves. The data is tokenized before any clock starts. Rounds alternate the
order. Then one more stalwart run, with a timing probe in every Python process
of it (bench/cold_start_probe/sitecustomize.py), gives stalwart's start-up by phase.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path
from typing import Any

from bench import common
from bench.common import fmt, ratio
from bench.harness import Launch
from bench.peers import torchrun_recovery
from stalwart.core import events as ev
from stalwart.core.events import read_jsonl
from stalwart.report.summary import median

RUNNERS = ("stalwart", "stalwart-no-spare", "torchrun", "ray-train")
LABELS = {"stalwart": "stalwart run", "stalwart-no-spare": "stalwart, no spare",
          "torchrun": "torchrun", "ray-train": "Ray Train"}
# The reference config keeps a warm spare (scaling.spare_workers = 1): a third actor that
# starts beside the two ranks. The same run without it shows what it costs a cold start.
NO_SPARE = ["scaling.spare_workers=0"]
STEPS = 3
TARGET_VS_RAY_TRAIN = 0.5  # stalwart's cold start <= 0.5 x Ray Train's
# Every system: a few steps, no LR warm-up to fit in them, no validation.
COMMON = [f"train.steps={STEPS}", "train.warmup_steps=0", "data.val_every=0"]
# stalwart logs every step (the first one is the one timed) and draws no progress bar.
STALWART_SETS = ["run.log_every=1", "run.progress=false"]
PROBE_DIR = Path(__file__).resolve().parent / "cold_start_probe"
PROBE_ENV = "STALWART_STARTUP_PROBE"
STEPS_FILE = "steps.jsonl"  # the peers' step log (torchrun_recovery, raytrain_worker)
ATTEMPTS_FILE = "attempts.jsonl"
POLL_S = 0.1  # how often a run's step log is read for its first step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__, __spec__, "cold_start.json")
    common.add_config_args(p, sets=False)
    common.add_run_args(p, 300.0, rounds=2)
    p.add_argument("--tiny", action="store_true",
                   help="the tiny GPT of bench/common.py TINY instead of the config's model")
    p.add_argument("--only", choices=RUNNERS, action="append",
                   help="run only these systems (repeatable; default all)")
    p.add_argument("--no-phases", action="store_true",
                   help="skip the probed stalwart run that breaks its start-up into phases")
    return p.parse_args(argv)


# ---------------------------------------------------------------------- reading step logs


def first_step_time(rows: Iterable[tuple[int, float]]) -> float | None:
    """When the earliest step of a step log ended ((step, time) rows); None if none did."""
    return min((t for _, t in rows), default=None)


def stalwart_first_step(run_dir: Path) -> float | None:
    """The end of a stalwart run's first logged step (metrics.jsonl, run.log_every = 1)."""
    return first_step_time((r.step, r.time) for r in ev.read_metrics(run_dir / "metrics.jsonl"))


def peer_first_step(workdir: Path) -> float | None:
    """The end of a peer's first step, as rank 0 logged it in steps.jsonl."""
    return first_step_time((r["step"], r["time"]) for r in read_jsonl(workdir / STEPS_FILE))


def peer_milestones(workdir: Path, launch: float) -> dict[str, float | None]:
    """Seconds after launch when a peer's ranks entered its code (`start`: torchrun's rank
    process began, Ray Train's train loop began) and were `ready` to train (data and DDP
    model built): the latest rank of each."""
    rows = read_jsonl(workdir / ATTEMPTS_FILE)
    out: dict[str, float | None] = {}
    for event in ("start", "ready"):
        times = [r["time"] for r in rows if r["event"] == event and not r.get("stopping")]
        out[f"{event}_s"] = max(times) - launch if times else None
    return out


def stalwart_milestones(run_dir: Path, launch: float) -> dict[str, float | None]:
    """Seconds after launch when the first world launched its training loops
    (`workers_started`) and when its first step began (its metrics row's window)."""
    started = next((e for e in ev.read_events(run_dir / "events.jsonl")
                    if isinstance(e, ev.WorkersStarted)), None)
    rows = ev.read_metrics(run_dir / "metrics.jsonl")
    first = min(rows, key=lambda r: r.time) if rows else None
    return {"workers_started_s": None if started is None else started.time - launch,
            "first_step_began_s": (None if first is None or first.window_s is None
                                   else first.time - first.window_s - launch)}


# ---------------------------------------------------------------------- the table


def summarize(results: list[dict[str, Any]], names: Iterable[str] = RUNNERS) -> dict[str, Any]:
    """Median cold start of each system over its measured runs, and its ratio to Ray Train's
    and torchrun's medians (None where either is missing)."""
    names = list(names)
    med = {n: median(r.get("cold_start_s") for r in results if r["runner"] == n) for n in names}
    return {"median_s": med,
            "x_ray_train": {n: ratio(m, med.get("ray-train")) for n, m in med.items()},
            "x_torchrun": {n: ratio(m, med.get("torchrun")) for n, m in med.items()},
            "median_cpu_s": {n: median(r.get("cpu_s_to_first_step") for r in results
                                       if r["runner"] == n) for n in names}}


def table_rows(summary: dict[str, Any], results: list[dict[str, Any]]) -> list[list[str]]:
    """The printed table: each system's median, its ratios, and every run with its load."""
    rows = [["system", "median s", "x Ray Train", "x torchrun", "CPU s", "runs s (load)"]]
    for name, med in summary["median_s"].items():
        runs = ", ".join(f"{fmt(r.get('cold_start_s'), '.1f')} ({r['load_before']:.1f})"
                         for r in results if r["runner"] == name)
        rows.append([LABELS.get(name, name), fmt(med, ".1f"),
                     fmt(summary["x_ray_train"][name], ".2f"),
                     fmt(summary["x_torchrun"][name], ".2f"),
                     fmt(summary["median_cpu_s"][name], ".1f"), runs])
    return rows


# Each system's milestones, as its own logs give them (seconds after launch).
MILESTONES = {"workers_started_s": "world launched", "first_step_began_s": "first step began",
              "start_s": "ranks' code began", "ready_s": "data and model ready"}


def milestone_rows(results: list[dict[str, Any]], names: Iterable[str]) -> list[list[str]]:
    """Each system's median milestones: what its cold start is made of."""
    rows = [["system", "milestones (median s after launch)"]]
    for name in names:
        mine = [r for r in results if r["runner"] == name]
        cells = [f"{label} {fmt(med, '.1f').strip()}" for key, label in MILESTONES.items()
                 if (med := median(r.get(key) for r in mine)) is not None]
        rows.append([LABELS.get(name, name), ", ".join(cells) or "-"])
    return rows


def verdict(summary: dict[str, Any]) -> str:
    x = summary["x_ray_train"].get("stalwart")
    if x is None:
        return "goal: not measured (a stalwart or Ray Train run failed)"
    met = "met" if x <= TARGET_VS_RAY_TRAIN else "NOT met"
    cpu = ratio(summary["median_cpu_s"].get("stalwart"), summary["median_cpu_s"].get("ray-train"))
    # The CPU seconds' ratio is what a busy machine's wall times tend to, whatever its load.
    by_cpu = "" if cpu is None else f"; {cpu:.2f} x its CPU s"
    return f"goal stalwart <= {TARGET_VS_RAY_TRAIN} x Ray Train: {met} ({x:.2f} x{by_cpu})"


# ---------------------------------------------------------------------- the runs


def overrides(args: argparse.Namespace) -> list[str]:
    """What every system trains: the config's model (or the tiny one), COMMON."""
    return [*(common.TINY if args.tiny else []), *COMMON]


def command(runner: str, where: Path, args: argparse.Namespace) -> list[str]:
    sets = overrides(args)
    if runner.startswith("stalwart"):
        spare = NO_SPARE if runner == "stalwart-no-spare" else []
        return common.stalwart_command(args.config, [*sets, *STALWART_SETS, *spare], where)
    if runner == "torchrun":
        return torchrun_recovery.torchrun_command(where, nproc=2, steps=STEPS,
                                                  checkpoint_every=STEPS, config=args.config,
                                                  overrides=sets)
    return [sys.executable, "-m", "bench.peers.raytrain_cold", "--workdir", str(where),
            "--steps", str(STEPS), "--config", str(args.config), *common.set_args(sets)]


def tree_cpu_s(root: int, proc: Path = Path("/proc")) -> float:
    """CPU seconds (user + system) used so far by process `root` and all its descendants,
    with the children they reaped: a run's whole process tree (Ray's daemons and workers,
    torchrun's ranks). Unlike wall time, the figure hardly moves when other work shares the
    machine."""
    parent: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        pid = int(stat.parent.name)
        # fields[0] is the state, field 3 of proc(5): ppid is field 4, the ticks 14 to 17.
        parent[pid] = int(fields[1])
        ticks[pid] = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, todo = 0, [root] if root in ticks else []
    while todo:
        pid = todo.pop()
        total += ticks[pid]
        todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


def launch_and_wait(cmd: list[str], log: Path, timeout: float,
                    first_step: Callable[[], float | None],
                    env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run cmd to its end; past timeout the whole session is killed (exit code -1). Returns
    its launch time, exit code, wall s, and the CPU s its processes had used when
    `first_step()` first found a step logged (None if none was)."""
    run = Launch(cmd, log, env=env)
    deadline, cpu = run.time + timeout, None
    while run.running() and time.time() < deadline:
        if cpu is None and first_step() is not None:
            cpu = tree_cpu_s(run.proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            run.proc.wait(timeout=POLL_S)
    timed_out = run.running()
    if timed_out:
        run.kill()
    code = -1 if timed_out else run.proc.returncode
    return {"launch": run.time, "exit_code": code, "wall_s": time.time() - run.time,
            "cpu_s_to_first_step": cpu}


def run_one(runner: str, rnd: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    where = work / f"r{rnd}-{runner}"
    stalwart = runner.startswith("stalwart")
    if not stalwart:
        where.mkdir(parents=True)  # the peers write their step log there
    log = work / f"r{rnd}-{runner}.log"
    result: dict[str, Any] = {"runner": runner, "round": rnd, "load_before": os.getloadavg()[0],
                              "log": str(log), "dir": str(where)}
    first_step = partial(stalwart_first_step if stalwart else peer_first_step, where)
    run = launch_and_wait(command(runner, where, args), log, args.timeout, first_step)
    launch, code = run.pop("launch"), run["exit_code"]
    result.update(run)
    first = first_step()
    result["cold_start_s"] = None if first is None else first - launch
    result.update(stalwart_milestones(where, launch) if stalwart
                  else peer_milestones(where, launch))
    if code != 0 or first is None:
        result["error"] = f"exit code {code}" + ("" if first else ", no step logged")
        print(f"  {runner}: FAILED ({result['error']}); last lines of {log}:\n"
              f"{common.tail(log, indent='    ')}", flush=True)
    else:
        print(f"  {runner}: first step {result['cold_start_s']:.1f}s after launch, "
              f"{fmt(result['cpu_s_to_first_step'], '.1f')} CPU s by then (whole run "
              f"{run['wall_s']:.1f}s, load {result['load_before']:.2f})", flush=True)
    return result


def run_rounds(args: argparse.Namespace, names: list[str], work: Path) -> list[dict[str, Any]]:
    results = []
    for rnd in range(args.rounds):
        order = names if rnd % 2 == 0 else names[::-1]
        print(f"round {rnd + 1}/{args.rounds}: {' -> '.join(order)}", flush=True)
        results += [run_one(name, rnd, args, work) for name in order]
    return results


# ---------------------------------------------------------------------- stalwart's phases

# (label, where, kind, name): `call` a function the probe timed, `import` a module's first
# import in that process. `driver` is the `stalwart` process, `ranks` the first world's
# ranks (from the earliest start to the latest end among them).
PHASES: tuple[tuple[str, str, str, str], ...] = (
    ("import torch", "driver", "import", "torch"),
    ("import ray", "driver", "import", "ray"),
    ("import the orchestrator", "driver", "import", "stalwart.orchestrator.controller"),
    ("memory check (model on meta)", "driver", "call", "stalwart.plan.preflight:check_run_memory"),
    ("memory check (model on meta)", "driver", "call", "stalwart.trainer:Trainer._check_memory"),
    ("task check (model, 2 samples)", "driver", "call", "stalwart.task_check:check_task"),
    ("data preparation", "driver", "call", "stalwart.examples.gpt.task:GPTTask.prepare_data"),
    ("Ray start (ray.init)", "driver", "call", "ray._private.worker:init"),
    ("controller: actors to first step", "driver", "call",
     "stalwart.orchestrator.controller:Controller.run"),
    ("actor imports (torch, worker)", "ranks", "call", "stalwart.workers.actor:TrainWorker.__init__"),
    ("warm-up (task, data, 1 micro-step)", "ranks", "call", "stalwart.workers.worker:Worker.warm_up"),
    ("data preparation", "ranks", "call", "stalwart.examples.gpt.task:GPTTask.prepare_data"),
    ("setup (rendezvous, model, optimizer)", "ranks", "call", "stalwart.workers.worker:Worker.setup"),
    ("process group", "ranks", "call", "stalwart.parallel.distributed:init_process_group"),
    ("model and optimizer build", "ranks", "call", "stalwart.workers.engine:TrainEngine.__init__"),
)


def _first(rows: list[dict[str, Any]], pid: int, kind: str, name: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["pid"] == pid and r.get(kind) == name), None)


def probe_phases(rows: list[dict[str, Any]], launch: float, rank_pids: list[int],
                 first_step: float | None) -> list[dict[str, Any]]:
    """stalwart's start-up by phase from the probe's rows ({"call" or "import" or "process",
    "t0", "t1", "pid"}): each phase's start, end and seconds after `launch`, in order of start.
    The driver is the process that ran the CLI's main; `rank_pids` are the first world's."""
    rows = sorted(rows, key=lambda r: r["t1"])
    main = next((r for r in rows if r.get("call") == "stalwart.cli.main:_main"), None)
    if main is None:
        return []
    driver = main["pid"]
    out = [_phase("python and the CLI's imports", "driver", launch, launch, main["t0"])]
    for label, where, kind, name in PHASES:
        found = [r for pid in ([driver] if where == "driver" else rank_pids)
                 if (r := _first(rows, pid, kind, name)) is not None]
        if found:
            out.append(_phase(label, where, launch, min(r["t0"] for r in found),
                              max(r["t1"] for r in found)))
    procs = [r for r in rows if "process" in r and r["pid"] in rank_pids]
    if procs:  # from Ray asking for the process to Python running in it (sitecustomize)
        run = next((r for r in rows if r.get("call", "").endswith("Controller.run")), None)
        begin = run["t0"] if run is not None else min(r["t1"] for r in procs)
        out.append(_phase("actor processes up", "ranks", launch, begin,
                          max(r["t1"] for r in procs)))
    starts = [r for pid in rank_pids
              if (r := _first(rows, pid, "call", "stalwart.workers.worker:Worker.start"))]
    if starts and first_step is not None:
        out.append(_phase("first step", "ranks", launch, min(r["t0"] for r in starts),
                          first_step))
    return sorted(out, key=lambda p: (p["start_s"], p["end_s"]))


def _phase(label: str, where: str, launch: float, t0: float, t1: float) -> dict[str, Any]:
    return {"phase": label, "where": where, "start_s": t0 - launch, "end_s": t1 - launch,
            "seconds": t1 - t0}


def probe_run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One stalwart run with the probe in every Python process of it: its phases."""
    run_dir, probe = work / "probe-stalwart", work / "probe.jsonl"
    env = common.child_env()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROBE_DIR), env.get("PYTHONPATH")]))
    env[PROBE_ENV] = str(probe)
    load = os.getloadavg()[0]
    run = launch_and_wait(command("stalwart", run_dir, args), work / "probe-stalwart.log",
                          args.timeout, partial(stalwart_first_step, run_dir), env)
    launch, code, wall = run["launch"], run["exit_code"], run["wall_s"]
    first = stalwart_first_step(run_dir)
    started = [e for e in ev.read_events(run_dir / "events.jsonl")
               if isinstance(e, ev.WorkersStarted)]
    pids = [w.pid for w in started[0].workers] if started else []
    return {"exit_code": code, "wall_s": wall, "load_before": load,
            "cold_start_s": None if first is None else first - launch,
            "phases": probe_phases(read_jsonl(probe), launch, pids, first)}


def phase_rows(phases: list[dict[str, Any]]) -> list[list[str]]:
    rows = [["phase", "where", "from s", "to s", "seconds"]]
    rows += [[p["phase"], p["where"], f"{p['start_s']:.2f}", f"{p['end_s']:.2f}",
              f"{p['seconds']:.2f}"] for p in phases]
    return rows


# ---------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [n for n in RUNNERS if not args.only or n in args.only]
    sets = overrides(args)
    common.tokens_per_step(args.config, sets)  # tokenizes the data outside every clock
    work = Path(tempfile.mkdtemp(prefix="stalwart-bench-cold-start-"))
    model = "the tiny GPT (bench/common.py TINY)" if args.tiny else f"{args.config}'s model"
    print(f"cold start: {args.rounds} round(s) x {names}, {model}, 2 workers, {STEPS} steps; "
          f"{os.cpu_count()} CPUs; logs in {work}\n  every run: {' '.join(sets)}", flush=True)
    try:
        results = run_rounds(args, names, work)
        probe = None if args.no_phases or "stalwart" not in names else probe_run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    summary = summarize(results, names)
    print()
    common.print_columns(table_rows(summary, results))
    print(verdict(summary))
    print()
    common.print_columns(milestone_rows(results, names))
    if probe is not None:
        print(f"\nstalwart's start-up by phase (one probed run: first step "
              f"{fmt(probe['cold_start_s'], '.1f')}s, load {probe['load_before']:.2f}):")
        common.print_columns(phase_rows(probe["phases"]))
    report = {"settings": {"rounds": args.rounds, "config": args.config, "tiny": args.tiny,
                           "steps": STEPS, "overrides": sets, "stalwart_sets": STALWART_SETS,
                           "workers": 2, "target_x_ray_train": TARGET_VS_RAY_TRAIN},
              **summary, "verdict": verdict(summary), "stalwart_phases": probe}
    for r in results:
        with contextlib.suppress(KeyError):
            if not args.keep:
                del r["log"], r["dir"]
    common.write_report(args.out, report, results)
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
