"""--auto-resume (run.auto_resume) decides from the run dir and its storage, before Ray starts:
resume this run's newest committed checkpoint, start a new run in a new or empty run dir, start
this run again from step 0 when it committed nothing yet, refuse another run's run dir.

Run dirs here are made as a run leaves them (config.toml, run_id, events.jsonl, a signed
committed checkpoint naming the run, owner.json); the trainer's own checks read them in the
order `fit` does, and the CLI is called in process where it must refuse before Ray.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from stalwart.checkpointing.storage.layout import step_dir_name
from stalwart.checkpointing.storage.owner import Owner, claim
from stalwart.checkpointing.storage.writer import write_manifest
from stalwart.cli.main import _parser, main
from stalwart.cli.run_options import run_config
from stalwart.core import events as ev
from stalwart.core.config import load_config
from stalwart.core.errors import ConfigError, RunDirError
from stalwart.run_dir import RunDir
from stalwart.trainer import Trainer
from tests.cli_helpers import REFERENCE_CONFIG, TINY
from tests.keys import signing_key

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _config(*overrides: str, auto: bool = True):
    return load_config(REFERENCE_CONFIG, [*TINY, "train.steps=30", *overrides,
                                          f"run.auto_resume={'true' if auto else 'false'}"])


def _left_by_a_run(run_dir: Path, *, commits: tuple[int, ...] = (), partial: tuple[int, ...] = (),
                   **overrides: str) -> str:
    """A run dir as a run leaves it; returns its run id."""
    config = _config(*(f"{k}={v}" for k, v in overrides.items()))
    rd = RunDir(run_dir)
    rd.write_config(config)
    run_id = uuid.uuid4().hex
    rd.run_id_file.write_text(run_id + "\n")
    storage = rd.storage_url(config)
    Path(storage).mkdir(parents=True)
    claim(storage, Owner(run_id=run_id, task=config.task.path, run_dir=str(run_dir.resolve())))
    rd.events.emit(ev.Started(world_size=2, steps=30, start_step=0, task=config.task.path))
    for step in (*commits, *partial):
        d = Path(storage) / step_dir_name(step)
        d.mkdir()
        for rank in range(2):
            (d / f"__{rank}_0.distcp").write_bytes(bytes([step, rank]) * 100)
        (d / ".metadata").write_bytes(b"metadata")
        if step in commits:
            write_manifest(storage, step, {"world_size": 2, "run_id": run_id},
                           key=signing_key())
            rd.events.emit(ev.CheckpointCommitted(step=step, path=str(d), save_s=0.1))
    return run_id


def _checks(trainer: Trainer):
    """What `fit` reads before it connects to Ray: (run id, checkpoint to resume from)."""
    storage = trainer.run_dir.storage_url(trainer.config)
    trust = trainer._trust()
    trainer._check_owner(storage, trust.run_id)
    resume_from, _, _ = trainer._check_run_dir(storage, trust)
    return trust.run_id, resume_from


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_a_new_run_dir_starts_a_new_run(tmp_path, capsys):
    run_id, resume_from = _checks(Trainer(_config(), run_dir=tmp_path / "new"))
    assert resume_from is None and len(run_id) == 32
    assert not (tmp_path / "new").exists()  # the checks write nothing
    assert "holds no run yet; starting a new one" in capsys.readouterr().out


def test_an_empty_run_dir_starts_a_new_run(tmp_path):
    (tmp_path / "empty").mkdir()
    _, resume_from = _checks(Trainer(_config(), run_dir=tmp_path / "empty"))
    assert resume_from is None and _tree(tmp_path) == {}


def test_its_own_run_dir_resumes_from_the_newest_committed_checkpoint(tmp_path, capsys):
    run_id = _left_by_a_run(tmp_path / "run", commits=(10, 20), partial=(30,))
    before = _tree(tmp_path)
    trainer = Trainer(_config("train.steps=60"), run_dir=tmp_path / "run")  # not identity
    kept, resume_from = _checks(trainer)
    assert kept == run_id and resume_from is not None and resume_from.step == 20
    assert "continuing" in capsys.readouterr().out and _tree(tmp_path) == before


def test_its_own_run_dir_with_no_commit_yet_starts_again_keeping_the_run(tmp_path, capsys):
    """A retried job that died before its first commit: the same run, from step 0."""
    run_id = _left_by_a_run(tmp_path / "run", partial=(10,))
    kept, resume_from = _checks(Trainer(_config(), run_dir=tmp_path / "run"))
    assert kept == run_id and resume_from is None
    assert "no committed checkpoint yet; starting it again from step 0" in (
        capsys.readouterr().out)
    # Without auto-resume the same run dir is refused, as before.
    with pytest.raises(RunDirError, match="--resume"):
        _checks(Trainer(_config(auto=False), run_dir=tmp_path / "run"))


def test_commits_the_storage_lost_are_not_started_over(tmp_path):
    _left_by_a_run(tmp_path / "run", commits=(10,))
    for d in (tmp_path / "run" / "checkpoints").glob("step_*"):
        (d / "manifest.json").unlink()
    with pytest.raises(RunDirError, match=r"records committed checkpoints \(newest step 10\) "
                                          r"but .* holds none"):
        _checks(Trainer(_config(), run_dir=tmp_path / "run"))


@pytest.mark.parametrize(("key", "value"), [("train.seed", "7"),
                                            ("task.args.d_model", "32"),
                                            ("train.global_batch_size", "16")])
def test_another_runs_run_dir_is_refused(tmp_path, key, value):
    _left_by_a_run(tmp_path / "run", commits=(10,))
    before = _tree(tmp_path)
    trainer = Trainer(_config(f"{key}={value}"), run_dir=tmp_path / "run")
    with pytest.raises(RunDirError, match=rf"^--auto-resume: run dir .*/run holds another run "
                                          rf"\({key.rsplit('.', 1)[0] if 'args' in key else key}"):
        _checks(trainer)
    assert _tree(tmp_path) == before


def test_checkpoints_with_no_run_beside_them_are_refused(tmp_path):
    storage = tmp_path / "shared"
    _left_by_a_run(tmp_path / "first", commits=(10,), **{"checkpoint.storage": f'"{storage}"'})
    config = _config(f'checkpoint.storage="{storage}"')
    with pytest.raises(RunDirError, match=r"holds checkpoints \(steps \[10\]\) but run dir "
                                          r".*/second holds no config.toml"):
        Trainer(config, run_dir=tmp_path / "second")._check_run_dir(str(storage), None)


def test_resume_is_strict_and_wins_over_the_config_key(tmp_path):
    (tmp_path / "empty").mkdir()
    trainer = Trainer(_config(), run_dir=tmp_path / "empty", resume=True)
    with pytest.raises(RunDirError, match="holds no config.toml, so no run to resume"):
        _checks(trainer)
    _left_by_a_run(tmp_path / "run", commits=(10,))
    with pytest.raises(ConfigError, match=r"^--resume: train.seed was"):
        _checks(Trainer(_config("train.seed=9"), run_dir=tmp_path / "run", resume=True))


def test_start_from_is_used_only_when_the_run_has_no_checkpoint_of_its_own(tmp_path):
    _left_by_a_run(tmp_path / "run", commits=(10,))
    trainer = Trainer(_config(), run_dir=tmp_path / "run", start_from=str(tmp_path / "nowhere"))
    _, resume_from = _checks(trainer)
    assert resume_from is not None and trainer._check_start_from(None) is None


# ---------------------------------------------------------------------------- the CLI


def test_the_flag_sets_the_config_key_and_excludes_resume(tmp_path, capsys):
    args = _parser().parse_args(["run", str(REFERENCE_CONFIG), "--run-dir", "r",
                                 "--auto-resume"])
    assert args.auto_resume and not args.resume and run_config(args).run.auto_resume
    for command in ("run", "submit"):
        with pytest.raises(SystemExit) as exit_:
            _parser().parse_args([command, "c.toml", "--run-dir", "r", "--auto-resume",
                                  "--resume"])
        assert exit_.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"stalwart: error: {command}: argument --resume: not "
                              f"allowed with argument --auto-resume") and "\n" not in err
    assert main(["run", str(REFERENCE_CONFIG), "--auto-resume"]) == 2
    assert capsys.readouterr().err == ("stalwart: error: --auto-resume needs --run-dir: the "
                                       "run directory to continue\n")


def test_another_runs_run_dir_is_refused_before_ray_with_one_line(tmp_path, capsys,
                                                                 monkeypatch):
    import ray

    _left_by_a_run(tmp_path / "run", commits=(10,))
    before = _tree(tmp_path)
    monkeypatch.chdir(tmp_path)
    code = main(["run", str(REFERENCE_CONFIG), *(a for o in TINY for a in ("--set", o)),
                 "--set", "train.steps=30", "--set", "train.seed=5", "--run-dir", "run",
                 "--auto-resume"])
    err = capsys.readouterr().err
    assert code == 2 and not ray.is_initialized()
    assert err.startswith("stalwart: error: --auto-resume: run dir run holds another run "
                          "(train.seed was 0 in run/config.toml and is 5 now") and (
        err.count("\n") == 1)
    assert _tree(tmp_path) == before


def test_the_newest_recorded_commit_follows_the_runs_timeline(tmp_path: Path) -> None:
    """A resume allowed to roll back starts the timeline again at its step: the commits
    it left behind no longer count."""
    from stalwart.core import events as ev
    from stalwart.run_dir import RunDir

    rd = RunDir(tmp_path)
    assert rd.newest_recorded_commit() is None

    def commit(step: int) -> ev.Event:
        return ev.CheckpointCommitted(step=step, path=f"p{step}", save_s=0.1)

    for e in (commit(10), commit(30), ev.Resumed(from_step=10, path="p10"), commit(20)):
        rd.events.emit(e)
    assert rd.newest_recorded_commit() == 20
