"""Bad input to the `stalwart` command: one clear error line, exit code 2, nothing started.

Each case runs the installed console script as a user types it, in a fresh directory of its
own. Every run gets its own RAY_TMPDIR: Ray creates its session there as soon as it starts,
so an empty RAY_TMPDIR afterwards shows that no Ray (and so no worker) was started.

Each run mostly waits on imports (and one on a local Ray start), so all cases are started
together, a few at a time, when the first test needs one; each test then checks its own.
Every `run` case is checked by one test (exit 2, one error line naming the problem, no
traceback, nothing changed, no Ray); some have tests of their own as well. A read-only HTTP
server (it refuses PUT) stands for storage that cannot be written; as root, permission bits
stop nothing, so the other unwritable places are under /proc or under a regular file.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import importlib.util
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from stalwart.parallel.distributed import free_port
from tests.cli_helpers import run_from_thread

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

STALWART = Path(sys.executable).with_name("stalwart")
REFERENCE_CONFIG = Path(__file__).resolve().parents[2] / "examples" / "gpt" / "config.toml"
TIMEOUT_S = 240  # generous: three CLIs start at once on 2 shared cores (each imports torch)
PARALLEL = 3
ERROR_PREFIX = "stalwart: error: "


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under root: file bytes, or None for a directory."""
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(root.rglob("*"))}


def _previous_run(run_dir: Path, *, with_checkpoint: bool) -> None:
    run_dir.mkdir()
    shutil.copy(REFERENCE_CONFIG, run_dir / "config.toml")
    (run_dir / "events.jsonl").write_text('{"time": 1.0, "kind": "started"}\n')
    if with_checkpoint:
        step = run_dir / "checkpoints" / "step_000000010"
        step.mkdir(parents=True)
        (step / "manifest.json").write_text('{"format": 2, "step": 10, "files": {}}')
        (step / "__0_0.distcp").write_bytes(b"\x00\x01shard")


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...]
    """The command line; `{http}` stands for a read-only HTTP server's URL."""
    prepare: Callable[[Path], None] | None = None
    """Builds what the case needs in its working directory (which holds config.toml)."""
    expect: str = ""
    """A part of the error line, checked for every `run` case by one test (the cases that
    have tests of their own below leave it empty)."""


def _sets(*overrides: str) -> tuple[str, ...]:
    return tuple(arg for o in overrides for arg in ("--set", o))


def _file(name: str, text: str) -> Callable[[Path], None]:
    return lambda d: (d / name).write_text(text)


def _run_set(*overrides: str, expect: str) -> Case:
    """`stalwart run config.toml --set ...` into run dir `r`."""
    return Case(("run", "config.toml", *_sets(*overrides), "--run-dir", "r"), expect=expect)


def _run_toml(text: str, expect: str) -> Case:
    """`stalwart run bad.toml` with this TOML (every other key at its default)."""
    return Case(("run", "bad.toml", "--run-dir", "r"), _file("bad.toml", text), expect=expect)


FINITE = "is invalid: must be a finite number (not inf or nan)"


