"""Running a sweep file with Ray Tune: the Tuner, its resumption, what it prints while it runs
(a table per round, stalwart.integrations.tune.rounds; Tune's own output with `verbose`), and
the results table."""

from __future__ import annotations

import json
import math
import os
import stat
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stalwart.core.errors import RunDirError
from stalwart.core.ownership import why_not_own
from stalwart.core.ray_private import restored_run_config
from stalwart.integrations.tune.sweep_file import Sweep
from stalwart.integrations.tune.trainable import TRIAL_DRIVER_RESOURCES, trainable
from stalwart.tables import cell, columns

RESULTS_FILE = "sweep_results.json"


@dataclass(frozen=True)
class TrialRow:
    trial_id: str
    params: dict[str, Any]
    step: int | None
    metric: float | None
    state: str
    """finished, stopped early (the scheduler ended it), or error"""
    path: str
    error: str | None = None
    """The last line of a failed trial's error."""


def trial_cpus(sweep: Sweep) -> float:
    """CPUs one trial's workers and warm spares hold."""
    sc = sweep.job.scaling
    return (sc.num_workers + sc.spare_workers) * sc.cpus_per_worker


def experiment_dir(sweep: Sweep) -> Path:
    return sweep.storage / sweep.name


def check_experiment_dir(sweep: Sweep, resume: bool) -> None:
    """A sweep never writes into another sweep's directory unless told to resume it."""
    path = experiment_dir(sweep)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"{path} (storage/name of {sweep.path}) is a file, not a sweep's "
                          f"directory; change name or storage")
    if resume:
        from ray import tune  # seconds to import: only a resume asks it

        if not tune.Tuner.can_restore(str(path)):
            raise RunDirError(f"--resume: {path} holds no Tune experiment to resume")
        check_own_state(path)
    if not resume and path.exists() and any(path.iterdir()):
        raise RunDirError(f"{path} already holds a sweep; pass --resume to continue it, or "
                          f"change name or storage in {sweep.path}")


TUNER_STATE = "tuner.pkl"


def check_own_state(path: Path) -> None:
    """Tune's restore unpickles the experiment's `tuner.pkl`, which runs whatever it says:
    only a regular file this user wrote, in a directory only this user can change, is
    restored (a sweep dir copied from elsewhere or shared is not)."""
    for item in (path, path / TUNER_STATE):
        st = item.lstat()
        kind = stat.S_ISDIR if item == path else stat.S_ISREG
        if not kind(st.st_mode):
            raise RunDirError(f"--resume: {item} is not a plain "
                              f"{'directory' if item == path else 'file'}; Tune would "
                              f"unpickle it, so it must be this user's own")
        if (why := why_not_own(st)) is not None:
            raise RunDirError(f"--resume: {item}: {why}; Tune's restore unpickles it, which "
                              f"runs code, so only this user's own state is restored")


def concurrency(sweep: Sweep) -> int:
    """The sweep's own, else as many trials as the cluster's CPUs hold at once."""
    import ray

    if sweep.concurrency is not None:
        return sweep.concurrency
    return max(1, math.floor(ray.cluster_resources().get("CPU", 0) / trial_cpus(sweep)))


def embedded_cpus(sweep: Sweep) -> int:
    """A Ray on this machine: its cores, or enough logical CPUs for the sweep's concurrency."""
    want = trial_cpus(sweep) * (sweep.concurrency or 1)
    return max(os.cpu_count() or 1, math.ceil(want))


def run_sweep(sweep: Sweep, *, resume: bool = False, key_file: str | None = None,
              trusted_key_files: Sequence[str] = (), verbose: bool = False) -> Any:
    """Run (or resume) the sweep on the connected Ray; returns Tune's ResultGrid.
    `key_file`, `trusted_key_files`: the trials' checkpoint keys (see Trainer). `verbose`:
    Tune's own output and each trial's in the terminal, instead of a table per round (the
    trials' output then goes to output.log in each trial's directory)."""
    from ray import tune

    fn = tune.with_resources(trainable(sweep.config, sweep.overrides, metric=sweep.metric,
                                       with_checkpoints=sweep.scheduler_type == "pbt",
                                       key_file=key_file,
                                       trusted_key_files=trusted_key_files,
                                       quiet=not verbose),
                             TRIAL_DRIVER_RESOURCES)
    if resume:
        tuner = tune.Tuner.restore(str(experiment_dir(sweep)), trainable=fn,
                                   resume_unfinished=True, resume_errored=True)
        # Tune restores the output options the sweep started with: this command's apply.
        run_config = restored_run_config(tuner)
        if run_config is not None:
            run_config.verbose, run_config.callbacks = output_options(sweep, verbose)
        with tune_output(verbose):
            return tuner.fit()
    shown, callbacks = output_options(sweep, verbose)
    tuner = tune.Tuner(
        fn, param_space=sweep.param_space(),
        tune_config=tune.TuneConfig(metric=sweep.metric, mode=sweep.mode,
                                    scheduler=sweep.make_scheduler(), num_samples=sweep.trials,
                                    max_concurrent_trials=concurrency(sweep)),
        run_config=tune.RunConfig(name=sweep.name, storage_path=str(sweep.storage),
                                  verbose=shown, callbacks=callbacks))
    with tune_output(verbose):
        return tuner.fit()


