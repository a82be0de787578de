"""Bad input for `stalwart export, report, plan, sweep and submit`, typed as a user types it.

One table: each case is a command line and the files it finds. Each must end with exit code
2 and exactly one `stalwart: error:` line on stderr (holding the case's fragment), no
traceback, nothing changed on disk, and Ray never started (its RAY_TMPDIR stays empty).
Each case is one quick subprocess; the export cases share one real checkpoint, written once
in this process with the storage writer a run uses (no Ray). `stalwart run`'s bad input is
in test_cli_bad_input.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from stalwart.parallel.distributed import free_port
from tests.cli_helpers import REFERENCE_CONFIG, STALWART, TINY
from tests.keys import trust

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

Setup = Callable[[Path], None]


@dataclass(frozen=True)
class Case:
    argv: tuple[str, ...]
    error: str
    """A fragment of the one error line."""
    setup: tuple[Setup, ...] = field(default=())
    checkpoint: bool = False
    """The case starts from a copy of the run with one committed checkpoint, at ./run."""


def write(name: str, text: str | bytes) -> Setup:
    def setup(d: Path) -> None:
        path = d / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(text)
    return setup


def mkdir(name: str) -> Setup:
    return lambda d: (d / name).mkdir(parents=True, exist_ok=True)


# ------------------------------------------------------------------------- report

STARTED = {"time": 1000.0, "kind": "started", "world_size": 1, "steps": 10, "start_step": 0,
           "task": "t"}
WORKERS = {"time": 1000.5, "kind": "workers_started", "generation": 0, "world_size": 1}
FINISHED = {"time": 1011.0, "kind": "finished", "step": 10, "loss": 1.0}
ROW = {"step": 10, "loss": 1.0, "lr": 1e-3, "tokens_per_s": 100.0, "world_size": 1,
       "samples_seen": 80, "time": 1010.5, "window_s": 10.0, "steps_in_window": 10}
CONFIG = "[train]\nsteps = 10\n\n[checkpoint]\nasync_save = true\n"


def lines(*rows: dict | str) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def run(events: str | bytes | None = None, metrics: str | bytes | None = None,
        config: str | None = CONFIG) -> tuple[Setup, ...]:
    """A finished run at ./run, with one file replaced."""
    return (mkdir("run"),
            write("run/events.jsonl", lines(STARTED, WORKERS, FINISHED) if events is None
                  else events),
            write("run/metrics.jsonl", lines(ROW) if metrics is None else metrics),
            *([write("run/config.toml", config)] if config is not None else []))


def report(*extra: str) -> tuple[str, ...]:
    return ("report", "run", *extra)


REPORT = {
    "report-no-run-dir": Case(report(), "run dir run does not exist"),
    "report-run-dir-is-a-file": Case(report(), "run dir run is not a directory",
                                     (write("run", "x"),)),
    "report-no-events": Case(report(), "holds no events", (mkdir("run"),)),
    "report-damaged-middle-event": Case(report(), "events.jsonl line 2 is damaged: not JSON",
                                        run(events=lines(STARTED, '{"time": 1000.5, "ki',
                                                         FINISHED))),
    "report-damaged-last-whole-line": Case(report(), "events.jsonl line 3 is damaged",
                                           run(events=lines(STARTED, WORKERS, '{"kind": '))),
    "report-event-without-kind": Case(report(), "line 2 has no field 'kind'",
                                      run(events=lines(STARTED, {"time": 1.0}, FINISHED))),
    "report-event-without-time": Case(report(), "line 3: finished event has no field 'time'",
                                      run(events=lines(STARTED, WORKERS,
                                                       {"kind": "finished", "step": 10}))),
    "report-unknown-event-kind": Case(report(), "unknown event kind 'exploded'",
                                      run(events=lines(STARTED, {"time": 1.0,
                                                                 "kind": "exploded"}))),
    "report-event-line-is-a-list": Case(report(), "line 1 is a JSON array, not an object",
                                        run(events=lines("[1, 2]", STARTED))),
    "report-event-field-wrong-type": Case(report(), "field step is 'ten', expected an integer",
                                          run(events=lines(STARTED, WORKERS,
                                                           {**FINISHED, "step": "ten"}))),
    "report-binary-events": Case(report(), "events.jsonl line 1 is not UTF-8 text",
                                 run(events=b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01\n")),
    "report-events-is-a-directory": Case(report(), "events.jsonl is not a file",
                                         (mkdir("run/events.jsonl"),)),
    "report-metrics-string": Case(report(), "metrics.jsonl line 1: field tokens_per_s is "
                                            "'fast', expected a number",
                                  run(metrics=lines({**ROW, "tokens_per_s": "fast"}))),
    "report-metrics-nan-time": Case(report(), "field time is nan, expected a finite number",
                                    run(metrics=lines({**ROW, "time": float("nan")}, ROW))),
    "report-metrics-not-object": Case(report(), "metrics.jsonl line 1 is a JSON number",
                                      run(metrics=lines("42", ROW))),
    "report-metrics-missing-field": Case(report(), "has no field 'step'",
                                         run(metrics=lines({k: v for k, v in ROW.items()
                                                            if k != "step"}))),
    "report-config-section-not-table": Case(report(), "config.toml: [train] is 5, not a table",
                                            run(config="train = 5\n")),
    "report-config-not-toml": Case(report(), "is not valid TOML", run(config="[train\n")),
    "report-config-steps-string": Case(report(), "train.steps = 'ten' is invalid",
                                       run(config='[train]\nsteps = "ten"\n')),
    "report-out-not-png": Case(report("--out", "fig.jpg"), "give a path ending in .png",
                               run()),
    "report-out-is-a-directory": Case(report("--out", "fig.png"), "fig.png is a directory",
                                      (*run(), mkdir("fig.png"))),
    "report-out-parent-is-a-file": Case(report("--out", "afile/fig.png"),
                                        "afile is not a directory", (*run(), write("afile", ""))),
    "report-out-under-proc": Case(report("--out", "/proc/stalwart-report.png"),
                                  "cannot write the figure", run()),
}

# ------------------------------------------------------------------------- plan

PLAN = {
    "plan-devices-huge": Case(("plan", "--params", "7e9", "--devices", "1000000000"),
                              "--devices must be an integer from 1 to 65536"),
    "plan-devices-zero": Case(("plan", "--params", "7e9", "--devices", "0"),
                              "--devices must be an integer from 1 to 65536, got 0"),
    "plan-devices-not-a-number": Case(("plan", "--params", "7e9", "--devices", "many"),
                                      "plan: argument --devices: invalid int value"),
    "plan-memory-inf": Case(("plan", "--params", "7e9", "--memory-gb", "inf"),
                            "--memory-gb must be a number of GiB from 0.001"),
    "plan-memory-nan": Case(("plan", "--params", "7e9", "--memory-gb", "nan"),
                            "--memory-gb must be a number of GiB"),
    "plan-memory-overflows": Case(("plan", "--params", "7e9", "--memory-gb", "1e308"),
                                  "got 1e+308"),
    "plan-memory-zero": Case(("plan", "--params", "7e9", "--memory-gb", "0"),
                             "--memory-gb must be"),
    "plan-params-huge": Case(("plan", "--params", "1e300"), "from 1 to 1e15"),
    "plan-params-words": Case(("plan", "--params", "seven billion"), "not a parameter count"),
    "plan-micro-batch-zero": Case(("plan", "--params", "7e9", "--micro-batch", "0"),
                                  "--micro-batch must be an integer from 1"),
    "plan-seq-len-huge": Case(("plan", "--params", "7e9", "--seq-len", str(10**30)),
                              "--seq-len must be an integer from 1 to 2147483647"),
    "plan-nothing-to-plan": Case(("plan",), "plan needs CONFIG or --params N"),
    "plan-devices-but-no-model": Case(("plan", "--devices", "8"),
                                      "plan needs CONFIG or --params N"),
    "plan-set-without-config": Case(("plan", "--params", "7e9", "--set", "train.lr=1"),
                                    "--set needs CONFIG"),
    "plan-config-devices-huge": Case(("plan", str(REFERENCE_CONFIG), "--devices", "100000"),
                                     "--devices must be an integer from 1 to 65536"),
}

# ------------------------------------------------------------------------- sweep

SEARCH = '[search]\n"train.lr" = { loguniform = [1e-4, 1e-2] }\n'


def sweep_file(top: str = "", search: str = SEARCH, tail: str = "") -> Setup:
    return write("sweep.toml", f'config = "{REFERENCE_CONFIG}"\nmetric = "loss"\n{top}\n'
                               f"{search}{tail}")


def sweep(setup: Setup, error: str, *extra: str, more: tuple[Setup, ...] = ()) -> Case:
    return Case(("sweep", "sweep.toml", *extra), error, (setup, *more))


PBT = ('set = ["checkpoint.persist_every=10"]\n', '[scheduler]\ntype = "pbt"\n'
       'perturbation_interval = 10\n[scheduler.mutations]\n')

SWEEP = {
    "sweep-loguniform-low-zero": sweep(sweep_file(search=SEARCH.replace("1e-4", "0")),
                                       "[search] train.lr: loguniform needs low > 0, got 0"),
    "sweep-metric-never-reported": sweep(
        write("sweep.toml", f'config = "{REFERENCE_CONFIG}"\nmetric = "accuracy%"\n{SEARCH}'),
        "metric: 'accuracy%' is never reported by a stalwart run"),
    "sweep-unknown-config-key": sweep(sweep_file(search=SEARCH.replace("train.lr",
                                                                       "train.learning_rate")),
                                      "train.learning_rate"),
    "sweep-name-not-a-string": sweep(sweep_file("name = 5"), "name: 5 is not allowed"),
    "sweep-name-climbs-out": sweep(sweep_file('name = "../outside"'),
                                   "name: '../outside' is not allowed"),
    "sweep-name-with-slash": sweep(sweep_file('name = "a/b"'), "name: 'a/b' is not allowed"),
    "sweep-storage-not-a-string": sweep(sweep_file("storage = [1]"),
                                        "storage: [1] is not allowed"),
    "sweep-storage-a-url": sweep(sweep_file('storage = "s3://bucket/sweeps"'),
                                 "URLs are not supported"),
    "sweep-storage-under-a-file": sweep(sweep_file('storage = "afile/sweeps"'),
                                        "afile is not a directory", more=(write("afile", ""),)),
    "sweep-storage-unwritable": sweep(sweep_file('storage = "/proc/stalwart-sweeps"'),
                                      "cannot write in /proc"),
    "sweep-experiment-dir-is-a-file": sweep(sweep_file('name = "x"'), "is a file, not a "
                                            "sweep's directory", more=(write("sweeps/x", ""),)),
    "sweep-float-rule-on-int-key": sweep(
        sweep_file(search='[search]\n"task.args.d_model" = { uniform = [32, 128] }\n'),
        "uniform draws floats; for an integer key use randint"),
    "sweep-quniform-on-int-config-key": sweep(
        sweep_file(search='[search]\n"train.steps" = { quniform = [40, 80, 8] }\n'),
        "train.steps = 40.0"),
    "sweep-unknown-task-arg-searched": sweep(
        sweep_file(search='[search]\n"task.args.dmodel" = { choice = [32, 64] }\n'),
        "task.args.dmodel"),
    "sweep-unknown-task-arg-set": sweep(sweep_file('set = ["task.args.widht=3"]'),
                                        "every trial would be refused"),
    "sweep-rule-not-finite": sweep(
        sweep_file(search='[search]\n"train.lr" = { uniform = [0, inf] }\n'),
        "uniform takes finite numbers"),
    "sweep-value-a-date": sweep(
        sweep_file(search='[search]\n"train.lr" = { choice = [1979-05-27] }\n'),
        "is not allowed: a string, number, boolean"),
    "sweep-pbt-plain-mutation": sweep(
        sweep_file(PBT[0], tail=PBT[1] + '"train.lr" = 1e-3\n'),
        "mutations train.lr: 0.001 is not allowed: pbt mutates a key by drawing from a rule"),
    "sweep-unreachable-cluster": sweep(sweep_file(), "nothing answers there", "--address",
                                       f"127.0.0.1:{free_port()}"),
    "sweep-port-out-of-range": sweep(sweep_file(), "the port must be a number from 1 to 65535",
                                     "--address", "127.0.0.1:99999"),
}

# ------------------------------------------------------------------------- submit

SUBMIT = {
    f"submit-address-{name}": Case(("submit", "config.toml", "--address", address), error,
                                   (write("config.toml", REFERENCE_CONFIG.read_text()),))
    for name, address, error in (
        ("port-out-of-range", "http://127.0.0.1:99999", "the port must be a number from 1 "
                                                        "to 65535"),
        ("port-zero", "http://127.0.0.1:0", "the port must be a number from 1 to 65535"),
        ("port-not-a-number", "http://127.0.0.1:http", "the port must be a number"),
        ("bad-ipv6", "http://[::1", "is not a URL"),
        ("not-http", "127.0.0.1:8265", "is not the http(s) URL of a cluster's job API"),
    )
}

# ------------------------------------------------------------------------- export


def export(*extra: str) -> tuple[str, ...]:
    return ("export", "run", *extra)


EXPORT = {
    "export-no-run-dir": Case(export("--out", "w.pt"), "run dir run does not exist"),
    "export-no-config": Case(export("--out", "w.pt"), "holds no config.toml", (mkdir("run"),)),
    "export-no-checkpoints": Case(export("--out", "w.pt"), "no committed checkpoint",
                                  (mkdir("run"), write("run/config.toml",
                                                       REFERENCE_CONFIG.read_text()))),
    "export-unknown-suffix": Case(export("--out", "w.txt"), "unknown format", checkpoint=True),
    "export-existing-out": Case(export("--out", "w.pt"), "already exists",
                                (write("w.pt", "keep me"),), checkpoint=True),
    "export-missing-step": Case(export("--out", "w.pt", "--step", "7"),
                                "no committed checkpoint for step 7", checkpoint=True),
    "export-step-not-a-number": Case(export("--out", "w.pt", "--step", "last"),
                                     "export: argument --step: invalid int value"),
    "export-no-out": Case(("export", "run"), "the following arguments are required: --out"),
}

CASES: dict[str, Case] = {**REPORT, **PLAN, **SWEEP, **SUBMIT, **EXPORT}


# ------------------------------------------------------------------------- the test


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run dir (config.toml of the tiny reference model) with a committed checkpoint at
    step 10, written by the storage writer a run uses."""
    from stalwart.checkpointing.storage.writer import StorageCheckpointer
    from stalwart.core.config import dump_config, load_config
    from stalwart.core.task import build_task

    path = tmp_path_factory.mktemp("export") / "run"
    path.mkdir()
    config = load_config(REFERENCE_CONFIG, TINY)
    (path / "config.toml").write_text(dump_config(config))
    model = build_task(config.task.path, config.task.args).build_model(config)
    writer = StorageCheckpointer(str(path / "checkpoints"), rank=0, keep_last=0,
                                 async_save=False,
                                 manifest_extra={"world_size": 1, "task": config.task.path},
                                 trust=trust())
    try:
        writer.save(10, {"model": model.state_dict()})
    finally:
        writer.close()
    return path


def snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under root, with its content's digest."""
    return {str(p.relative_to(root)): "dir" if p.is_dir() else
            hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))}


def stalwart_isolated(args: tuple[str, ...], cwd: Path, ray_tmp: Path
                      ) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = str(ray_tmp)
    return subprocess.run([STALWART, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=180)


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 35
    assert {name.split("-")[0] for name in CASES} == {"report", "plan", "sweep", "submit",
                                                      "export"}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    case = CASES[name]
    if case.checkpoint:
        shutil.copytree(request.getfixturevalue("checkpointed_run"), tmp_path / "run")
    for setup in case.setup:
        setup(tmp_path)
    before = snapshot(tmp_path)
    ray_tmp = Path(tempfile.mkdtemp(prefix="swrt", dir="/tmp"))  # short: Ray's socket paths
    try:
        proc = stalwart_isolated(case.argv, tmp_path, ray_tmp)
        ray_started = any(ray_tmp.iterdir())
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    shown = f"stalwart {' '.join(case.argv)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
    assert proc.returncode == 2, shown
    assert "Traceback" not in proc.stderr + proc.stdout, shown
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("stalwart: error: "), shown
    assert case.error in errors[0], shown
    assert snapshot(tmp_path) == before, "files changed"
    assert not ray_started, "Ray was started"


# ------------------------------------------------------------------------- the good side


def test_the_cases_fail_for_their_own_reason(tmp_path: Path, checkpointed_run: Path) -> None:
    """The files the cases damage are good when undamaged: the same run reports, and the
    same checkpoint exports."""
    for setup in run():
        setup(tmp_path)
    ray_tmp = Path(tempfile.mkdtemp(prefix="swrt", dir="/tmp"))
    try:
        proc = stalwart_isolated(("report", "run", "--json", "--out", "fig/r.png"), tmp_path,
                                 ray_tmp)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["steps_done"] == 10
        assert (tmp_path / "fig" / "r.png").stat().st_size > 0
        shutil.copytree(checkpointed_run, tmp_path / "ckpt-run")
        proc = stalwart_isolated(("export", "ckpt-run", "--out", "w.pt"), tmp_path, ray_tmp)
        assert proc.returncode == 0, proc.stderr
        assert "exported step 10" in proc.stdout
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


def test_a_half_written_last_line_and_a_nan_loss_are_reported(tmp_path: Path) -> None:
    """What a crash mid-write leaves (a last line cut short, no newline) is left out, and a
    diverged run's NaN loss is a true record: the report is written."""
    events = lines(STARTED, WORKERS) + '{"time": 1011.0, "kind": "fini'
    for setup in run(events=events, metrics=lines({**ROW, "loss": float("nan")})):
        setup(tmp_path)
    ray_tmp = Path(tempfile.mkdtemp(prefix="swrt", dir="/tmp"))
    try:
        proc = stalwart_isolated(("report", "run", "--json"), tmp_path, ray_tmp)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["state"] == "running"