CASES: dict[str, Case] = {
    # first: the one that starts Ray and takes longest
    "too_big": Case(("run", "config.toml", *_sets(
        "scaling.num_workers=64", "train.micro_batch_size=1", "train.global_batch_size=64"),
        "--run-dir", "big")),
    "missing_config": Case(("run", "missing.toml")),
    "malformed_toml": Case(("run", "bad.toml"),
                           lambda d: (d / "bad.toml").write_text("[train\nsteps = 3\n")),
    "unknown_key": Case(("run", "config.toml", *_sets("train.stepz=10"))),
    "batch": Case(("run", "config.toml", *_sets("train.global_batch_size=10"))),
    "task_path": Case(("run", "config.toml", *_sets("task.path=nope.mod:Task"),
                       "--run-dir", "r")),
    "foo_storage": Case(("run", "config.toml", *_sets('checkpoint.storage="foo://bucket/x"'),
                         "--run-dir", "r")),
    "s3_storage": Case(("run", "config.toml", *_sets('checkpoint.storage="s3://bucket/x"'))),
    "hdfs_storage": Case(("run", "config.toml",
                          *_sets('checkpoint.storage="hdfs://namenode/x"'))),
    "address_unreachable": Case(("run", "config.toml", "--address", f"127.0.0.1:{free_port()}",
                                 "--run-dir", "nowhere"), expect="nothing answers there"),
    "resume_no_run_dir": Case(("run", "config.toml", "--resume")),
    "resume_no_run": Case(("run", "config.toml", "--resume", "--run-dir", "no-such-run")),
    "fresh_into_checkpoints": Case(("run", "config.toml", "--run-dir", "old"),
                                   lambda d: _previous_run(d / "old", with_checkpoint=True)),
    "fresh_into_run": Case(("run", "config.toml", "--run-dir", "old"),
                           lambda d: _previous_run(d / "old", with_checkpoint=False)),
    "export_no_checkpoint": Case(("export", "run", "--out", "model.safetensors"),
                                 lambda d: _previous_run(d / "run", with_checkpoint=False)),
    # -- non-finite and out-of-range numbers: one rule for every float key
    "lr_inf": _run_set("train.lr=inf", expect=f"train.lr = inf {FINITE}"),
    "lr_nan_literal": _run_toml("[train]\nlr = nan\n", f"train.lr = nan {FINITE}"),
    "weight_decay_inf": _run_set("train.weight_decay=+inf",
                                 expect=f"train.weight_decay = inf {FINITE}"),
    "cpus_inf": _run_set("scaling.cpus_per_worker=inf",
                         expect=f"scaling.cpus_per_worker = inf {FINITE}"),
    "gpus_nan": _run_set("scaling.gpus_per_worker=nan",
                         expect=f"scaling.gpus_per_worker = nan {FINITE}"),
    "hang_floor_inf": _run_set("failure.hang_timeout_floor_s=inf",
                               expect=f"failure.hang_timeout_floor_s = inf {FINITE}"),
    "hang_factor_inf_literal": _run_toml("[failure]\nhang_factor = +inf\n",
                                         f"failure.hang_factor = inf {FINITE}"),
    "memory_limit_minus_inf": _run_set("checkpoint.memory_limit_gb=-inf",
                                       expect=f"checkpoint.memory_limit_gb = -inf {FINITE}"),
    "timeout_1e300": _run_set("failure.collective_timeout_s=1e300",
                              expect="failure.collective_timeout_s = 1e+300 is invalid: a "
                                     "duration must be at most 1e+09 s"),
    "lr_int_too_big": _run_set("train.lr=1" + "0" * 400, expect="is invalid: too large for "
                                                               "a float"),
    "seed_past_64_bits": _run_set(f"train.seed={2**64}", expect=f"train.seed = {2**64} is "
                                                                f"invalid: must fit in 64 bits"),
    "cpus_below_ray_unit": _run_set("scaling.cpus_per_worker=0.00001",
                                    expect="scaling.cpus_per_worker = 1e-05 is invalid: must "
                                           "be >= 0.0001 (Ray's smallest unit)"),
    # -- accepted before, then a traceback from Ray or the workers
    "cpus_1e308": _run_set("scaling.cpus_per_worker=1e308",
                           expect="scaling.cpus_per_worker = 1e+308 is invalid: must be at "
                                  "most 1024: a worker is one process on one node"),
    "gpus_2000": _run_set("scaling.gpus_per_worker=2000",
                          expect="scaling.gpus_per_worker = 2000.0 is invalid: must be at most "
                                 "1024"),
    "memory_limit_1e308": _run_set("checkpoint.memory_limit_gb=1e308",
                                   expect="checkpoint.memory_limit_gb = 1e+308 is invalid: must "
                                          "be at most 1048576 (1 PiB per worker)"),
    "cache_dir_empty": _run_set('data.cache_dir=""',
                                expect="data.cache_dir = '' is invalid: must name a directory; "
                                       "leave it unset for the default"),
    "cache_dir_blank": _run_toml('[data]\ncache_dir = "  "\n',
                                 "data.cache_dir = '  ' is invalid: must name a directory"),
    # the default run dir, runs/<name>-<timestamp>, was a name too long for the filesystem
    "run_name_300": Case(("run", "config.toml", *_sets(f'run.name="{"n" * 300}"')),
                         expect=f"run.name = '{'n' * 300}' is invalid: must be at most 200 "
                                f"bytes in UTF-8, not 300"),
    "run_dir_name_too_long": Case(("run", "config.toml", "--run-dir", f"x/{'d' * 300}/run"),
                                  expect=f"run dir x/{'d' * 300}/run is not writable: cannot "
                                         f"create the directory x/{'d' * 300}: "),
    # refused by the estimate of `stalwart plan`, as plan refuses it (the model loads torch)
    "model_too_big": _run_set("task.args.d_model=1048576",
                              expect="the model of task.args = {'seq_len': 128, 'd_model': "
                                     "1048576, 'n_layers': 4, 'n_heads': 4} "
                                     "(52,777,104,441,344 parameters) does not fit: "
                                     "dp_replicate=2 x dp_shard=1 x tp=1 x pp=1, ZeRO-0 needs "
                                     "960 TiB per worker by the estimate of `stalwart plan`, "
                                     "more than the "),
    "steps_zero": _run_set("train.steps=0", expect="train.steps = 0 is invalid: must be >= 1"),
    "lr_string": _run_set("train.lr=fast", expect="train.lr = 'fast' is invalid: expected a "
                                                  "float"),
    "unknown_section": _run_set("nosuch.key=1", expect="unknown key nosuch in the top level"),
    # -- tracebacks before: [[faults]] without a key, NUL in a string
    "fault_without_step": _run_toml('[[faults]]\nkind = "kill"\nrank = 1\n',
                                    "[[faults]] table {'kind': 'kill', 'rank': 1} has no key "
                                    "step; required: kind, step"),
    "fault_without_kind": _run_toml("[[faults]]\nstep = 3\nrank = 1\n",
                                    "has no key kind; required: kind, step"),
    "fault_past_the_end": _run_toml('[[faults]]\nkind = "kill"\nrank = 1\nstep = 500\n',
                                    "faults.step = 500 is invalid: must be <= train.steps"),
    "run_name_nul": _run_toml('[run]\nname = "a\\u0000b"\n',
                              "run.name = 'a\\x00b' is invalid: must not contain a NUL"),
    "storage_nul": _run_toml('[checkpoint]\nstorage = "ck\\u0000pt"\n',
                             "checkpoint.storage = 'ck\\x00pt' is invalid: must not contain"),
    "inject_without_step": Case(("run", "config.toml", "--inject", "kill:rank=1"),
                                expect="--inject 'kill:rank=1' is invalid: expected "
                                       "KIND:TARGET=N,step=S"),
    "profile_zero": Case(("run", "config.toml", "--profile", "0"),
                         expect="--profile '0' is invalid: steps count from 1"),
    # -- layouts the model cannot be split by, refused before workers start
    "cp_not_dividing_seq_len": _run_set("task.args.seq_len=34", "parallel.cp=2",
                                        "parallel.dp_replicate=1",
                                        expect="parallel.cp = 2 is invalid: the sequence length "
                                               "34 must be a multiple of 2 x cp = 4"),
    "cp_not_dividing_world": _run_set("parallel.cp=3", expect="parallel.cp = 3 is invalid: "
                                      "tp x cp = 3 must divide the world size 2"),
    "cp_with_pp": Case(("run", "config.toml", *_sets(
        "scaling.num_workers=4", "parallel.cp=2", "parallel.pp=2", "parallel.dp_replicate=1",
        "task.args.tie_embeddings=false")), expect="parallel.cp = 2 is invalid with "
        "parallel.pp = 2: context parallelism does not yet run inside pipeline stages"),
    "ep_not_dividing_experts": Case(("run", "config.toml", *_sets(
        'task.path="stalwart.examples.moe.task:MoETask"', "task.args.n_experts=6",
        "parallel.ep=4", "scaling.num_workers=4", "parallel.dp_replicate=1",
        "parallel.dp_shard=-1")),
        expect="parallel.ep = 4 is invalid: must divide the model's 6 experts"),
    "ep_without_shard_ranks": _run_set("parallel.ep=2", expect="parallel.ep = 2 is invalid: "
                                       "must divide dp_shard = 1"),
    # -- task.args, checked by the task on the driver
    "val_fraction_5": _run_set("task.args.val_fraction=5",
                               expect="task.args.val_fraction = 5 is invalid: must be a number "
                                      "between 0 and 1 (exclusive)"),
    "val_fraction_tiny": _run_set("task.args.val_fraction=1e-7",
                                  expect="task.args.val_fraction = 1e-07 is invalid: it puts 0 "
                                         "of"),
    "task_arg_unknown": _run_set("task.args.dmodel=64",
                                 expect="unknown key task.args.dmodel; allowed: val_fraction, "),
    "task_arg_type": _run_set("task.args.tie_embeddings=no",
                              expect="task.args.tie_embeddings = 'no' is invalid: must be "
                                     "true or false"),
    "task_arg_float_for_int": _run_set("task.args.d_model=64.0",
                                       expect="task.args.d_model = 64.0 is invalid: must be "
                                              "an int >= 1"),
    "task_arg_heads": _run_set("task.args.d_model=64", "task.args.n_heads=3",
                               expect="task.args.n_heads = 3 is invalid: must divide d_model "
                                      "= 64"),
    "task_arg_inf": _run_set("task.args.rope_theta=inf",
                             expect="task.args.rope_theta = inf is invalid: must be a finite "
                                    "number > 0"),
    "task_arg_vocab": _run_set("task.args.vocab_size=100",
                               expect="task.args.vocab_size = 100 is invalid: must be >= 256"),
    # -- places that cannot be written (as root, permission bits stop nothing: item 10)
    "run_dir_is_a_file": Case(("run", "config.toml", "--run-dir", "afile"),
                              _file("afile", "x"),
                              expect="run dir afile is a file, not a directory"),
    "run_dir_under_a_file": Case(("run", "config.toml", "--run-dir", "afile/run"),
                                 _file("afile", "x"),
                                 expect="run dir afile/run is under afile, a file, not a "
                                        "directory"),
    "run_dir_in_proc": Case(("run", "config.toml", "--run-dir", "/proc/stalwart-run"),
                            expect="run dir /proc/stalwart-run is not writable: cannot "
                                   "create the directory /proc/stalwart-run"),
    "resume_a_file": Case(("run", "config.toml", "--resume", "--run-dir", "afile"),
                          _file("afile", "x"),
                          expect="run dir afile is a file, not a directory"),
    "storage_in_proc": _run_set('checkpoint.storage="/proc/stalwart-ckpt"',
                                expect="checkpoint.storage '/proc/stalwart-ckpt' is not "
                                       "writable: cannot create the directory "
                                       "/proc/stalwart-ckpt"),
    "storage_under_a_file": Case(("run", "config.toml", *_sets('checkpoint.storage="afile/c"'),
                                  "--run-dir", "r"), _file("afile", "x"),
                                 expect="/afile/c' is under "),
    "storage_read_only_http": _run_set('checkpoint.storage="{http}/ckpt"',
                                       expect="/ckpt' is not writable: ClientResponseError: "
                                              "501"),
}
RUN_CASES = [name for name, c in CASES.items() if c.args[0] == "run"]


