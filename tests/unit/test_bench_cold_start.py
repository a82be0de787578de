"""The cold-start benchmark's reading of its runs (bench/cold_start.py): the first step of each
system's step log, the milestones, the median/ratio table, stalwart's phases from the probe's
rows, and the probe itself in a real process. The runs themselves are the benchmark."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cold_start
from stalwart.core import events as ev

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

LAUNCH = 1000.0


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _metrics(step: int, t: float, window_s: float = 0.3) -> dict:
    return ev.MetricsRow(step=step, loss=5.0, lr=3e-3, tokens_per_s=1e4, world_size=2,
                         samples_seen=32 * step, time=t, window_s=window_s,
                         steps_in_window=1).to_row()


def test_the_first_step_is_the_earliest_end_in_the_log() -> None:
    assert cold_start.first_step_time([(2, LAUNCH + 9.0), (1, LAUNCH + 8.5)]) == LAUNCH + 8.5
    assert cold_start.first_step_time([]) is None


def test_stalwart_is_timed_from_its_metrics_and_its_workers_started_event(tmp_path: Path) -> None:
    _jsonl(tmp_path / "metrics.jsonl", [_metrics(1, LAUNCH + 10.0, 0.4),
                                        _metrics(2, LAUNCH + 10.3)])
    _jsonl(tmp_path / "events.jsonl", [
        ev.Started(time=LAUNCH + 9.5, world_size=2, steps=3, start_step=0, task="t").to_row(),
        ev.WorkersStarted(time=LAUNCH + 9.5, generation=0, world_size=2).to_row()])
    assert cold_start.stalwart_first_step(tmp_path) == LAUNCH + 10.0
    milestones = cold_start.stalwart_milestones(tmp_path, LAUNCH)
    assert milestones["workers_started_s"] == pytest.approx(9.5)
    assert milestones["first_step_began_s"] == pytest.approx(9.6)  # its window: 0.4 s


def test_a_run_that_logged_nothing_has_no_first_step(tmp_path: Path) -> None:
    assert cold_start.stalwart_first_step(tmp_path) is None
    assert cold_start.peer_first_step(tmp_path) is None
    assert cold_start.stalwart_milestones(tmp_path, LAUNCH) == {
        "workers_started_s": None, "first_step_began_s": None}
    assert cold_start.peer_milestones(tmp_path, LAUNCH) == {"start_s": None, "ready_s": None}


def test_a_peer_is_timed_from_rank_0s_steps_and_its_slowest_rank(tmp_path: Path) -> None:
    _jsonl(tmp_path / "steps.jsonl", [{"step": 1, "time": LAUNCH + 20.0, "loss": 5.0},
                                      {"step": 2, "time": LAUNCH + 20.5, "loss": 4.9}])
    _jsonl(tmp_path / "attempts.jsonl", [
        {"event": "start", "time": LAUNCH + 3.0, "rank": 0},
        {"event": "start", "time": LAUNCH + 3.5, "rank": 1},
        {"event": "start", "time": LAUNCH + 30.0, "rank": 1, "stopping": True},
        {"event": "ready", "time": LAUNCH + 18.0, "rank": 1},
        {"event": "ready", "time": LAUNCH + 17.0, "rank": 0}])
    assert cold_start.peer_first_step(tmp_path) == LAUNCH + 20.0
    assert cold_start.peer_milestones(tmp_path, LAUNCH) == {"start_s": 3.5, "ready_s": 18.0}


def _result(runner: str, s: float | None, load: float = 1.0, cpu: float | None = None) -> dict:
    return {"runner": runner, "cold_start_s": s, "load_before": load, "cpu_s_to_first_step": cpu}


def test_the_table_gives_medians_and_their_ratios_to_ray_train_and_torchrun() -> None:
    results = [_result("stalwart", 10.0, cpu=20.0), _result("stalwart", 12.0, cpu=22.0),
               _result("torchrun", 5.0), _result("torchrun", 7.0),
               _result("ray-train", 30.0), _result("ray-train", 34.0, load=2.5)]
    summary = cold_start.summarize(results, ["stalwart", "torchrun", "ray-train"])
    assert summary["median_s"] == {"stalwart": 11.0, "torchrun": 6.0, "ray-train": 32.0}
    assert summary["x_ray_train"]["stalwart"] == pytest.approx(11 / 32)
    assert summary["x_torchrun"]["stalwart"] == pytest.approx(11 / 6)
    assert summary["x_ray_train"]["ray-train"] == 1.0
    assert summary["median_cpu_s"] == {"stalwart": 21.0, "torchrun": None, "ray-train": None}
    rows = cold_start.table_rows(summary, results)
    assert rows[0][:5] == ["system", "median s", "x Ray Train", "x torchrun", "CPU s"]
    assert rows[1][:5] == ["stalwart run", "11.0", "0.34", "1.83", "21.0"]
    assert rows[3][5] == "30.0 (1.0), 34.0 (2.5)"
    assert "met (0.34 x)" in cold_start.verdict(summary)  # no CPU figure for Ray Train
    results.append(_result("ray-train", 32.0, cpu=42.0))
    assert "met (0.34 x; 0.50 x its CPU s)" in cold_start.verdict(
        cold_start.summarize(results, ["stalwart", "torchrun", "ray-train"]))


def test_the_milestones_are_each_systems_medians_of_what_its_logs_give() -> None:
    results = [{"runner": "stalwart", "workers_started_s": 9.0, "first_step_began_s": 9.5},
               {"runner": "stalwart", "workers_started_s": 11.0, "first_step_began_s": None},
               {"runner": "torchrun", "start_s": 1.0, "ready_s": 4.0},
               {"runner": "ray-train"}]
    rows = cold_start.milestone_rows(results, ["stalwart", "torchrun", "ray-train"])
    assert rows[1] == ["stalwart run", "world launched 10.0, first step began 9.5"]
    assert rows[2] == ["torchrun", "ranks' code began 1.0, data and model ready 4.0"]
    assert rows[3] == ["Ray Train", "-"]


def test_a_failed_system_has_no_median_and_no_ratio() -> None:
    results = [_result("stalwart", 40.0), _result("ray-train", None), _result("torchrun", 5.0)]
    summary = cold_start.summarize(results, ["stalwart", "torchrun", "ray-train"])
    assert summary["median_s"]["ray-train"] is None
    assert summary["x_ray_train"]["stalwart"] is None
    assert summary["x_torchrun"]["stalwart"] == 8.0
    assert cold_start.table_rows(summary, results)[3][1].strip() == "-"
    assert "not measured" in cold_start.verdict(summary)
    slow = cold_start.summarize([_result("stalwart", 20.0), _result("ray-train", 30.0)],
                                ["stalwart", "ray-train"])
    assert "NOT met (0.67 x)" in cold_start.verdict(slow)


def _stat(proc: Path, pid: int, ppid: int, ticks: tuple[int, int, int, int],
          comm: str = "python") -> None:
    """A /proc/PID/stat line as proc(5) lays it out: the parent is field 4, the CPU ticks
    (utime, stime, cutime, cstime) fields 14 to 17."""
    (proc / str(pid)).mkdir()
    fields = ["S", str(ppid), str(pid), str(pid), "0", "-1", "0", "0", "0", "0", "0",
              *map(str, ticks), "20", "0"]
    (proc / str(pid) / "stat").write_text(f"{pid} ({comm}) {' '.join(fields)}\n")


def test_a_runs_cpu_is_its_process_trees_with_what_they_reaped(tmp_path: Path) -> None:
    hz = os.sysconf("SC_CLK_TCK")
    _stat(tmp_path, 500, 1, (2 * hz, hz, 0, 0), comm="stalwart run (x)")  # ")" in its name
    _stat(tmp_path, 510, 500, (3 * hz, 0, hz, hz))  # a child
    _stat(tmp_path, 520, 510, (hz, 0, 0, 0))  # a grandchild (a rank of a raylet, say)
    _stat(tmp_path, 600, 1, (50 * hz, 0, 0, 0))  # not the run's
    (tmp_path / "self").mkdir()  # not a process id
    assert cold_start.tree_cpu_s(500, tmp_path) == pytest.approx(9.0)
    assert cold_start.tree_cpu_s(510, tmp_path) == pytest.approx(6.0)
    assert cold_start.tree_cpu_s(700, tmp_path) == 0.0


def test_the_first_step_is_timed_while_the_run_goes_on_and_its_cpu_read_then(
        tmp_path: Path) -> None:
    code = ("import json, time; time.sleep(0.3); "
            f"open({str(tmp_path / 'steps.jsonl')!r}, 'a').write(json.dumps("
            "{'step': 1, 'time': time.time()}) + '\\n'); time.sleep(0.3)")
    run = cold_start.launch_and_wait([sys.executable, "-c", code], tmp_path / "log", 50.0,
                                     lambda: cold_start.peer_first_step(tmp_path))
    assert run["exit_code"] == 0
    assert run["cpu_s_to_first_step"] is not None and run["cpu_s_to_first_step"] >= 0
    assert cold_start.peer_first_step(tmp_path) > run["launch"]  # the clock starts first
    slow = cold_start.launch_and_wait([sys.executable, "-c", "import time; time.sleep(30)"],
                                      tmp_path / "log", 0.5, lambda: None)
    assert (slow["exit_code"], slow["cpu_s_to_first_step"]) == (-1, None)


def _call(pid: int, name: str, t0: float, t1: float) -> dict:
    return {"pid": pid, "call": name, "t0": LAUNCH + t0, "t1": LAUNCH + t1}


def test_the_phases_come_from_the_driver_and_the_first_worlds_ranks_only() -> None:
    driver, rank0, rank1, spare = 10, 20, 21, 22
    rows = [
        _call(driver, "stalwart.cli.main:_main", 0.2, 12.0),
        {"pid": driver, "import": "torch", "t0": LAUNCH + 0.3, "t1": LAUNCH + 1.8},
        _call(driver, "stalwart.task_check:check_task", 2.5, 3.0),
        _call(driver, "ray._private.worker:init", 0.4, 3.2),
        _call(driver, "stalwart.orchestrator.controller:Controller.run", 3.3, 12.0),
        *[{"pid": p, "process": "default_worker.py", "t0": None, "t1": LAUNCH + t}
          for p, t in ((rank0, 3.6), (rank1, 3.7), (spare, 3.8))],
        _call(rank0, "stalwart.workers.actor:TrainWorker.__init__", 4.0, 7.0),
        _call(rank1, "stalwart.workers.actor:TrainWorker.__init__", 4.1, 7.5),
        _call(spare, "stalwart.workers.actor:TrainWorker.__init__", 4.2, 9.0),
        _call(rank0, "stalwart.workers.worker:Worker.warm_up", 7.0, 7.4),
        _call(rank0, "stalwart.workers.worker:Worker.warm_up", 7.9, 7.9),  # again, in setup
        _call(rank0, "stalwart.workers.worker:Worker.start", 8.0, 8.0),
        _call(rank1, "stalwart.workers.worker:Worker.start", 8.1, 8.1),
    ]
    phases = cold_start.probe_phases(rows, LAUNCH, [rank0, rank1], first_step=LAUNCH + 8.4)
    by = {p["phase"]: p for p in phases}
    assert by["python and the CLI's imports"]["end_s"] == pytest.approx(0.2)
    assert by["Ray start (ray.init)"]["seconds"] == pytest.approx(2.8)
    imports = by["actor imports (torch, worker)"]  # the spare's slower import is not the ranks'
    assert (imports["start_s"], imports["end_s"]) == (pytest.approx(4.0), pytest.approx(7.5))
    assert by["warm-up (task, data, 1 micro-step)"]["end_s"] == pytest.approx(7.4)
    assert by["actor processes up"]["start_s"] == pytest.approx(3.3)
    assert by["actor processes up"]["end_s"] == pytest.approx(3.7)
    assert by["first step"]["start_s"] == pytest.approx(8.0)
    assert by["first step"]["seconds"] == pytest.approx(0.4)
    assert [p["start_s"] for p in phases] == sorted(p["start_s"] for p in phases)
    assert "memory check (model on meta)" not in by  # not in the rows: left out
    assert cold_start.phase_rows(phases)[0] == ["phase", "where", "from s", "to s", "seconds"]
    assert cold_start.probe_phases([], LAUNCH, [], None) == []


def test_each_system_runs_as_typed_with_the_same_model_and_steps(tmp_path: Path) -> None:
    args = cold_start.parse_args(["--tiny"])
    stalwart = cold_start.command("stalwart", tmp_path, args)
    assert "run" in stalwart and "run.log_every=1" in stalwart
    assert "task.args.d_model=64" in stalwart and "train.steps=3" in stalwart
    assert "scaling.spare_workers=0" not in stalwart
    assert "scaling.spare_workers=0" in cold_start.command("stalwart-no-spare", tmp_path, args)
    torchrun = cold_start.command("torchrun", tmp_path, args)
    assert "--standalone" in torchrun and "bench.peers.torchrun_recovery" in torchrun
    assert "task.args.d_model=64" in torchrun
    ray_train = cold_start.command("ray-train", tmp_path, args)
    assert "bench.peers.raytrain_cold" in ray_train and "task.args.d_model=64" in ray_train
    assert "task.args.d_model=64" not in cold_start.command("stalwart", tmp_path,
                                                            cold_start.parse_args([]))


def test_the_probe_times_a_watched_call_in_a_real_process(tmp_path: Path) -> None:
    probe = tmp_path / "probe.jsonl"
    env = {**os.environ, cold_start.PROBE_ENV: str(probe),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(cold_start.PROBE_DIR),
                                                       os.environ.get("PYTHONPATH")]))}
    code = "import sys; from stalwart.cli import main; sys.exit(main.main(['bogus']))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == 2, done.stderr  # a bad command: the CLI's own exit code
    rows = [json.loads(line) for line in probe.read_text().splitlines()]
    assert {r["pid"] for r in rows} == {rows[0]["pid"]}
    assert "process" in rows[0]
    (call,) = [r for r in rows if r.get("call") == "stalwart.cli.main:_main"]
    assert call["t0"] <= call["t1"]


def test_without_its_variable_the_probe_writes_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != cold_start.PROBE_ENV}
    env["PYTHONPATH"] = str(cold_start.PROBE_DIR)
    done = subprocess.run([sys.executable, "-c", "import sitecustomize, sys; "
                           "print(len(sys.meta_path) and sitecustomize.FILE)"],
                          env=env, capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
    assert list(tmp_path.iterdir()) == []
