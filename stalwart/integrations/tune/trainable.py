"""stalwart.integrations.tune.trainable: a stalwart job as a Ray Tune function trainable.

    from ray import tune
    from stalwart.integrations.tune import trainable

    tuner = tune.Tuner(
        trainable("examples/gpt/config.toml", ["train.steps=200"], metric="loss"),
        param_space={"train.lr": tune.loguniform(1e-4, 1e-2),
                     "task.args.d_model": tune.choice([64, 128])},
        tune_config=tune.TuneConfig(metric="loss", mode="min", num_samples=4,
                                    max_concurrent_trials=2))

Each trial is a whole stalwart run: its own worker actors, its own failure detection and
recovery, its own run directory (under the trial's directory). Tune's `param_space` keys are
config keys, applied like `--set` on top of the config file. The run reports every logged
step to Tune and registers each committed checkpoint; a trial that Tune starts from a
checkpoint (Population Based Training's exploit, or `Tuner.restore`) continues from it with
its own hyperparameters.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext, redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

from stalwart.core.config import apply_overrides, config_from_dict, read_toml
from stalwart.core.ray_private import tune_trial_storage

# A trial's own actor only drives the run (its workers ask for their CPUs themselves): it
# holds no CPU, so that a trial's workers can use every CPU the trial accounts for. Tune needs
# some resource per trial, so the driver asks for a little memory.
TRIAL_DRIVER_RESOURCES = {"CPU": 0, "memory": 256 * 2**20}


def as_overrides(params: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Tune's config for a trial as `--set` overrides: keys are dotted config keys, or nested
    dicts of them; values become TOML (JSON scalars and arrays are valid TOML)."""
    out: list[str] = []
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.extend(as_overrides(value, name + "."))
        else:
            out.append(f"{name}={json.dumps(value)}")
    return out


def _trial_dir() -> Path:
    """Where a trial's run directories go: the trial's directory in Tune's storage when that is
    a filesystem of this machine (so they are where the user looks, as they are written, and
    are not copied again by Tune's artifact sync); else Tune's local trial directory, which
    Tune syncs to its storage."""
    import pyarrow.fs
    from ray import tune

    storage = tune_trial_storage()
    if storage is not None and isinstance(storage[0], pyarrow.fs.LocalFileSystem):
        return Path(storage[1])
    return Path(tune.get_context().get_trial_dir())


OUTPUT_LOG = "output.log"
"""A quiet trial's output, in its trial directory (appended to by each of its runs)."""


@contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """This trial's prints and Ray Train's notes into `path` while it lasts. The trial's
    process is its own, so the whole process's streams are redirected; Ray forwards only
    what reaches the real ones to the sweep's terminal."""
    train_logger = logging.getLogger("ray.train")
    level = train_logger.level
    train_logger.setLevel(logging.WARNING)  # "Checkpoint successfully created at: ..."
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with path.open("a") as out, redirect_stdout(out), redirect_stderr(out):
            yield
    finally:
        train_logger.setLevel(level)


def _next_run_dir(trial_dir: Path) -> Path:
    """Each start of a trial (a PBT exploit, a Tune restore) is a new stalwart run."""
    n = 0
    while (trial_dir / f"run-{n}").exists():
        n += 1
    return trial_dir / f"run-{n}"


def trainable(config: str | Path, overrides: Sequence[str] = (), *, metric: str | None = None,
              with_checkpoints: bool = False, workdir: str | Path | None = None,
              key_file: str | Path | None = None, trusted_key_files: Sequence[str | Path] = (),
              quiet: bool = False) -> Callable[[dict[str, Any]], None]:
    """A Tune function trainable running `config` (+ `overrides`) as one stalwart run per trial.

    `metric`: Tune's metric; reports wait for it (val_loss exists only from the first
    validation on). `with_checkpoints`: each report at a checkpoint step waits for its
    checkpoint and carries it (Population Based Training needs that; see TuneReporter). Its
    runs keep every checkpoint (checkpoint.keep_last = 0): retention on the workers could
    otherwise delete one before the driver hands it to Tune, and that report would go
    without.
    `workdir`: where the task's modules are imported from (default: the current directory,
    as for `stalwart run`). The config is checked here, before Tune starts.
    `key_file`, `trusted_key_files`: the checkpoint keys, as for Trainer; each is a path on
    the node a trial runs on.
    `quiet`: a trial's own output (its progress lines, Tune's notes on its checkpoints) goes
    to `output.log` in its trial directory, not to the sweep's terminal.
    """
    # The file is read here, once: trials on other machines get its contents, not its path.
    data = read_toml(config)
    base = list(overrides)
    config_from_dict(apply_overrides(data, base))  # bad input fails now, not in every trial
    code_dir = str(Path(workdir).resolve()) if workdir else str(Path.cwd())

    def stalwart_trial(params: dict[str, Any]) -> None:
        from ray import tune

        from stalwart.integrations.tune.reporter import TuneReporter
        from stalwart.trainer import Trainer

        if code_dir not in sys.path:  # Tune runs a trial in its own directory
            sys.path.insert(0, code_dir)
        keep_all = ["checkpoint.keep_last=0"] if with_checkpoints else []
        job = config_from_dict(apply_overrides(data, [*base, *as_overrides(params), *keep_all]))
        run_dir = _next_run_dir(_trial_dir())
        checkpoint = tune.get_checkpoint()
        reporter = TuneReporter(run_dir / ".tune-staging", metric,
                                with_checkpoints=with_checkpoints, final_step=job.train.steps)
        with (_output_to(run_dir.parent / OUTPUT_LOG) if quiet else nullcontext(),
              checkpoint.as_directory() if checkpoint else nullcontext(None) as start_from):
            result = Trainer(job, run_dir=run_dir, start_from=start_from, workdir=code_dir,
                             live_progress=False, callbacks=[reporter], key_file=key_file,
                             trusted_key_files=trusted_key_files).fit()
        if result.state != "FINISHED":
            raise RuntimeError(f"stalwart run {result.state} at step {result.step}: "
                               f"{result.reason} (run dir {result.run_dir})")

    return stalwart_trial
