"""SWEEP.toml: what `stalwart sweep` accepts, and one clear error for everything it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from stalwart.integrations.tune.sweep_file import SweepError, load_sweep
from stalwart.integrations.tune.trainable import as_overrides
from tests.cli_helpers import REFERENCE_CONFIG

pytestmark = [pytest.mark.unit, pytest.mark.timeout(240)]  # loading a sweep imports its task (torch)

EXAMPLES = REFERENCE_CONFIG.parent
GOOD = f'''
config = "{REFERENCE_CONFIG}"
metric = "loss"
trials = 2
[search]
"train.lr" = {{ loguniform = [1e-4, 1e-2] }}
'''


def _sweep(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.toml"
    path.write_text(text)
    return path


def _refused(tmp_path: Path, text: str, *fragments: str) -> str:
    with pytest.raises(SweepError) as info:
        load_sweep(_sweep(tmp_path, text))
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.mark.parametrize("name", ["sweep_asha.toml", "sweep_pbt.toml"])
def test_the_examples_load(name: str) -> None:
    sweep = load_sweep(EXAMPLES / name)
    assert sweep.config == REFERENCE_CONFIG
    assert sweep.scheduler_type in ("asha", "pbt")
    assert sweep.make_scheduler() is not None and sweep.param_space()


def test_defaults_and_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "job.toml").write_text(REFERENCE_CONFIG.read_text())
    path = tmp_path / "jobs" / "lr.toml"
    path.write_text(GOOD.replace(f'"{REFERENCE_CONFIG}"', '"job.toml"'))
    sweep = load_sweep(path, ["train.steps=30"])
    assert sweep.config == tmp_path / "jobs" / "job.toml"
    assert (sweep.name, sweep.mode, sweep.trials, sweep.concurrency) == ("lr", "min", 2, None)
    assert sweep.job.train.steps == 30  # --set applies to every trial's job
    assert sweep.scheduler_type == "fifo"


def test_search_rules_become_tune_domains(tmp_path: Path) -> None:
    from ray import tune

    sweep = load_sweep(_sweep(tmp_path, GOOD + '''"task.args.d_model" = { choice = [64, 128] }
"train.warmup_steps" = { grid = [5, 10] }
"train.weight_decay" = 0.05
'''))
    space = sweep.param_space()
    assert isinstance(space["train.lr"], tune.search.sample.Float)
    assert space["task.args.d_model"].categories == [64, 128]
    assert space["train.warmup_steps"] == {"grid_search": [5, 10]}
    assert space["train.weight_decay"] == 0.05


def test_overrides_from_a_trial_config() -> None:
    assert as_overrides({"train.lr": 0.001, "task": {"args": {"d_model": 64}},
                         "run.name": "a b", "run.progress": False}) == [
        "train.lr=0.001", "task.args.d_model=64", 'run.name="a b"', "run.progress=false"]


@pytest.mark.parametrize(("rule", "fragment"), [
    ('{ lognormal = [1, 2] }', "is not a search rule"),
    ('{ uniform = [1] }', "uniform takes a list of 2 numbers"),
    ('{ uniform = [2, 1] }', "needs low < high"),
    ('{ loguniform = [0, 1] }', "needs low > 0"),
    ('{ randint = [1.5, 4] }', "randint takes integers"),
    ('{ choice = [] }', "a non-empty list of values"),
    ('{ uniform = ["a", "b"] }', "takes numbers"),
    ('{ randn = [0, -1] }', "standard deviation must be > 0"),
    ('{ uniform = [1, 2], choice = [1] }', "is not a search rule"),
])
def test_a_bad_search_rule_is_named(tmp_path: Path, rule: str, fragment: str) -> None:
    _refused(tmp_path, GOOD.replace("{ loguniform = [1e-4, 1e-2] }", rule),
             "[search] train.lr", fragment)


def test_a_search_key_or_value_the_config_refuses(tmp_path: Path) -> None:
    _refused(tmp_path, GOOD + '"train.lrate" = { choice = [1] }\n', "train.lrate")
    _refused(tmp_path, GOOD + '"train.steps" = { choice = [100, -5] }\n',
             "train.steps = -5", "train.steps")


@pytest.mark.parametrize(("metric", "fragment"), [
    ("tokens/s", "'tokens/s' is never reported by a stalwart run; use one of loss, val_loss"),
    ("window_s", "'window_s' is never reported"),
    ("val_", "'val_' is never reported"),
    (None, "None is never reported"),
])
def test_a_metric_no_run_reports(tmp_path: Path, metric: str | None, fragment: str) -> None:
    text = GOOD.replace('metric = "loss"', f'metric = "{metric}"' if metric else "")
    _refused(tmp_path, text, fragment)


def test_a_task_metric_is_a_sweep_metric(tmp_path: Path) -> None:
    """A name the task's loss may return is accepted: only the run can tell (the reporter
    names the run's columns if it never comes)."""
    for metric in ("accuracy", "val_accuracy"):
        text = GOOD.replace('metric = "loss"', f'metric = "{metric}"')
        assert load_sweep(_sweep(tmp_path, text)).metric == metric
    text = GOOD.replace('metric = "loss"', 'metric = "val_accuracy"\nset = ["data.val_every=0"]')
    _refused(tmp_path, text, "val_accuracy is never reported", "data.val_every = 0")


