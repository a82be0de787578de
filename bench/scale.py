"""The controller at thousands of ranks: the driver's CPU, its failure decision and its plan."""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench import common
from stalwart.checkpointing.storage.signing import CheckpointTrust, SigningKey
from stalwart.core.config import load_config
from stalwart.core.run_logs import EventLog, MetricsLog
from stalwart.orchestrator.controller import Controller
from stalwart.orchestrator.observers import ControllerObserver
from stalwart.orchestrator.policies import default_policies
from stalwart.orchestrator.states import Finished
from tests.fake_group import FakeClock, FakeGroup, FakeGroupError, nodes

POLL_S = 0.5  # the controller's default poll interval
GOAL_DECISION_S = 0.100
NULL_DISPLAY = SimpleNamespace(update=lambda report, tokens_per_s: None, log=lambda message: None)


class Marks(ControllerObserver):
    """(wall, CPU, the group's own wall, its own CPU) at each recovery's start and launch."""

    def __init__(self, group: FakeGroup) -> None:
        self.group = group
        self.recovering: list[tuple[float, float, float, float]] = []
        self.launched: list[tuple[float, float, float, float]] = []

    def _now(self) -> tuple[float, float, float, float]:
        return (time.perf_counter(), time.process_time(), self.group.own_wall_s,
                self.group.own_cpu_s)

    def before_recovery(self, failure: Any) -> None:
        self.recovering.append(self._now())

    def after_launch(self, generation: int, world_size: int, now: float) -> None:
        self.launched.append(self._now())


def build(ranks: int, run_dir: Path, *, steps: int, fail_at: dict[int, int] | None = None,
          ranks_per_node: int = 8) -> tuple[Controller, FakeGroup, Marks]:
    """A Controller over a simulated FakeGroup of `ranks` ranks (and one node of warm spares)."""
    config = load_config(None, [
        f"scaling.num_workers={ranks}", f"scaling.spare_workers={ranks_per_node}",
        f"train.steps={steps}", f"train.global_batch_size={ranks}", "train.micro_batch_size=1",
        "train.warmup_steps=0", "run.log_every=10", "failure.max_failures=1000",
        "failure.backoff_s=0", "checkpoint.snapshot_every=1"])
    clock = FakeClock()
    # Enough actors for the world, a node of spares and a replacement for each failure.
    cluster = nodes(ranks + ranks_per_node + len(fail_at or {}), ranks_per_node)
    group = FakeGroup(config, clock, cluster, step_s=POLL_S, fail_at=fail_at)
    marks = Marks(group)
    storage = run_dir / "checkpoints"
    storage.mkdir(parents=True, exist_ok=True)
    trust = CheckpointTrust(key=SigningKey(secret=b"scale bench", source="bench/scale.py"))
    controller = Controller(
        config, storage_url=str(storage), group=group, group_error=FakeGroupError,
        events=EventLog(run_dir / "events.jsonl"), metrics=MetricsLog(run_dir / "metrics.jsonl"),
        display=NULL_DISPLAY, resume_from=None, trust=trust, clock=clock,
        poll_interval_s=POLL_S, observers=[marks],
        policies=default_policies(config, storage_url=str(storage)))
    return controller, group, marks


def steady(ranks: int, polls: int) -> dict[str, float]:
    """The driver's CPU per second of simulated training over `polls` polls, no failure."""
    with tempfile.TemporaryDirectory() as tmp:
        controller, group, marks = build(ranks, Path(tmp), steps=polls)
        state = controller.run()
        end = (time.perf_counter(), time.process_time(), group.own_wall_s, group.own_cpu_s)
    assert isinstance(state, Finished), state
    (start,) = marks.launched
    train_s = group.stats.polls * POLL_S
    cpu_all = end[1] - start[1]
    cpu_ctl = cpu_all - (end[3] - start[3])
    return {"polls": group.stats.polls, "train_s": train_s,
            "cpu_per_train_s": round(cpu_ctl / train_s, 5),
            "cpu_per_train_s_with_group": round(cpu_all / train_s, 5),
            "cpu_per_poll_ms": round(1000 * cpu_ctl / group.stats.polls, 3)}


