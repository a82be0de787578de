"""The outside-kill measure of bench/recovery.py (bench/harness.py, recovery_rows.py,
recovery.outside_verdicts): which step counts as the next completed one, the steps lost,
a normal step, the kill itself, and each system's step log. The benchmark itself is not a test."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import harness as ok
from bench import recovery as recovery_report
from bench import recovery_rows
from bench.peers import torchrun_recovery
from stalwart.core import events as ev

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

KILL = 100.0


def _rows(world: object, steps: range, first_end: float, step_s: float) -> list[ok.StepRow]:
    return [ok.StepRow(s, first_end + i * step_s, world) for i, s in enumerate(steps)]


def test_the_next_step_is_the_restarted_worlds_first_and_a_straggler_of_the_killed_one_is_not(
        ) -> None:
    # world 0 trains steps 1..26 every 0.5 s (step 26 ends 0.01 s after the kill: rank 0's
    # all-reduce had finished), world 1 resumes from step 20 and ends step 21 at KILL + 7.
    old = _rows(0, range(1, 26), KILL - 12.0, 0.5) + [ok.StepRow(26, KILL + 0.01, 0)]
    new = _rows(1, range(21, 41), KILL + 7.0, 0.5)
    m = ok.measure_kill(old + new, KILL)
    assert m["steps_before_kill"] == 25
    assert m["last_step_of_killed_world"] == 26
    assert m["first_step_after"] == 21
    assert m["recovery_s"] == pytest.approx(7.0)
    assert m["resumed_from"] == 20
    assert m["lost_steps"] == 6
    assert m["normal_step_s"] == pytest.approx(0.5)
    assert m["final_step"] == 40


def test_the_normal_step_is_a_median_of_consecutive_steps_before_the_kill() -> None:
    # steps 1..5 at 1 s, a slow checkpoint step, then 0.2 s steps: only gaps of the killed
    # world between consecutive steps before the kill count
    ends = [90.0, 91.0, 92.0, 95.0, 95.2, 95.4, 95.6, 95.8, 96.0]
    rows = [ok.StepRow(i + 1, t, "a") for i, t in enumerate(ends)]
    rows.append(ok.StepRow(20, 99.0, "a"))  # not consecutive: left out
    rows.append(ok.StepRow(10, 101.5, "b"))  # after the kill
    m = ok.measure_kill(rows, KILL)
    assert m["normal_step_s"] == pytest.approx(0.2)
    assert m["lost_steps"] == 20 - 9  # memory or not: the killed world had reached 20


def test_nothing_is_measured_without_a_kill_or_without_a_step_after_it() -> None:
    rows = _rows(0, range(1, 30), KILL - 10.0, 0.3)
    assert ok.measure_kill(rows, None)["recovery_s"] is None
    m = ok.measure_kill(rows, KILL)
    assert m["steps_before_kill"] is not None
    assert (m["recovery_s"], m["lost_steps"], m["resumed_from"]) == (None, None, None)
    assert ok.measure_kill([], KILL)["steps_before_kill"] is None


def test_rows_without_a_world_id_are_split_at_each_world_start() -> None:
    rows = ok.split_worlds([(1, 10.0), (2, 11.0), (3, 20.5), (4, 21.0)], [20.0, 9.0])
    assert [r.world for r in rows] == [1, 1, 2, 2]


def test_the_step_logs_name_the_last_step_and_the_newest_pid_of_a_rank(tmp_path: Path) -> None:
    steps, attempts = tmp_path / "steps.jsonl", tmp_path / "attempts.jsonl"
    assert ok.last_logged(steps) is None
    _jsonl(steps, [{"step": 3}, {"step": 5}, {"step": 4}])
    assert ok.last_logged(steps) == 5
    _jsonl(attempts, [{"event": "start", "rank": 1, "pid": 11},
                      {"event": "ready", "rank": 1, "pid": 11},
                      {"event": "start", "rank": 0, "pid": 10},
                      {"event": "start", "rank": 1, "pid": 21},
                      {"event": "start", "rank": 1, "pid": 31, "stopping": True}])
    assert ok.attempts_pid(attempts, 1) == 21
    assert ok.attempts_pid(attempts, 1, event="ready") == 11
    assert ok.attempts_pid(attempts, 2) is None


def test_the_kill_comes_once_the_step_is_logged_and_only_once() -> None:
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        logged = {"step": 24}
        killer = ok.SignalAtStep(after_step=25, logged_step=lambda: logged["step"],
                                pid=lambda: victim.pid)
        killer.tick()
        assert not killer.done and victim.poll() is None
        logged["step"] = 26
        before = time.time()
        killer.tick()
        assert killer.done and killer.sent_to == victim.pid and killer.step_logged == 26
        assert killer.time is not None and killer.time >= before
        assert victim.wait(timeout=10) == -9
        killer.pid = lambda: pytest.fail("asked for a pid after the kill")
        killer.tick()
        assert killer.record()["kill_error"] is None
    finally:
        victim.kill()
        victim.wait()


def test_a_pid_already_gone_is_an_error_not_a_kill() -> None:
    # a pid above the kernel's pid_max: no process has it (a reaped child's pid could be reused)
    gone = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1
    killer = ok.SignalAtStep(after_step=1, logged_step=lambda: 1, pid=lambda: gone)
    killer.tick()
    assert killer.done and killer.time is None
    assert "was gone" in (killer.error or "")


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_torchrun_is_measured_from_its_step_and_attempt_logs(tmp_path: Path) -> None:
    _jsonl(tmp_path / torchrun_recovery.STEPS_FILE,
           [{"step": s, "time": KILL - 26 + s, "attempt": 0, "pid": 1} for s in range(1, 26)]
           + [{"step": s, "time": KILL + s - 15, "attempt": 2, "pid": 5} for s in range(21, 41)])
    _jsonl(tmp_path / torchrun_recovery.ATTEMPTS_FILE, [
        {"event": "start", "time": KILL - 30, "rank": r, "attempt": 0, "pid": 1 + r}
        for r in (0, 1)] + [
        {"event": "start", "time": KILL + 0.5, "rank": 0, "attempt": 1, "pid": 3},
        {"event": "start", "time": KILL + 2.0, "rank": 0, "attempt": 2, "pid": 5},
        {"event": "ready", "time": KILL + 5.0, "rank": 0, "attempt": 2, "pid": 5,
         "restored_from": 20}])
    m = recovery_rows.analyse_torchrun(tmp_path, KILL)
    assert m["recovery_s"] == pytest.approx(6.0)
    assert (m["lost_steps"], m["restored_from_step"]) == (5, 20)
    assert m["restart_s"] == pytest.approx(0.5)
    assert m["ready_s"] == pytest.approx(5.0)
    assert m["attempts"] == [0, 1, 2] and m["restored_from_checkpoint"] == 20
    assert m["restarts"] == 2


def test_stalwart_is_measured_from_metrics_and_its_own_events(tmp_path: Path) -> None:
    def place(rank: int, pid: int) -> ev.WorkerPlace:
        return ev.WorkerPlace(rank=rank, pid=pid, node_ip="10.0.0.1", node_id="n")

    events = [
        ev.WorkersStarted(time=KILL - 20, generation=0, world_size=2,
                          workers=(place(0, 10), place(1, 11))),
        ev.Failure(time=KILL + 0.3, failure_kind="worker_died", rank=1, ranks=[1], nodes=[],
                   message="", step=27, retry=True, detection_s=0.3, attempt=1),
        ev.WorkersStarted(time=KILL + 0.8, generation=1, world_size=2,
                          workers=(place(0, 10), place(1, 12))),
        ev.Recovered(time=KILL + 1.4, from_step=27, source="memory", peer_fetches=1,
                     world_size=2, lost_steps=0, recovery_s=1.4,
                     phases={"detect": 0.3, "restore": 0.4, "first_step": 0.36},
                     generation=1),
        ev.Finished(time=KILL + 6, step=40),
    ]
    (tmp_path / "events.jsonl").write_text("".join(ev.dumps(e) + "\n" for e in events))
    rows = [ev.MetricsRow(step=s, loss=1.0, lr=1e-3, tokens_per_s=1.0, world_size=2,
                          samples_seen=32 * s, time=KILL - 0.1 - (27 - s) * 0.3)
            for s in range(1, 28)]
    rows += [ev.MetricsRow(step=s, loss=1.0, lr=1e-3, tokens_per_s=1.0, world_size=2,
                           samples_seen=32 * s, time=KILL + 1.3 + (s - 28) * 0.3)
             for s in range(28, 41)]
    (tmp_path / "metrics.jsonl").write_text("".join(ev.dumps(r) + "\n" for r in rows))
    assert ok.stalwart_rank_pid(tmp_path, 1) == 12  # the newest world's
    m = recovery_rows.analyse_stalwart_outside(tmp_path, KILL)
    assert m["recovery_s"] == pytest.approx(1.3)
    assert (m["lost_steps"], m["restored_from_step"], m["stalwart_from_step"]) == (0, 27, 27)
    assert m["normal_step_s"] == pytest.approx(0.3)
    assert m["detection_s"] == pytest.approx(0.3)
    assert m["restart_s"] == pytest.approx(0.8)
    assert m["source"] == "memory" and m["restore_s"] == 0.4
    assert m["first_step_ratio"] == pytest.approx(0.36 / 0.3)
    assert m["finished"] and m["missing_events"] == []
    assert recovery_rows.analyse_stalwart_outside(tmp_path, None)["missing_events"] == [
        "no kill"]


def _med(recovery_s: float | None, normal: float | None, label: str,
         first: float | None = None) -> dict:
    return {"recovery_s": recovery_s, "normal_step_s": normal, "label": label,
            "first_step_ratio": first}


def test_the_outside_targets_compare_medians_with_one_step_and_the_peers() -> None:
    rows = {"stalwart+spare": _med(0.55, 0.35, "stalwart", 1.15),
            "ray-train": _med(11.0, 0.4, "RT"), "torchrun": _med(5.4, 0.3, "TR")}
    met = [v["met"] for v in recovery_report.outside_verdicts(rows)]
    assert met == [True, True, True, False]  # 0.55 <= 0.6; 1.15 <= 1.2; 11/0.55 = 20; < 10
    rows["stalwart+spare"] = _med(1.41, 0.38, "stalwart", 1.3)
    checks = recovery_report.outside_verdicts(rows)
    assert [v["met"] for v in checks] == [False, False, False, False]
    assert checks[2]["value"] == pytest.approx(11.0 / 1.41)
    rows["torchrun"] = _med(None, None, "TR")  # a row that measured nothing is not met
    torchrun = recovery_report.outside_verdicts(rows)[3]
    assert torchrun["value"] is None and not torchrun["met"]