def test_val_loss_without_validation(tmp_path: Path) -> None:
    text = GOOD.replace('metric = "loss"', 'metric = "val_loss"\nset = ["data.val_every=0"]')
    _refused(tmp_path, text, "val_loss is never reported", "data.val_every = 0")


@pytest.mark.parametrize(("text", "fragments"), [
    ("", ("does not exist",)),
    ("config = ", ("is not valid TOML",)),
    ('metric = "loss"\n[search]\n"train.lr" = 1\n', ('config = "PATH"',)),
    ('trails = 3\n' + GOOD, ("unknown key 'trails'; did you mean trials? allowed: name, "
                             "config",)),
    (GOOD.replace("trials = 2", "trials = 0"), ("trials: must be >= 1",)),
    (GOOD.replace("trials = 2", "trials = 1.5"), ("1.5 is not allowed",)),
    (GOOD.replace('metric = "loss"', 'metric = "loss"\nmode = "lowest"'), ("min or max",)),
    (GOOD.split("[search]")[0], ("needs at least one key to search",)),
    (GOOD + '[scheduler]\ntype = "hyperband"\n', ("'hyperband' is not allowed: fifo, asha, pbt",)),
    (GOOD + '[scheduler]\ntype = "asha"\nmax_tt = 5\n', ("unknown key 'max_tt' for asha; "
                                                         "did you mean max_t? allowed:",)),
    (GOOD + '[scheduler]\ntype = "asha"\nreduction_factor = 1\n', ("an integer > 1",)),
    (GOOD + '[scheduler]\ntype = "pbt"\n', ("needs perturbation_interval",)),
    (GOOD + '[scheduler]\ntype = "pbt"\nperturbation_interval = 50\n',
     ("checkpoint.persist_every (50) must equal run.log_every (10)",)),
    (GOOD + '[scheduler]\ntype = "pbt"\nsynch = 1\n', ("synch: 1 is not allowed: true or false",)),
])
def test_bad_sweep_files(tmp_path: Path, text: str, fragments: tuple[str, ...]) -> None:
    if text == "":
        with pytest.raises(SweepError, match="does not exist"):
            load_sweep(tmp_path / "missing.toml")
        return
    _refused(tmp_path, text, *fragments)


PBT = GOOD.replace('trials = 2', 'trials = 2\nset = ["checkpoint.persist_every=10"]') + '''
[scheduler]
type = "pbt"
perturbation_interval = 20
'''


def test_pbt_needs_mutations_that_a_restore_can_take(tmp_path: Path) -> None:
    _refused(tmp_path, PBT, "needs [scheduler.mutations]")
    _refused(tmp_path, PBT + '[scheduler.mutations]\n"task.args.d_model" = { choice = [64] }\n',
             "mutations task.args.d_model", "cannot change task.")
    _refused(tmp_path, PBT + '[scheduler.mutations]\n"train.lr" = { uniform = [1, 0] }\n',
             "mutations train.lr", "needs low < high")
    sweep = load_sweep(_sweep(tmp_path, PBT + 'synch = true\n[scheduler.mutations]\n'
                                              '"train.lr" = { loguniform = [1e-4, 1e-2] }\n'))
    scheduler = sweep.make_scheduler()
    assert type(scheduler).__name__ == "PopulationBasedTraining" and scheduler._synch


def test_resume_restores_only_tune_state_this_user_owns(tmp_path: Path) -> None:
    """Tune's restore unpickles tuner.pkl, which runs code: a shared, writable or linked
    one is refused before Tune reads it."""
    from stalwart.core.errors import RunDirError
    from stalwart.integrations.tune.sweep import check_own_state

    exp = tmp_path / "exp"
    exp.mkdir()
    state = exp / "tuner.pkl"
    state.write_bytes(b"state")
    state.chmod(0o644)
    check_own_state(exp)
    state.chmod(0o666)
    with pytest.raises(RunDirError, match="tuner.pkl: it is writable by its group or by "
                                          "others"):
        check_own_state(exp)
    state.unlink()
    (tmp_path / "elsewhere.pkl").write_bytes(b"state")
    state.symlink_to(tmp_path / "elsewhere.pkl")
    with pytest.raises(RunDirError, match="is not a plain file"):
        check_own_state(exp)
