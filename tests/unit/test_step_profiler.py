"""StepProfiler: which steps one world traces, and the trace it hands back (a chrome trace with
the step's ops and a span per step); the driver's file names never overwrite a trace."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

from stalwart.orchestrator.profiles import save_trace
from stalwart.workers.profiling import StepProfiler
from stalwart.workers.reports import ProfileReport

pytestmark = [pytest.mark.unit, pytest.mark.timeout(120)]

CPU = torch.device("cpu")


def train(profiler: StepProfiler, steps: range, *, stop_after: int | None = None
          ) -> list[ProfileReport]:
    """A stand-in for the worker's loop: one matmul per step."""
    x = torch.randn(16, 16)
    out: list[ProfileReport] = []
    for step in steps:
        profiler.begin(step)
        x = torch.tanh(x @ x)
        out += profiler.end(step, stop=step == stop_after)
        if step == stop_after:
            break
    return out


def trace_of(report: ProfileReport) -> list[dict]:
    return json.loads(zlib.decompress(report.trace_zlib))["traceEvents"]


def test_traces_the_window_and_nothing_else() -> None:
    profiler = StepProfiler((3, 4), rank=1, generation=2, device=CPU)
    reports = []
    for step in range(1, 7):
        reports += train(profiler, range(step, step + 1))
        assert profiler.active == (step == 3), f"tracing at step {step}"
    (report,) = reports
    assert (report.rank, report.generation, report.steps) == (1, 2, (3, 4))
    assert report.export_s > 0
    names = [e.get("name", "") for e in trace_of(report)]
    assert [n for n in names if n.startswith("stalwart step")] == ["stalwart step 3",
                                                                   "stalwart step 4"]
    assert names.count("aten::mm") == 2 and names.count("aten::tanh") == 2


def test_a_world_that_starts_inside_the_window_traces_from_its_first_step() -> None:
    (report,) = train(StepProfiler((3, 5), rank=0, generation=1, device=CPU), range(4, 9))
    assert report.steps == (4, 5)


def test_a_planned_stop_inside_the_window_ends_the_trace_there() -> None:
    profiler = StepProfiler((3, 5), rank=0, generation=0, device=CPU)
    (report,) = train(profiler, range(1, 9), stop_after=4)
    assert report.steps == (3, 4) and not profiler.active


def test_a_failure_inside_the_window_drops_the_trace() -> None:
    profiler = StepProfiler((3, 5), rank=0, generation=0, device=CPU)
    assert train(profiler, range(1, 5)) == [] and profiler.active  # then the world fails
    profiler.discard()
    assert not profiler.active
    assert not torch.autograd.profiler._is_profiler_enabled, "the profiler is still on"
    # the next world (restored to step 3) traces the window again from its first step
    (report,) = train(StepProfiler((3, 5), rank=0, generation=1, device=CPU), range(4, 9))
    assert report.steps == (4, 5)


def test_off_and_past_the_window_cost_nothing() -> None:
    for profiler, steps in ((StepProfiler(None, rank=0, generation=0, device=CPU), range(1, 9)),
                            (StepProfiler((2, 3), rank=0, generation=1, device=CPU),
                             range(5, 9))):
        assert train(profiler, steps) == [] and not profiler.active


def test_the_driver_never_overwrites_a_trace(tmp_path: Path) -> None:
    def report(rank: int, generation: int, payload: bytes) -> ProfileReport:
        return ProfileReport(rank=rank, generation=generation, steps=(5, 6),
                             trace_zlib=zlib.compress(payload), export_s=0.1)

    paths = [save_trace(tmp_path, report(r, g, f"{r}{g}".encode()))
             for r, g in ((0, 0), (1, 0), (0, 1), (0, 2))]
    assert [p.name for p in paths] == ["rank0-step5-6.json", "rank1-step5-6.json",
                                       "rank0-step5-6-2.json", "rank0-step5-6-3.json"]
    assert [p.read_bytes() for p in paths] == [b"00", b"10", b"01", b"02"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in paths)