# Tune's output engine: "0" is its first one, which prints nothing at verbose 0 (the newer
# one prints the experiment's banner at any verbosity). Read when the Tuner starts.
OUTPUT_ENGINE_ENV = "RAY_AIR_NEW_OUTPUT"


@contextmanager
def tune_output(verbose: bool) -> Iterator[None]:
    """Tune's own output on (its default engine) or wholly off, while the Tuner runs."""
    if verbose:
        yield
        return
    before = os.environ.get(OUTPUT_ENGINE_ENV)
    os.environ[OUTPUT_ENGINE_ENV] = "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(OUTPUT_ENGINE_ENV, None)
        else:
            os.environ[OUTPUT_ENGINE_ENV] = before


def output_options(sweep: Sweep, verbose: bool) -> tuple[int, list[Any]]:
    """Tune's verbosity and the callbacks that print: Tune's default output (verbose 1), or
    none of it (0) and a table per round."""
    if verbose:
        return 1, []
    from stalwart.integrations.tune.rounds import RoundTable

    return 0, [RoundTable(search=list(sweep.search), metric=sweep.metric, mode=sweep.mode,
                          steps=sweep.job.train.steps)]


def trial_rows(sweep: Sweep, results: Any) -> list[TrialRow]:
    steps = sweep.job.train.steps
    rows = []
    for result in results:
        m = result.metrics or {}
        step = m.get("step")
        if result.error is not None:
            state = "error"
        elif step is not None and step >= steps:
            state = "finished"
        else:
            state = "stopped early"
        rows.append(TrialRow(trial_id=str(m.get("trial_id", Path(result.path).name)),
                             params={k: result.config.get(k) for k in sweep.search},
                             step=step, metric=m.get(sweep.metric), state=state,
                             path=str(result.path), error=_last_line(result.error)))
    return sorted(rows, key=lambda r: r.trial_id)


def _last_line(error: BaseException | None) -> str | None:
    """What a failed trial's error says last (its traceback is in the trial's directory)."""
    if error is None:
        return None
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def best_row(sweep: Sweep, rows: list[TrialRow]) -> TrialRow | None:
    scored = [r for r in rows if r.metric is not None and r.state != "error"
              and not math.isnan(r.metric)]
    if not scored:
        return None
    pick = min if sweep.mode == "min" else max
    return pick(scored, key=lambda r: r.metric)


def format_results(sweep: Sweep, rows: list[TrialRow]) -> str:
    """The table of trials, why each failed one failed, the best one as `--set` flags, and
    where the experiment is."""
    heads = ["trial", *sweep.search, "step", sweep.metric, "state"]
    table = [[r.trial_id, *(cell(r.params[k]) for k in sweep.search), cell(r.step),
              cell(r.metric), r.state] for r in rows]
    lines = [columns(heads, table)]
    lines += [f"{r.trial_id}: error: {r.error} (in {r.path})" for r in rows if r.error]
    best = best_row(sweep, rows)
    if best is not None:
        flags = " ".join(f"--set {k}={json.dumps(v)}" for k, v in best.params.items())
        lines.append(f"best: {best.trial_id} {sweep.metric} {cell(best.metric)} at step "
                     f"{best.step}: {flags}")
    lines.append(f"experiment: {experiment_dir(sweep)} (resume: stalwart sweep {sweep.path} "
                 f"--resume)")
    return "\n".join(lines)


def write_results(sweep: Sweep, rows: list[TrialRow]) -> Path:
    best = best_row(sweep, rows)
    out = experiment_dir(sweep) / RESULTS_FILE
    out.write_text(json.dumps({
        "metric": sweep.metric, "mode": sweep.mode,
        "best": best.__dict__ if best else None,
        "trials": [r.__dict__ for r in rows]}, indent=1, default=str))
    return out