@dataclass
class Outcome:
    name: str
    args: tuple[str, ...]
    cwd: Path
    before: dict[str, bytes | None]
    ray_tmpdir: Path
    returncode: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return (f"stalwart {' '.join(self.args)} -> exit {self.returncode}\n--- stdout\n"
                f"{self.stdout}\n--- stderr\n{self.stderr}")

    @property
    def ray_started(self) -> bool:
        return any(self.ray_tmpdir.iterdir())

    def error_line(self) -> str:
        """The one `stalwart: error:` line; checks exit code 2 and that nothing else went wrong."""
        assert self.returncode == 2, str(self)
        errors = [line for line in self.stderr.splitlines() if line.startswith(ERROR_PREFIX)]
        assert len(errors) == 1, str(self)
        assert "Traceback" not in self.stderr, str(self)
        assert self.stdout == "", str(self)
        return errors[0]

    def only_error(self) -> str:
        """error_line, and it is all there is: no Ray log lines, no Ray session, no change."""
        line = self.error_line()
        assert self.stderr.splitlines() == [line], str(self)
        assert not self.ray_started, f"Ray was started:\n{self}"
        self.assert_unchanged()
        return line

    def assert_unchanged(self) -> None:
        after = _tree(self.cwd)
        assert after == self.before, (
            f"the command changed its directory: added {sorted(set(after) - set(self.before))}, "
            f"removed {sorted(set(self.before) - set(after))}, rewritten "
            f"{sorted(k for k in set(after) & set(self.before) if after[k] != self.before[k])}")


