"""A checkpoint saved before a key of the training state existed still loads: the key keeps
the loader's own (fresh) value, and everything else comes from the checkpoint."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from stalwart.checkpointing.storage.catalog import read_checkpoint, verify
from stalwart.checkpointing.storage.writer import StorageCheckpointer
from tests.keys import trust

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def saved(url: str, state: dict) -> tuple[str, dict]:
    ckpt = StorageCheckpointer(url, rank=0, keep_last=0, async_save=False,
                               manifest_extra={"world_size": 1}, trust=trust())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ckpt.save(6, state)
        ckpt.close()
    info = verify(read_checkpoint(url, 6), trust())
    return info.path, info.manifest["files"]


def load(url: str, path: str, files: dict, state: dict) -> dict:
    ckpt = StorageCheckpointer(url, rank=0, keep_last=0, async_save=False,
                               manifest_extra={"world_size": 1}, trust=trust())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ckpt.load(path, files, state)
        ckpt.close()
    return state


def test_a_checkpoint_without_the_numerics_state_loads_the_rest(tmp_path: Path) -> None:
    url = str(tmp_path / "checkpoints")
    w = torch.randn(4)
    path, files = saved(url, {"model": {"w": w}, "train": {"step": 6, "samples_seen": 48}})
    state = load(url, path, files, {"model": {"w": torch.zeros(4)},
                                    "train": {"step": 0, "samples_seen": 0,
                                              "numerics": '{"skipped": [3]}'}})
    assert torch.equal(state["model"]["w"], w)
    assert state["train"] == {"step": 6, "samples_seen": 48}  # numerics: the engine's fresh


def test_a_checkpoint_with_it_loads_it(tmp_path: Path) -> None:
    url = str(tmp_path / "checkpoints")
    kept = '{"skipped": [3], "losses": [], "accepted": 5}'
    path, files = saved(url, {"model": {"w": torch.randn(4)},
                              "train": {"step": 6, "samples_seen": 48, "numerics": kept}})
    state = load(url, path, files, {"model": {"w": torch.zeros(4)},
                                    "train": {"step": 0, "samples_seen": 0, "numerics": ""}})
    assert state["train"]["numerics"] == kept


def test_any_other_missing_key_is_still_refused(tmp_path: Path) -> None:
    from stalwart.checkpointing.errors import CheckpointError

    url = str(tmp_path / "checkpoints")
    path, files = saved(url, {"model": {"w": torch.randn(4)}, "train": {"step": 6}})
    with pytest.raises(CheckpointError):
        load(url, path, files, {"model": {"w": torch.zeros(4), "b": torch.zeros(2)},
                                "train": {"step": 0}})
