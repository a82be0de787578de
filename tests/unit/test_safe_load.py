"""Loading a DCP checkpoint runs no code from it: `.metadata` through a restricted
unpickler once its sha256 matches, byte items as data only."""

from __future__ import annotations

import hashlib
import io
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.safe_load import SafeLoadPlanner, VerifiedReader, load_metadata

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]


class Payload:
    """A pickle that creates a marker file when it is loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def _checkpoint(path: Path) -> dict:
    state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(4)},
             "train": {"step": 7, "lr": 0.5, "names": ["a", "b"]}}
    dcp.save(state, storage_writer=FsspecWriter(str(path)), no_dist=True)
    return state


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_real_checkpoint_loads_through_the_safe_reader(tmp_path: Path) -> None:
    saved = _checkpoint(tmp_path / "ck")
    state = {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)},
             "train": {"step": 0, "lr": 0.0, "names": []}}
    reader = VerifiedReader(str(tmp_path / "ck"), metadata_sha256=_sha(tmp_path / "ck/.metadata"))
    dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=True)
    assert torch.equal(state["model"]["w"], saved["model"]["w"])
    assert state["train"] == saved["train"]


def test_a_metadata_pickle_with_a_payload_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(CheckpointError, match="not DCP metadata.*not part of"):
        load_metadata(pickle.dumps(Payload(marker)), "checkpoint x")
    with pytest.raises(CheckpointError, match="holds a list"):
        load_metadata(pickle.dumps([1, 2]), "checkpoint x")
    assert not marker.exists()


def test_a_metadata_that_changed_after_verification_is_not_unpickled(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ck")
    expected = _sha(tmp_path / "ck/.metadata")
    marker = tmp_path / "pwned"
    (tmp_path / "ck/.metadata").write_bytes(pickle.dumps(Payload(marker)))
    reader = VerifiedReader(str(tmp_path / "ck"), metadata_sha256=expected)
    with pytest.raises(CheckpointError, match="differs from the manifest"):
        reader.read_metadata()
    assert not marker.exists()


def test_a_byte_item_loads_as_data_only(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    planner = SafeLoadPlanner()
    planner.set_up_planner({"x": 1}, metadata=None, is_coordinator=True)
    with pytest.raises(pickle.UnpicklingError):
        buf = io.BytesIO()
        torch.save(Payload(marker), buf)
        buf.seek(0)
        planner.load_bytes(_read_item("x"), buf)
    assert not marker.exists()


def test_numpy_scalars_in_a_schedule_still_load(tmp_path: Path) -> None:
    import numpy as np

    planner = SafeLoadPlanner()
    state = {"x": None}
    planner.set_up_planner(state, metadata=None, is_coordinator=True)
    buf = io.BytesIO()
    torch.save({"last_lr": [np.float64(0.5)], "steps": np.int64(3)}, buf)
    buf.seek(0)
    planner.load_bytes(_read_item("x"), buf)
    assert state["x"] == {"last_lr": [0.5], "steps": 3}


def _read_item(fqn: str):
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    index = MetadataIndex(fqn)
    return ReadItem(type=LoadItemType.BYTE_IO, dest_index=index, dest_offsets=torch.Size([0]),
                    storage_index=index, storage_offsets=torch.Size([0]),
                    lengths=torch.Size([0]))
