"""One storage, one run: a run is refused, before Ray or any worker starts, when its
checkpoint.storage belongs to another run (a fresh run pointed at it, or a --resume that
changes checkpoint.storage to it)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from stalwart.checkpointing.storage.layout import step_dir_name
from stalwart.checkpointing.storage.owner import OWNER, Owner, claim, read_owner
from stalwart.checkpointing.storage.writer import write_manifest
from stalwart.core.config import dump_config, load_config
from stalwart.core.task import build_task
from tests.cli_helpers import REFERENCE_CONFIG, TINY, sets, stalwart
from tests.keys import signing_key

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

OTHER = Owner(run_id="0123456789abcdef", task="examples.gpt.task:GPTTask",
              run_dir="/somewhere/runs/first")


def _checkpoint(storage: Path, step: int) -> None:
    """A real, committed DCP checkpoint of the reference model (what a resume needs)."""
    config = load_config(REFERENCE_CONFIG, TINY)
    model = build_task(config.task.path, config.task.args).build_model(config)
    dcp.save({"model": model.state_dict()}, no_dist=True,
             storage_writer=FsspecWriter(str(storage / step_dir_name(step))))
    write_manifest(str(storage), step, {"world_size": 1}, ranks=1, key=signing_key())


def _refused(proc, storage: Path) -> None:
    (line,) = proc.stderr.strip().splitlines()
    assert line == (f"stalwart: error: checkpoint.storage {storage} belongs to another run "
                    f"(run dir {OTHER.run_dir}, task {OTHER.task}); one storage holds one "
                    f"run's checkpoints: --resume that run, or choose another "
                    f"checkpoint.storage")


def test_a_new_run_on_another_runs_storage_is_refused(tmp_path: Path) -> None:
    """The other run has not committed yet (no step directory): only its owner record
    tells that the storage is taken."""
    storage = tmp_path / "shared"
    storage.mkdir()
    claim(str(storage), OTHER)
    shutil.copy(REFERENCE_CONFIG, tmp_path / "config.toml")
    proc = stalwart("run", "config.toml", "--run-dir", "second",
                    *sets(*TINY, "train.steps=4", "train.warmup_steps=1",
                          f'checkpoint.storage="{storage}"'),
                    cwd=tmp_path, check=2)
    _refused(proc, storage)
    assert not (tmp_path / "second").exists()  # nothing written, no worker started
    assert read_owner(str(storage)) == OTHER and sorted(p.name for p in storage.iterdir()) == [
        OWNER]


def test_resume_onto_another_runs_storage_is_refused(tmp_path: Path) -> None:
    storage = tmp_path / "first-checkpoints"
    storage.mkdir()
    claim(str(storage), OTHER)
    _checkpoint(storage, 2)
    run = tmp_path / "second"
    run.mkdir()
    config = load_config(REFERENCE_CONFIG, [*TINY, "train.steps=4", "train.warmup_steps=1"])
    (run / "config.toml").write_text(dump_config(config))
    (run / "run_id").write_text("fedcba9876543210\n")
    shutil.copy(REFERENCE_CONFIG, tmp_path / "config.toml")
    before = sorted(p.name for p in run.iterdir())
    proc = stalwart("run", "config.toml", "--run-dir", "second", "--resume",
                    *sets(*TINY, "train.steps=4", "train.warmup_steps=1",
                          f'checkpoint.storage="{storage}"'),
                    cwd=tmp_path, check=2)
    _refused(proc, storage)
    assert sorted(p.name for p in run.iterdir()) == before
    assert sorted(p.name for p in storage.iterdir()) == [OWNER, step_dir_name(2)]


def test_claiming_is_exclusive_and_idempotent(tmp_path: Path) -> None:
    mine = Owner(run_id="mine", task="t", run_dir="/r")
    assert read_owner(str(tmp_path)) is None
    assert claim(str(tmp_path), mine) == mine
    assert claim(str(tmp_path), OTHER) == mine  # taken: the owner stays
    assert claim(str(tmp_path), mine) == mine
