"""The controller driven step by step by the fake worker group (tests/fake_group.py).

FakeWorld builds a Controller over one FakeGroup, a FakeClock and a real run directory: the
event log, the metrics file and the checkpoint catalog are the real ones, under tmp_path. The
helpers below script what the ranks answer to each poll. Times: step n of generation 0 ends
at T0 + n, of a later generation at T1 + n (T2, T3 likewise).
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Any

import pytest

from stalwart.checkpointing.storage.catalog import CheckpointInfo
from stalwart.checkpointing.storage.layout import join, step_dir_name
from stalwart.core.config import JobConfig, load_config, parse_fault
from stalwart.core.events import read_jsonl
from stalwart.core.run_logs import EventLog, MetricsLog
from stalwart.orchestrator import controller as controller_module
from stalwart.orchestrator.controller import Controller
from stalwart.orchestrator.failures import FailureKind, WorkerFailure
from stalwart.orchestrator.observers import ControllerObserver
from stalwart.orchestrator.policies import default_policies
from stalwart.orchestrator.states import State
from stalwart.workers.faults import FaultFired
from stalwart.workers.reports import CommitReport, StepReport, WorkerStatus
from tests.fake_group import (
    Actor,
    Call,
    FakeClock,
    FakeGroup,
    FakeGroupError,
    Plan,
    actors,
)
from tests.keys import signing_key, trust

T0 = 1_700_000_000.0  # the fake clock starts here; step n of generation 0 ends at T0 + n
T1 = T0 + 100.0  # ... and step n of a later generation at T1 + n (T2, T3 likewise)
T2 = T0 + 200.0
T3 = T0 + 300.0
WORLD = 2
TOKENS = 1000
COLLECTIVE_ERROR = ("Traceback (most recent call last):\n  ...\n"
                    "torch.distributed.DistBackendError: Connection closed by peer")
USER_ERROR = "Traceback (most recent call last):\n  ...\nValueError: bad batch"


# ---------------------------------------------------------------------------- scripts


def report(step: int, rank: int = 0, val_loss: float | None = None, t0: float = T0
           ) -> StepReport:
    return StepReport(rank=rank, step=step, loss=10.0 / step, lr=1e-3 * step, tokens=TOKENS,
                      step_time_s=0.1, time=t0 + step, val_loss=val_loss)


def status(rank: int, steps: range | list[int] = (), *, t0: float = T0,
           commits: list[int] = (), done: bool = False, stopped_early: bool = False,
           error: str | None = None, error_kind: str | None = None,
           faults: list[FaultFired] = (), preempted: bool = False) -> WorkerStatus:
    """One rank's answer to a poll (the fake group stamps the generation)."""
    return WorkerStatus(rank=rank, generation=-1, steps=[report(s, rank, t0=t0) for s in steps],
                        commits=[CommitReport(step=c, path=join("/ckpt", step_dir_name(c)),
                                              save_s=0.25) for c in commits],
                        done=done, stopped_early=stopped_early and done, error=error,
                        error_kind=error_kind, faults=list(faults), preempted=preempted)


def statuses(steps: range | list[int], *, world: int = WORLD, commits: list[int] = (),
             done: bool = False, stopped_early: bool = False, t0: float = T0,
             preempted: tuple[int, ...] = ()) -> list[WorkerStatus]:
    """Every rank's status; rank 0 carries the commits (it commits for everyone)."""
    return [status(r, steps, t0=t0, commits=commits if r == 0 else [], done=done,
                   stopped_early=stopped_early, preempted=r in preempted)
            for r in range(world)]


def group_error(kind: FailureKind = FailureKind.WORKER_DIED, *, rank: int | None = 1,
                message: str = "worker rank 1 died: the actor died unexpectedly"
                ) -> FakeGroupError:
    ranks = () if rank is None else (rank,)
    return FakeGroupError(WorkerFailure(kind=kind, rank=rank, ranks=ranks, message=message,
                                        detected_at=0.0))


class FakeDisplay:
    def __init__(self) -> None:
        self.updates: list[tuple[int, float | None]] = []
        self.logs: list[str] = []

    def update(self, report: StepReport, tokens_per_s: float | None) -> None:
        self.updates.append((report.step, tokens_per_s))

    def log(self, message: str) -> None:
        self.logs.append(message)