def _run(name: str, cwd: Path, before: dict[str, bytes | None], ray_tmp: Path,
         http: str) -> Outcome:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_TMPDIR"] = str(ray_tmp)
    args = tuple(a.replace("{http}", http) for a in CASES[name].args)
    proc = run_from_thread([str(STALWART), *args], cwd=cwd, env=env, timeout=TIMEOUT_S)
    return Outcome(name, args, cwd, before, ray_tmp, proc.returncode, proc.stdout, proc.stderr)


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    """Serves files, refuses PUT and POST (501): read-only storage."""

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextlib.contextmanager
def _read_only_http(root: Path) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_QuietFiles, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[Outcome]]]:
    root = tmp_path_factory.mktemp("cli")
    ray_dirs: list[Path] = []
    futures: dict[str, Future[Outcome]] = {}
    served = tmp_path_factory.mktemp("served")
    with _read_only_http(served) as http_url, ThreadPoolExecutor(max_workers=PARALLEL) as pool:
        for name, case in CASES.items():
            cwd = root / name
            cwd.mkdir()
            shutil.copy(REFERENCE_CONFIG, cwd / "config.toml")
            if case.prepare is not None:
                case.prepare(cwd)
            # short path: Ray puts unix sockets under it (a 107-byte limit)
            ray_tmp = Path(tempfile.mkdtemp(prefix="swrt", dir="/tmp"))
            ray_dirs.append(ray_tmp)
            futures[name] = pool.submit(_run, name, cwd, _tree(cwd), ray_tmp, http_url)
        yield futures
    assert _tree(served) == {}, "the read-only HTTP storage was written"
    for d in ray_dirs:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def outcome(request: pytest.FixtureRequest, outcomes: dict[str, Future[Outcome]]) -> Outcome:
    """The outcome of the case the test names with @case(...)."""
    return outcomes[request.param].result()


