"""SWEEP.toml: a hyperparameter sweep of a stalwart job, as `stalwart sweep` reads it.

    name = "gpt-asha"               # Tune experiment name (default: the file's stem)
    config = "config.toml"          # the job every trial runs (relative to this file)
    set = ["train.steps=200"]       # overrides for every trial (optional)
    metric = "val_loss"             # what Tune compares: a metrics.jsonl column
    mode = "min"                    # min or max
    trials = 4                      # Tune's num_samples
    concurrency = 2                 # trials at once (default: as many as the cluster holds)
    storage = "sweeps"              # where the experiment directory goes (default ./sweeps)

    [search]                        # config key = a value, or one sampling rule
    "train.lr" = { loguniform = [1e-4, 1e-2] }
    "task.args.d_model" = { choice = [64, 128] }

    [scheduler]                     # fifo (default), asha or pbt; times count training steps
    type = "asha"
    max_t = 200
    grace_period = 20

Every problem is found here, before Ray starts: unknown keys, a malformed rule, a value the
job's config refuses, a metric a run never reports, a PBT that could never exploit.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.core.config import JobConfig, apply_overrides, config_from_dict, read_toml
from stalwart.core.errors import ConfigError, StalwartError
from stalwart.core.metric_names import is_task_metric
from stalwart.core.spelling import did_you_mean
from stalwart.integrations.tune.trainable import as_overrides

# Columns of metrics.jsonl that are numbers a sweep can rank trials by.
METRICS = ("loss", "val_loss", "lr", "tokens_per_s", "world_size", "samples_seen", "step")
# rule -> (number of arguments, or None for a non-empty list of values)
RULES: dict[str, int | None] = {
    "uniform": 2, "quniform": 3, "loguniform": 2, "qloguniform": 3, "randint": 2,
    "qrandint": 3, "lograndint": 2, "randn": 2, "choice": None, "grid": None}
# scheduler -> its keys: (type, allowed values, as the error says it)
SCHEDULERS: dict[str, dict[str, tuple[type, Any, str]]] = {
    "fifo": {},
    "asha": {"max_t": (int, lambda v: v > 0, "an integer > 0"),
             "grace_period": (int, lambda v: v > 0, "an integer > 0"),
             "reduction_factor": (int, lambda v: v > 1, "an integer > 1")},
    "pbt": {"perturbation_interval": (int, lambda v: v > 0, "an integer > 0"),
            "quantile_fraction": (float, lambda v: 0 <= v <= 0.5, "a number in [0, 0.5]"),
            "resample_probability": (float, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
            "synch": (bool, lambda v: True, "true or false"),
            "mutations": (dict, bool, "a table of search rules")},
}
TOP_KEYS = ("name", "config", "set", "metric", "mode", "trials", "concurrency", "storage",
            "search", "scheduler")
# PBT restores another trial's checkpoint into a trial, so it may only change what a
# resumed run may change (the same keys `stalwart run --resume` refuses to change).
PBT_FIXED = ("task.", "train.seed", "train.global_batch_size")


class SweepError(ConfigError):
    """A sweep file is wrong (names the key, the value and what is allowed)."""


@dataclass(frozen=True)
class Sweep:
    path: Path
    name: str
    config: Path
    overrides: tuple[str, ...]
    metric: str
    mode: str
    trials: int
    concurrency: int | None
    storage: Path
    search: dict[str, Any]
    job: JobConfig
    """The job config every trial starts from (the file and `set`, before [search])."""
    scheduler: dict[str, Any] = field(default_factory=dict)

    @property
    def scheduler_type(self) -> str:
        return self.scheduler.get("type", "fifo")

    def param_space(self) -> dict[str, Any]:
        return {key: domain(spec) for key, spec in self.search.items()}

    def make_scheduler(self) -> Any:
        from ray.tune.schedulers import ASHAScheduler, FIFOScheduler, PopulationBasedTraining

        options = {k: v for k, v in self.scheduler.items() if k != "type"}
        if self.scheduler_type == "asha":
            options.setdefault("max_t", self.job.train.steps)
            return ASHAScheduler(time_attr="step", **options)
        if self.scheduler_type == "pbt":
            mutations = {k: domain(v) for k, v in options.pop("mutations").items()}
            return PopulationBasedTraining(time_attr="step", hyperparam_mutations=mutations,
                                           **options)
        return FIFOScheduler()


def domain(spec: Any) -> Any:
    """A search rule as a ray.tune sampling domain (a plain value stays itself)."""
    from ray import tune

    if not isinstance(spec, dict):
        return spec
    (rule, args), = spec.items()
    if rule == "grid":
        return tune.grid_search(list(args))
    if rule == "choice":
        return tune.choice(list(args))
    return getattr(tune, rule)(*args)


def _fail(where: str, problem: str) -> SweepError:
    return SweepError(f"{where}: {problem}")


# Rules that draw floats (Tune's quniform rounds to a multiple of q, as a float): their
# values are checked as floats, so a float rule on an integer key is refused up front.
FLOAT_RULES = ("uniform", "quniform", "loguniform", "qloguniform", "randn")


def _check_value(where: str, value: Any) -> Any:
    """A value a trial's config can take: a string, a finite number, a boolean, or a list
    of them (a trial gets it as a `--set` override)."""
    items = value if isinstance(value, list) else [value]
    for item in items:
        if isinstance(item, float) and not math.isfinite(item):
            raise _fail(where, f"{value!r} is not allowed: numbers must be finite")
        if not isinstance(item, str | int | float | bool) and not (
                item is not value and isinstance(item, list)):
            raise _fail(where, f"{value!r} is not allowed: a string, number, boolean or a "
                               f"list of them")
    return value


def _check_rule(where: str, spec: Any) -> list[Any]:
    """Check one search rule; return the values it can produce at its edges (as floats for
    a rule that draws floats)."""
    if not isinstance(spec, dict):
        return [_check_value(where, spec)]
    if len(spec) != 1 or next(iter(spec)) not in RULES:
        raise _fail(where, f"{spec!r} is not a search rule: write a value, or one of "
                           f"{{ {' | '.join(RULES)} = [...] }}")
    (rule, args), = spec.items()
    arity = RULES[rule]
    if not isinstance(args, list) or (arity is None and not args) or (
            arity is not None and len(args) != arity):
        want = "a non-empty list of values" if arity is None else f"a list of {arity} numbers"
        raise _fail(where, f"{rule} takes {want}, got {args!r}")
    if arity is None:
        return [_check_value(where, a) for a in args]
    if not all(isinstance(a, int | float) and not isinstance(a, bool) for a in args):
        raise _fail(where, f"{rule} takes numbers, got {args!r}")
    if not all(math.isfinite(a) for a in args):
        raise _fail(where, f"{rule} takes finite numbers, got {args!r}")
    if rule == "randn":
        if args[1] <= 0:
            raise _fail(where, f"randn's standard deviation must be > 0, got {args[1]}")
        return [float(args[0])]
    low, high = args[0], args[1]
    if not low < high:
        raise _fail(where, f"{rule} needs low < high, got [{low}, {high}]")
    if rule.startswith(("log", "qlog")) and low <= 0:
        raise _fail(where, f"{rule} needs low > 0, got {low}")
    if rule in ("randint", "qrandint", "lograndint") and not all(
            isinstance(a, int) for a in args):
        raise _fail(where, f"{rule} takes integers, got {args!r}")
    if rule.startswith("q") and args[2] <= 0:
        raise _fail(where, f"{rule}'s step q must be > 0, got {args[2]}")
    if rule in FLOAT_RULES:
        return [float(low), float(high)]
    return [low, high - 1 if rule == "randint" else high]


# The job's config with more overrides on top (the job's file is read once, by load_sweep).
JobWith = Callable[[list[str]], JobConfig]


def check_trial(job: JobConfig) -> None:
    """What a trial's run checks on its driver before it starts anything (as `stalwart run`
    does): the task builds from its task.args, and takes the layout."""
    from stalwart.core.task import build_task
    from stalwart.parallel.dims import ParallelDims

    task = build_task(job.task.path, job.task.args)
    task.check_layout(ParallelDims.from_config(job.parallel, job.scaling.num_workers))


def _check_values(sweep_path: Path, job_with: JobWith, where: str, key: str, spec: Any,
                  values: list[Any], check: Callable[[JobConfig], None] = check_trial) -> None:
    """The job's validation on each edge value, then `check` (by default the task's own): a
    bad key or value fails as in `--set`, and here rather than in every trial."""
    for value in values:
        try:
            check(job_with(as_overrides({key: value})))
        except StalwartError as exc:
            hint = ""
            if isinstance(value, float) and value.is_integer():
                rule = next(iter(spec))
                hint = (f" ({rule} draws floats; for an integer key use randint, qrandint, "
                        f"lograndint or choice)")
            raise _fail(f"{sweep_path} {where}", f"{key} = {value!r}: {exc}{hint}") from None


def _typed(where: str, value: Any, kind: type, allowed: str) -> Any:
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise _fail(where, f"{value!r} is not allowed: {allowed}")
    return value


def load_sweep(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Sweep:
    """Read and check a sweep file; `overrides` (the CLI's --set) apply after the file's."""
    p = Path(path)
    data = read_toml(p, "sweep file", SweepError)
    unknown = sorted(set(data) - set(TOP_KEYS))
    if unknown:
        raise _fail(str(p), f"unknown key {unknown[0]!r}; {did_you_mean(unknown[0], TOP_KEYS)}"
                            f"allowed: {', '.join(TOP_KEYS)}")
    if "config" not in data or not isinstance(data["config"], str):
        raise _fail(str(p), "config = \"PATH\" (the job's TOML config) is required")
    config = (p.parent / data["config"]).resolve()
    set_list = data.get("set", [])
    if not isinstance(set_list, list) or not all(isinstance(s, str) for s in set_list):
        raise _fail(f"{p} set", f"{set_list!r} is not a list of \"key=value\" strings")
    all_overrides = [*set_list, *overrides]
    job_data = read_toml(config)

    def job_with(extra: list[str]) -> JobConfig:
        return config_from_dict(apply_overrides(job_data, [*all_overrides, *extra]))

    job = job_with([])  # names the config's own problems

    metric = data.get("metric")
    if metric not in METRICS and not is_task_metric(metric):
        raise _fail(f"{p} metric", f"{metric!r} is never reported by a stalwart run; use "
                                   f"one of {', '.join(METRICS)}, or a metric the task's loss "
                                   f"returns (val_<name> for its validation mean)")
    if isinstance(metric, str) and metric.startswith("val_") and job.data.val_every == 0:
        raise _fail(f"{p} metric", f"{metric} is never reported: the job has "
                                   f"data.val_every = 0")
    mode = data.get("mode", "min")
    if mode not in ("min", "max"):
        raise _fail(f"{p} mode", f"{mode!r} is not allowed: min or max")
    trials = _typed(f"{p} trials", data.get("trials", 1), int, "an integer >= 1")
    concurrency = data.get("concurrency")
    if concurrency is not None:
        _typed(f"{p} concurrency", concurrency, int, "an integer >= 1")
    for key, value in (("trials", trials), ("concurrency", concurrency)):
        if value is not None and value < 1:
            raise _fail(f"{p} {key}", f"must be >= 1, got {value}")

    search = data.get("search", {})
    if not isinstance(search, dict) or not search:
        raise _fail(f"{p} [search]", "a sweep needs at least one key to search, e.g. "
                                     "\"train.lr\" = { loguniform = [1e-4, 1e-2] }")
    name = _check_name(p, data.get("name", p.stem))
    storage = _check_storage(p, data.get("storage", "sweeps"))
    edges = {key: _check_rule(f"{p} [search] {key}", spec) for key, spec in search.items()}
    for key, spec in search.items():  # the config's own checks: nothing imported yet
        _check_values(p, job_with, "[search]", key, spec, edges[key], check=lambda job: None)
    # The checks that import the task (and torch) or Tune come last: the file's own
    # mistakes are named in a second.
    try:  # unknown task.args would fail every trial
        check_trial(job)
    except StalwartError as exc:
        raise _fail(str(p), f"every trial would be refused: {exc}") from None
    for key, spec in search.items():
        _check_values(p, job_with, "[search]", key, spec, edges[key])
    scheduler = _check_scheduler(p, data.get("scheduler", {}), job_with, job)
    return Sweep(path=p, name=name, config=config,
                 overrides=tuple(all_overrides), metric=metric, mode=mode, trials=trials,
                 concurrency=concurrency, storage=storage, search=search,
                 job=job, scheduler=scheduler)


def _check_name(p: Path, name: Any) -> str:
    """The experiment's directory name, one level under storage."""
    if not isinstance(name, str) or not name.strip() or name in (".", "..") or any(
            c in name for c in "/\\\0"):
        raise _fail(f"{p} name", f"{name!r} is not allowed: the experiment's directory name "
                                 f"under storage, a string without /, \\ or NUL")
    return name


def _check_storage(p: Path, storage: Any) -> Path:
    """A local directory we can write (made if missing, by Tune): checked before Ray starts,
    with nothing left behind."""
    if not isinstance(storage, str) or not storage or "\0" in storage:
        raise _fail(f"{p} storage", f"{storage!r} is not allowed: a local directory path "
                                    f"(default \"sweeps\")")
    if "://" in storage:
        raise _fail(f"{p} storage", f"{storage!r}: a sweep's storage is a local directory "
                                    f"(the results table is written there); URLs are not "
                                    f"supported")
    path = Path(storage).expanduser().resolve()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise _fail(f"{p} storage", f"{storage!r}: {existing} is not a directory")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise _fail(f"{p} storage", f"{storage!r}: cannot write in {existing} "
                                    f"({exc.strerror or exc})") from None
    return path


def _check_scheduler(p: Path, scheduler: Any, job_with: JobWith, job: JobConfig
                     ) -> dict[str, Any]:
    where = f"{p} [scheduler]"
    if not isinstance(scheduler, dict):
        raise _fail(where, "must be a table")
    kind = scheduler.get("type", "fifo")
    if kind not in SCHEDULERS:
        raise _fail(f"{where} type", f"{kind!r} is not allowed: {', '.join(SCHEDULERS)}")
    allowed = SCHEDULERS[kind]
    for key, value in scheduler.items():
        if key == "type":
            continue
        if key not in allowed:
            raise _fail(where, f"unknown key {key!r} for {kind}; "
                               f"{did_you_mean(key, ['type', *allowed])}allowed: "
                               f"{', '.join(['type', *allowed])}")
        kind_of, ok, described = allowed[key]
        if not ok(_typed(f"{where} {key}", value, kind_of, described)):
            raise _fail(f"{where} {key}", f"{value!r} is not allowed: {described}")
    if kind == "pbt":
        _check_pbt(where, scheduler, p, job_with, job)
    return dict(scheduler)


def _check_pbt(where: str, scheduler: dict[str, Any], p: Path, job_with: JobWith,
               job: JobConfig) -> None:
    interval = scheduler.get("perturbation_interval")
    if interval is None:
        raise _fail(where, "pbt needs perturbation_interval (in training steps)")
    every, log_every = job.checkpoint.persist_every, job.run.log_every
    if every != log_every or every > interval:
        # PBT clones a trial only if its latest report carries a checkpoint: every report must.
        raise _fail(where, f"pbt clones a trial from the checkpoint of its latest report, so "
                           f"every report needs one: checkpoint.persist_every ({every}) must "
                           f"equal run.log_every ({log_every}) and be <= "
                           f"perturbation_interval ({interval})")
    mutations = scheduler.get("mutations")
    if not mutations:
        raise _fail(where, "pbt needs [scheduler.mutations]: the keys it may change, e.g. "
                           "\"train.lr\" = { loguniform = [1e-4, 1e-2] }")
    for key, spec in mutations.items():
        if key.startswith(PBT_FIXED):
            raise _fail(f"{where} mutations {key}", "pbt restores another trial's checkpoint, "
                        f"so it cannot change {', '.join(PBT_FIXED)}*; mutate keys such as "
                        f"train.lr or train.weight_decay")
        if not isinstance(spec, dict) or "grid" in spec:
            raise _fail(f"{where} mutations {key}", f"{spec!r} is not allowed: pbt mutates a "
                        f"key by drawing from a rule, e.g. {{ loguniform = [1e-4, 1e-2] }} or "
                        f"{{ choice = [...] }} (a plain value or a grid never changes)")
        values = _check_rule(f"{where} mutations {key}", spec)
        _check_values(p, job_with, "[scheduler.mutations]", key, spec, values)