CORE_EVENTS = {"started", "checkpoint_committed", "checkpoint_skipped", "failure", "recovered",
               "finished", "stopped", "resized", "fault_injected", "fault_skipped"}


class FakeWorld:
    """A Controller over one FakeGroup, a fake clock and a real run directory."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plans: list[Plan],
                 overrides: list[str] = (), *, resume_from: CheckpointInfo | None = None,
                 storage: Path | None = None, cluster: list[Actor] | None = None,
                 faults: list[str] = (), collective_grace_s: float = 3.0,
                 observers: list[ControllerObserver] = ()) -> None:
        self.plans = plans
        self.calls: list[Call] = []
        self.transitions: list[tuple[str, str]] = []
        self.draining: set[str] = set()  # the nodes Ray drains, as the group reports them
        self.clock = FakeClock(T0)
        real = controller_module.check_transition

        def spy(old: State, new: State) -> None:
            self.transitions.append((old.name, new.name))
            real(old, new)

        monkeypatch.setattr(controller_module, "check_transition", spy)
        self.display = FakeDisplay()
        self.events_path = tmp_path / "events.jsonl"
        self.metrics_path = tmp_path / "metrics.jsonl"
        self.storage = storage or tmp_path / "checkpoints"
        self.storage.mkdir(exist_ok=True)
        config: JobConfig = load_config(None, [
            "train.steps=6", "train.warmup_steps=0", "run.log_every=2", *overrides])
        if faults:
            config = dataclasses.replace(config, faults=tuple(parse_fault(f) for f in faults))
        self.config = config
        self.group = FakeGroup(config, self.clock, actors(8) if cluster is None else cluster,
                               world=self)
        self.controller = Controller(
            config, storage_url=str(self.storage), group=self.group,
            group_error=FakeGroupError, events=EventLog(self.events_path),
            metrics=MetricsLog(self.metrics_path), display=self.display,
            resume_from=resume_from, clock=self.clock, poll_interval_s=0, trust=trust(),
            collective_grace_s=collective_grace_s, observers=observers,
            policies=default_policies(config, storage_url=str(self.storage)))

    def run(self) -> State:
        return self.controller.run()

    # -- what happened

    @property
    def events(self) -> list[dict[str, Any]]:
        return read_jsonl(self.events_path)

    def kinds(self) -> list[str]:
        """The kinds of event these tests are about, in order (others may be added freely)."""
        return [e["kind"] for e in self.events if e["kind"] in CORE_EVENTS]

    def event(self, kind: str) -> dict[str, Any]:
        (found,) = self.all(kind)
        return found

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["kind"] == kind]

    def rows(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def named(self, *names: str) -> list[Call]:
        return [c for c in self.calls if c.name in names]

    def shutdowns(self) -> list[bool]:
        return [c.args[0] for c in self.named("shutdown")]

    def members(self, generation: int) -> list[int]:
        """Pids of the ranks of a generation, in rank order."""
        (started,) = [e for e in self.all("workers_started") if e["generation"] == generation]
        return [w["pid"] for w in started["workers"]]

    def killed(self) -> list[int]:
        return [a.pid for a in self.group.killed]

    def commit(self, step: int) -> None:
        """Write a real, committed checkpoint, as the workers do when they report a commit."""
        _commit_checkpoint(self.storage, step)

    @staticmethod
    def path(*states: str) -> list[tuple[str, str]]:
        return list(itertools.pairwise(states))


def _commit_checkpoint(storage: Path, step: int) -> None:
    from stalwart.checkpointing.storage.writer import write_manifest

    d = storage / step_dir_name(step)
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(bytes(range(200)) * (step + 1))
    (d / ".metadata").write_bytes(b"meta")
    write_manifest(str(storage), step, {"world_size": WORLD}, key=signing_key())


def ctrl_c(w: FakeWorld) -> None:
    """What the first Ctrl-C does (the SIGINT handler sets this flag)."""
    w.controller.stop.requested = True


HAPPY = ["SCHEDULING", "RENDEZVOUS", "RESTORING", "RUNNING", "FINISHED"]
PHASES = {"detect", "teardown", "wait", "join", "restore", "first_step"}
HANG_LIMIT = ["failure.hang_timeout_floor_s=2", "failure.hang_factor=1"]  # limit: 2 s