def recoveries(ranks: int, failures: int) -> dict[str, Any]:
    """Decision and plan times over `failures` failures of one run (medians and all)."""
    # One rank dies every 10 steps, a different one each time (never rank 0).
    fail_at = {10 * (i + 1): 1 + (i * 7919) % (ranks - 1) for i in range(failures)}
    with tempfile.TemporaryDirectory() as tmp:
        controller, group, marks = build(ranks, Path(tmp), steps=max(fail_at) + 5, fail_at=fail_at)
        state = controller.run()
    assert isinstance(state, Finished), state
    reported = group.stats.failures_reported
    assert len(reported) == len(marks.recovering) == failures, (reported, marks.recovering)
    decided = list(zip(reported, marks.recovering, strict=True))
    decision_wall = [r[0] - p[0] for p, r in decided]
    decision_cpu = [r[1] - p[1] for p, r in decided]
    # The world launched after each recovery (launched[0] is the first world's), less the
    # simulated group's own time.
    planned = list(zip(marks.recovering, marks.launched[1:], strict=True))
    plan_wall = [(b[0] - a[0]) - (b[2] - a[2]) for a, b in planned]
    plan_cpu = [(b[1] - a[1]) - (b[3] - a[3]) for a, b in planned]
    ms = lambda xs: [round(1000 * x, 3) for x in xs]  # noqa: E731
    med = lambda xs: round(1000 * statistics.median(xs), 3)  # noqa: E731
    return {"failures": failures, "generations": group.stats.generations,
            "decision_wall_ms": med(decision_wall), "decision_cpu_ms": med(decision_cpu),
            "plan_wall_ms": med(plan_wall), "plan_cpu_ms": med(plan_cpu),
            "all_decision_wall_ms": ms(decision_wall), "all_plan_wall_ms": ms(plan_wall)}


def profile(ranks: int, polls: int, failures: int, top: int) -> None:
    """cProfile of a steady run and one with failures (the group's own functions included)."""
    prof = cProfile.Profile()
    prof.enable()
    steady(ranks, polls)
    recoveries(ranks, failures)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main() -> None:
    p = common.parser(__doc__, __spec__, "scale.json")
    p.add_argument("--polls", type=int, default=120, help="polls of the steady run (default 120)")
    p.add_argument("--failures", type=int, default=5, help="failures per size (default 5)")
    p.add_argument("--sizes", default="64,1024,4096", help="rank counts, 8 to a node")
    p.add_argument("--ray-actors", type=int, default=96,
                   help="light Ray actors for the real-Ray part; 0 skips it (default 96)")
    p.add_argument("--ray-intervals", type=int, default=30,
                   help="polling intervals timed per way of polling (default 30)")
    p.add_argument("--profile", type=int, default=0, metavar="RANKS",
                   help="only print a cProfile of the controller at this many ranks")
    args = p.parse_args()
    if args.profile:
        profile(args.profile, args.polls, args.failures, top=30)
        return
    rows = []
    for ranks in (int(s) for s in args.sizes.split(",")):
        t = time.perf_counter()
        row = {"ranks": ranks, "nodes": ranks // 8, **steady(ranks, args.polls),
               **recoveries(ranks, args.failures)}
        row["bench_s"] = round(time.perf_counter() - t, 1)
        rows.append(row)
        print(f"{ranks:>5} ranks / {ranks // 8:>3} nodes: driver CPU {row['cpu_per_train_s']:.4f} "
              f"s per s of training ({row['cpu_per_train_s_with_group']:.4f} with the simulated "
              f"group), decision {row['decision_wall_ms']:.1f} ms, plan {row['plan_wall_ms']:.1f} "
              f"ms wall / {row['plan_cpu_ms']:.1f} ms CPU", flush=True)
    result: dict[str, Any] = {"poll_interval_s": POLL_S, "sizes": rows,
                              "goal": {"decision_ms_below": 1000 * GOAL_DECISION_S,
                                       "at_ranks": 4096}}
    if at_goal := [r for r in rows if r["ranks"] == 4096]:
        result["goal"]["met"] = met = at_goal[0]["decision_wall_ms"] < 1000 * GOAL_DECISION_S
        print(f"goal: decision under 100 ms at 4,096 ranks: "
              f"{at_goal[0]['decision_wall_ms']:.1f} ms: {'MET' if met else 'NOT MET'}")
    if args.ray_actors:
        from bench.scale_ray import ray_polling

        result["ray"] = ray_polling(args.ray_actors, intervals=args.ray_intervals)
    common.write_json(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
