"""Straggler detection over the ranks' local times (orchestrator/stragglers.py), and its
reporter on the driver (orchestrator/reporting.py)."""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import pytest

from stalwart.core.config import load_config
from stalwart.core.events import Straggler, WorkerPlace, read_events
from stalwart.core.run_logs import EventLog
from stalwart.orchestrator.detection import LastSeen
from stalwart.orchestrator.failures import FailureKind
from stalwart.orchestrator.reporting import StragglerReporter
from stalwart.orchestrator.stragglers import StragglerDetector, median_without
from stalwart.workers.reports import StepReport, WorkerStatus

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def feed(d: StragglerDetector, step: int, times: list[float]) -> list:
    for rank, t in enumerate(times):
        d.observe(rank, step, t)
    return d.check()


def test_the_peers_median_leaves_out_one_rank_as_the_plain_median_of_the_others_does(
        ) -> None:
    rng = random.Random(17)
    for n in (2, 3, 4, 5, 8, 9, 64):
        for _ in range(20):
            times = [rng.choice([0.1, 0.2, 0.3]) if rng.random() < 0.3 else rng.random()
                     for _ in range(n)]  # ties too
            ordered = sorted(times)
            for rank, t in enumerate(times):
                others = [x for r, x in enumerate(times) if r != rank]
                assert median_without(ordered, t) == statistics.median(others)


def test_a_rank_slow_for_enough_steps_in_a_row_is_reported_once() -> None:
    d = StragglerDetector(factor=2.0, steps=3)
    d.reset(4)
    found = [s for step in range(1, 8) for s in feed(d, step, [0.10, 0.11, 0.35, 0.10])]
    assert [(s.rank, s.step, s.steps) for s in found] == [(2, 3, 3)]
    assert found[0].peers_median_s == pytest.approx(0.10)
    assert found[0].ratio == pytest.approx(3.5)


def test_a_world_of_two_knows_which_rank_is_slow() -> None:
    d = StragglerDetector(factor=2.0, steps=2)
    d.reset(2)
    found = [s for step in range(1, 4) for s in feed(d, step, [0.02, 0.07])]
    assert [s.rank for s in found] == [1]


def test_a_break_in_the_streak_starts_it_again() -> None:
    d = StragglerDetector(factor=2.0, steps=3)
    d.reset(3)
    slow, fast = [0.1, 0.1, 0.5], [0.1, 0.1, 0.1]
    found = [s for step, times in enumerate([slow, slow, fast, slow, slow, slow], 1)
             for s in feed(d, step, times)]
    assert [(s.rank, s.step) for s in found] == [(2, 6)]


def test_one_slow_spell_is_one_report_though_a_noisy_step_breaks_it() -> None:
    d = StragglerDetector(factor=2.0, steps=3)
    d.reset(3)
    slow, fast = [0.1, 0.1, 0.5], [0.1, 0.1, 0.1]
    # reported at step 3; one step within the factor (a peer's hiccup) does not end the spell
    spell = [slow, slow, slow, fast, slow, slow, slow, slow]
    found = [s for step, times in enumerate(spell, 1) for s in feed(d, step, times)]
    assert [(s.rank, s.step) for s in found] == [(2, 3)]
    # back within the factor for `steps` steps ends it; a later spell is reported again
    later = [fast, fast, fast, slow, slow, slow]
    found = [s for step, times in enumerate(later, len(spell) + 1) for s in feed(d, step, times)]
    assert [(s.rank, s.step) for s in found] == [(2, 14)]


def test_jitter_of_short_steps_and_equal_ranks_are_not_stragglers() -> None:
    d = StragglerDetector(factor=2.0, steps=2)
    d.reset(2)
    # 3x, but 2 ms: scheduler noise, not a slow device
    assert [s for step in range(1, 5) for s in feed(d, step, [0.001, 0.003])] == []
    assert [s for step in range(5, 9) for s in feed(d, step, [0.2, 0.21])] == []


def test_a_step_is_judged_once_every_rank_reported_it_and_a_new_world_resets() -> None:
    d = StragglerDetector(factor=2.0, steps=1)
    d.reset(2)
    d.observe(1, 1, 0.5)
    assert d.check() == []  # rank 0 has not reported step 1 yet
    d.observe(0, 1, 0.1)
    assert [s.rank for s in d.check()] == [1]
    d.reset(3)
    assert feed(d, 2, [0.1, 0.1, 0.1]) == []


def test_off_and_single_rank_worlds_never_report() -> None:
    off = StragglerDetector(factor=0, steps=1)
    off.reset(2)
    assert not off.enabled and feed(off, 1, [0.1, 0.9]) == []
    alone = StragglerDetector(factor=2.0, steps=1)
    alone.reset(1)
    assert feed(alone, 1, [5.0]) == []


class _Display:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def log(self, message: str) -> None:
        self.lines.append(message)


def _status(rank: int, step: int, local_s: float) -> WorkerStatus:
    report = StepReport(rank=rank, step=step, loss=1.0, lr=1e-3, tokens=64, step_time_s=1.0,
                        time=100.0 + step, local_s=local_s)
    return WorkerStatus(rank=rank, generation=0, steps=[report], commits=[], done=False)


@pytest.mark.parametrize("replace", [False, True])
def test_the_reporter_names_the_straggler_and_its_node(tmp_path: Path, replace: bool) -> None:
    """The controller's observer: fed the world's places and the ranks' statuses, it writes
    one `straggler` event with the rank's node, and replaces it only when configured."""
    config = load_config(None, ["failure.straggler_steps=2",
                                f"failure.replace_stragglers={str(replace).lower()}"])
    events = EventLog(tmp_path / "events.jsonl")
    reporter = StragglerReporter(config, events, _Display())
    places = [WorkerPlace(rank=r, pid=10 + r, node_ip=f"10.0.0.{r + 1}", node_id=f"n{r}")
              for r in range(2)]
    reporter.after_form(0, places, now=0.0)
    reporter.after_launch(0, world_size=2, now=0.0)
    failures = []
    for step in (1, 2, 3):
        for rank, local_s in enumerate([0.02, 0.09]):
            reporter.on_status(rank, _status(rank, step, local_s), now=float(step))
        failures.append(reporter.check(float(step), LastSeen()))

    (event,) = [e for e in read_events(events.path) if isinstance(e, Straggler)]
    assert (event.rank, event.node_ip, event.step, event.replaced) == (1, "10.0.0.2", 2, replace)
    found = [f for f in failures if f is not None]
    assert [(f.kind, f.ranks) for f in found] == ([(FailureKind.STRAGGLER, (1,))] if replace
                                                  else [])
