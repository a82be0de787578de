"""A run dir that already holds a run is refused in the words of what the user typed: the run
dir and --resume, not checkpoint.storage (which they never set).

Run dirs here are made as a run leaves them (config.toml, run_id, owner.json, a signed
committed checkpoint); the trainer's checks read them in the order `fit` does, and the CLI is
called in process, where it must refuse before Ray starts.
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path

import pytest

from stalwart.checkpointing.storage.layout import step_dir_name
from stalwart.checkpointing.storage.owner import Owner, claim
from stalwart.checkpointing.storage.writer import write_manifest
from stalwart.cli.main import main
from stalwart.core.config import load_config
from stalwart.core.errors import RunDirError
from stalwart.run_dir import RunDir
from stalwart.trainer import Trainer
from tests.cli_helpers import REFERENCE_CONFIG, TINY
from tests.keys import signing_key

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

OVERRIDES = [*TINY, "train.steps=30"]


def _left_by_a_run(run_dir: Path, *, commit: int = 10) -> str:
    """A run dir as a run of the reference config leaves it; returns its run id."""
    config = load_config(REFERENCE_CONFIG, OVERRIDES)
    rd = RunDir(run_dir)
    rd.write_config(config)
    run_id = uuid.uuid4().hex
    rd.run_id_file.write_text(run_id + "\n")
    storage = Path(rd.storage_url(config))
    storage.mkdir(parents=True)
    claim(str(storage), Owner(run_id=run_id, task=config.task.path,
                              run_dir=str(run_dir.resolve())))
    step = storage / step_dir_name(commit)
    step.mkdir()
    (step / "__0_0.distcp").write_bytes(b"weights")
    (step / ".metadata").write_bytes(b"metadata")
    write_manifest(str(storage), commit, {"world_size": 1, "run_id": run_id},
                   key=signing_key())
    return run_id


def _checks(trainer: Trainer) -> None:
    """What `fit` reads before it connects to Ray, in its order."""
    storage = trainer.run_dir.storage_url(trainer.config)
    trust = trainer._trust()
    trainer._check_owner(storage, trust.run_id)
    trainer._check_run_dir(storage, trust)


def _fresh(run_dir: Path, *extra: str) -> Trainer:
    return Trainer(load_config(REFERENCE_CONFIG, [*OVERRIDES, *extra]), run_dir=run_dir)


def test_a_fresh_run_into_a_finished_runs_dir_is_told_to_resume_it(tmp_path: Path) -> None:
    _left_by_a_run(tmp_path / "run")
    with pytest.raises(RunDirError) as info:
        _checks(_fresh(tmp_path / "run"))
    message = str(info.value)
    assert "already holds checkpoints (steps [10]); pass --resume to continue that run, or " \
           "choose another --run-dir" in message
    assert "checkpoint.storage" not in message


def test_the_cli_refuses_it_in_one_line_before_ray(tmp_path: Path, capsys,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    _left_by_a_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    code = main(["run", str(REFERENCE_CONFIG), *(a for o in OVERRIDES for a in ("--set", o)),
                 "--run-dir", "run"])
    err = capsys.readouterr().err
    assert code == 2 and not ray.is_initialized() and err.count("\n") == 1
    assert err.startswith("stalwart: error: ") and "pass --resume" in err
    assert "--run-dir" in err and "checkpoint.storage" not in err


def test_checkpoints_moved_from_another_run_dir_name_that_run_dir(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """A copied run dir whose config.toml is gone: its checkpoints say whose they are."""
    monkeypatch.chdir(tmp_path)
    _left_by_a_run(tmp_path / "first")
    shutil.copytree(tmp_path / "first" / "checkpoints", tmp_path / "copy" / "checkpoints")
    with pytest.raises(RunDirError, match=r"^run dir .*copy holds the checkpoints of the run "
                                          r"in run dir first \(task .*\); continue that run "
                                          r"with --resume --run-dir first, or choose another "
                                          r"--run-dir$"):
        _checks(_fresh(tmp_path / "copy"))


def test_checkpoints_with_no_config_beside_them_name_only_the_run_dir(tmp_path: Path) -> None:
    _left_by_a_run(tmp_path / "run")
    (tmp_path / "run" / "config.toml").unlink()
    (tmp_path / "run" / "run_id").unlink()
    with pytest.raises(RunDirError, match=r"holds another run's checkpoints \(task .*\) and no "
                                          r"config.toml, so that run cannot be continued; "
                                          r"choose another --run-dir$"):
        _checks(_fresh(tmp_path / "run"))
    auto = _fresh(tmp_path / "run", "run.auto_resume=true")
    rd = auto.run_dir
    with pytest.raises(RunDirError, match=r"nothing says which run they are; choose another "
                                          r"--run-dir$"):
        rd.auto_resume_mode(rd.storage_url(auto.config))


def test_a_set_checkpoint_storage_is_named_as_the_config_key(tmp_path: Path) -> None:
    storage = tmp_path / "shared"
    storage.mkdir()
    other = Owner(run_id="0123", task="t:T", run_dir="/elsewhere/runs/first")
    claim(str(storage), other)
    me = Owner(run_id="4567", task="t:T", run_dir=str(tmp_path / "second"))
    with pytest.raises(RunDirError, match=r"^checkpoint.storage .*shared belongs to another "
                                          r"run \(run dir /elsewhere/runs/first, task t:T\)"):
        RunDir(tmp_path / "second").check_owner(str(storage), me, other)
