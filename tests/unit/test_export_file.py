"""`stalwart export RUN_DIR --out FILE`: one file a user loads as docs/cli.md shows, with the
mode any new file gets (not mkstemp's private 0600), from a real signed DCP checkpoint of the
reference GPT (tied embedding and head)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from stalwart.checkpointing.storage.export import export_newest
from stalwart.checkpointing.storage.export_hf import write_hf
from stalwart.checkpointing.storage.layout import step_dir_name
from stalwart.checkpointing.storage.writer import write_manifest
from stalwart.core.config import load_config
from stalwart.core.task import build_task
from tests.cli_helpers import REFERENCE_CONFIG, TINY
from tests.keys import signing_key, trust

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _model() -> torch.nn.Module:
    config = load_config(REFERENCE_CONFIG, TINY)
    return build_task(config.task.path, config.task.args).build_model(config)


@pytest.fixture
def storage(tmp_path: Path) -> tuple[Path, torch.nn.Module]:
    """A committed checkpoint of a trained-looking model (its weights moved off init)."""
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    root = tmp_path / "checkpoints"
    dcp.save({"model": model.state_dict()}, no_dist=True,
             storage_writer=FsspecWriter(str(root / step_dir_name(4))))
    write_manifest(str(root), 4, {"world_size": 1}, ranks=1, key=signing_key())
    return root, model


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _export(root: Path, out: Path) -> Path:
    _, path = export_newest(str(root), None, out, trust=trust(), on_skip=print)
    return path


def test_a_safetensors_export_loads_into_the_model_and_is_an_ordinary_file(
        tmp_path: Path, storage, umask_022) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    root, trained = storage
    path = _export(root, tmp_path / "model.safetensors")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    fresh = _model()
    fresh.load_state_dict(load_file(str(path)))  # as docs/cli.md shows it; strict
    for name, tensor in trained.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], tensor), name
    with safe_open(str(path), "pt") as f:
        assert f.metadata()["step"] == "4"


def test_a_torch_export_loads_with_the_safe_loader(tmp_path: Path, storage, umask_022) -> None:
    root, trained = storage
    path = _export(root, tmp_path / "model.pt")
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    fresh = _model()
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in trained.state_dict().items())


def test_the_mode_follows_the_umask(tmp_path: Path, storage) -> None:
    old = os.umask(0o077)
    try:
        path = _export(storage[0], tmp_path / "private.safetensors")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_hugging_face_directory_is_ordinary_too(tmp_path: Path, storage, umask_022) -> None:
    from stalwart.checkpointing.storage.catalog import find_step

    out = write_hf(find_step(str(storage[0]), 4, trust()), {"a": torch.ones(1)},
                   tmp_path / "hf", max_shard_bytes=10**9, files={"config.json": b"{}"})
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {0o644}
