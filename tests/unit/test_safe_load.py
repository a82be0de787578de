"""Loading a DCP checkpoint runs no code from it and loads only signed bytes: every file
checked against the manifest as it is read, `.metadata` through a restricted unpickler,
byte items as data only."""

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


def _files(path: Path) -> dict:
    """The manifest's file table for the files in `path`, as they are now."""
    return {f.name: {"size": f.stat().st_size,
                     "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}
            for f in path.iterdir()}


def _empty_state() -> dict:
    return {"model": {"w": torch.zeros(3, 4), "b": torch.zeros(4)},
            "train": {"step": 0, "lr": 0.0, "names": []}}


def _load(path: Path, files: dict, state: dict | None = None) -> dict:
    state = state if state is not None else _empty_state()
    dcp.load(state, storage_reader=VerifiedReader(str(path), files=files),
             planner=SafeLoadPlanner(), no_dist=True)
    return state


def test_a_real_checkpoint_loads_through_the_safe_reader(tmp_path: Path) -> None:
    saved = _checkpoint(tmp_path / "ck")
    state = _load(tmp_path / "ck", _files(tmp_path / "ck"))
    assert torch.equal(state["model"]["w"], saved["model"]["w"])
    assert state["train"] == saved["train"]


def test_shards_zeroed_after_the_check_are_never_loaded(tmp_path: Path) -> None:
    """The attack: the driver verified the checkpoint, then storage zeroes its shards
    before the workers read them. Each worker checks what it reads; nothing loads."""
    ck = tmp_path / "ck"
    _checkpoint(ck)
    files = _files(ck)  # what the driver verified
    for shard in ck.glob("*.distcp"):
        shard.write_bytes(bytes(shard.stat().st_size))
    state = _empty_state()
    with pytest.raises(BaseException, match="__0_0.distcp is damaged: its size or sha256 "
                                            "differs from the signed manifest"):
        _load(ck, files, state)
    assert not state["model"]["b"].any()  # nothing of the zeroed shard reached the model


def test_a_file_the_manifest_does_not_list_is_never_read(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    _checkpoint(ck)
    files = _files(ck)
    del files["__0_0.distcp"]
    with pytest.raises(BaseException, match="'__0_0.distcp', which is not one of the "
                                            "checkpoint's data files"):
        _load(ck, files)


def test_metadata_pointing_outside_the_step_directory_is_refused(tmp_path: Path) -> None:
    """`.metadata` names where each item is stored; a crafted one points at a file in
    another step (or past a file's end), which no signature covers."""
    for other_step in (tmp_path / "step_a", tmp_path / "step_b"):
        _checkpoint(other_step)
    ck = tmp_path / "step_b"
    metadata = load_metadata((ck / ".metadata").read_bytes(), "x")
    for info in metadata.storage_data.values():
        info.relative_path = "../step_a/__0_0.distcp"
    (ck / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="not one of the checkpoint's data files"):
        VerifiedReader(str(ck), files=_files(ck)).read_metadata()
    for info in metadata.storage_data.values():
        info.relative_path, info.length = "__0_0.distcp", 1 << 40
    (ck / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="which holds"):
        VerifiedReader(str(ck), files=_files(ck)).read_metadata()


def test_a_metadata_pickle_with_a_payload_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    with pytest.raises(CheckpointError, match="not DCP metadata.*not part of"):
        load_metadata(pickle.dumps(Payload(marker)), "checkpoint x")
    with pytest.raises(CheckpointError, match="holds a list"):
        load_metadata(pickle.dumps([1, 2]), "checkpoint x")
    assert not marker.exists()


def test_a_metadata_that_changed_after_verification_is_not_unpickled(tmp_path: Path) -> None:
    _checkpoint(tmp_path / "ck")
    files = _files(tmp_path / "ck")
    marker = tmp_path / "pwned"
    (tmp_path / "ck/.metadata").write_bytes(pickle.dumps(Payload(marker)))
    reader = VerifiedReader(str(tmp_path / "ck"), files=files)
    with pytest.raises(CheckpointError, match="differs from the signed manifest"):
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