def case(name: str) -> pytest.MarkDecorator:
    assert name in CASES, name
    return pytest.mark.parametrize("outcome", [name], indirect=True)


# ---------------------------------------------------------------------------- every run case


def test_the_table_holds_at_least_30_bad_run_inputs() -> None:
    assert len(RUN_CASES) >= 30, len(RUN_CASES)


@pytest.mark.parametrize("outcome", RUN_CASES, indirect=True)
def test_bad_run_input_is_one_error_line_and_changes_nothing(outcome: Outcome) -> None:
    """Exit 2, exactly one `stalwart: error:` line, no traceback, nothing on disk changed and,
    but for the one case that needs the cluster's size, no Ray started."""
    if outcome.name == "too_big":
        line = outcome.error_line()
        outcome.assert_unchanged()
    else:
        line = outcome.only_error()
    assert CASES[outcome.name].expect in line, str(outcome)


# ---------------------------------------------------------------------------- config


@case("missing_config")
def test_missing_config_file(outcome: Outcome) -> None:
    assert outcome.only_error() == (f"{ERROR_PREFIX}config file 'missing.toml' does not exist "
                                    f"(expected a TOML file)")


@case("malformed_toml")
def test_malformed_toml(outcome: Outcome) -> None:
    line = outcome.only_error()
    assert line.startswith(f"{ERROR_PREFIX}config file 'bad.toml' is not valid TOML: ")


@case("unknown_key")
def test_unknown_key(outcome: Outcome) -> None:
    line = outcome.only_error()
    assert ("unknown key train.stepz in [train]; did you mean train.steps? allowed: steps, "
            "global_batch_size") in line


@case("batch")
def test_batch_not_divisible(outcome: Outcome) -> None:
    assert outcome.only_error() == (f"{ERROR_PREFIX}train.global_batch_size = 10 is invalid: "
                                    f"must be a multiple of train.micro_batch_size (8)")


# ---------------------------------------------------------------------------- task, storage


@case("task_path")
def test_task_path_that_does_not_import(outcome: Outcome) -> None:
    line = outcome.only_error()
    assert ("task path 'nope.mod:Task': cannot import module 'nope.mod': "
            "ModuleNotFoundError: No module named 'nope'") in line


@case("foo_storage")
def test_unknown_storage_protocol(outcome: Outcome) -> None:
    line = outcome.only_error()
    assert "checkpoint.storage 'foo://bucket/x': Protocol not known: foo" in line


@case("s3_storage")
def test_storage_filesystem_not_installed(outcome: Outcome) -> None:
    if importlib.util.find_spec("s3fs") is not None:
        pytest.skip("s3fs is installed here")
    line = outcome.only_error()
    assert "checkpoint.storage 's3://bucket/x': the filesystem for s3:// is not installed" in line
    assert "s3fs" in line  # fsspec's hint: what to install


@case("hdfs_storage")
def test_storage_filesystem_that_cannot_start(outcome: Outcome) -> None:
    assert "checkpoint.storage 'hdfs://namenode/x'" in outcome.only_error()


# ---------------------------------------------------------------------------- run directory


@case("resume_no_run_dir")
def test_resume_without_run_dir(outcome: Outcome) -> None:
    assert outcome.only_error() == (f"{ERROR_PREFIX}--resume needs --run-dir: the run "
                                    f"directory to continue")


@case("resume_no_run")
def test_resume_with_no_run(outcome: Outcome) -> None:
    line = outcome.error_line()
    assert "run dir no-such-run" in line
    assert "does not exist" in line or "holds no config.toml, so no run to resume" in line
    assert not outcome.ray_started


@case("resume_no_run")
def test_resume_with_no_run_changes_nothing(outcome: Outcome) -> None:
    assert outcome.only_error() == f"{ERROR_PREFIX}run dir no-such-run does not exist"


@case("fresh_into_checkpoints")
def test_fresh_run_into_a_dir_with_checkpoints_is_refused(outcome: Outcome) -> None:
    line = outcome.only_error()  # compares every file's bytes before and after
    storage = (outcome.cwd / "old" / "checkpoints").resolve()
    assert f"{storage} already holds checkpoints (steps [10])" in line
    assert "pass --resume to continue that run, or choose another --run-dir" in line


@case("fresh_into_run")
def test_fresh_run_into_a_dir_with_a_run_is_refused(outcome: Outcome) -> None:
    line = outcome.error_line()
    assert "run dir old already holds a run (config.toml); pass --resume" in line
    assert not outcome.ray_started


@case("fresh_into_run")
def test_fresh_run_into_a_dir_with_a_run_changes_nothing(outcome: Outcome) -> None:
    outcome.assert_unchanged()


@case("model_too_big")
def test_a_model_too_large_for_the_machine_is_refused_as_plan_refuses_it(
        outcome: Outcome) -> None:
    line = outcome.only_error()
    # the workers' share of this machine, then plan's own message
    assert " each of the 2 workers has (this machine's " in line
    assert "; no layout of 2 devices fits in " in line and " at least " in line


# ---------------------------------------------------------------------------- export


@case("export_no_checkpoint")
def test_export_with_no_checkpoint(outcome: Outcome) -> None:
    storage = (outcome.cwd / "run").resolve() / "checkpoints"
    assert outcome.only_error() == f"{ERROR_PREFIX}no committed checkpoint under {storage}"


# ---------------------------------------------------------------------------- the cluster


@case("too_big")
def test_world_larger_than_the_cluster(outcome: Outcome) -> None:
    line = outcome.error_line()
    assert "scaling.num_workers=64" in line and "needs 64 CPUs" in line
    # The embedded Ray has the machine's cores plus a logical CPU for the reference
    # config's warm spare (scaling.spare_workers = 1).
    assert f"the Ray cluster has {os.cpu_count() + 1} CPUs" in line
    assert "lower scaling.num_workers" in line
    assert outcome.ray_started  # shows the RAY_TMPDIR probe of the other cases works
    assert "stalwart-worker" not in outcome.stderr


@case("too_big")
def test_world_larger_than_the_cluster_changes_nothing(outcome: Outcome) -> None:
    outcome.assert_unchanged()
