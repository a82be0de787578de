"""The Hugging Face exporter's parts: sizes, shards, tied weights stored once, and a model
directory written from a real signed DCP checkpoint whose export files it carries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from stalwart.checkpointing.errors import CheckpointError
from stalwart.checkpointing.storage.catalog import find_step
from stalwart.checkpointing.storage.export import export_newest
from stalwart.checkpointing.storage.export_hf import (
    INDEX,
    SINGLE,
    check_out_dir,
    parse_size,
    shard,
    untied,
    write_hf,
)
from stalwart.checkpointing.storage.layout import step_dir_name
from stalwart.checkpointing.storage.writer import write_manifest
from tests.keys import signing_key, trust

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@pytest.mark.parametrize(("text", "size"), [("5GB", 5 * 10**9), ("500MB", 5 * 10**8),
                                            ("2GiB", 2 * 2**30), ("1000", 1000),
                                            ("1.5kb", 1500)])
def test_sizes(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "5XB", "-1GB", "0", "GB", "five"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="is not a size: a positive number"):
        parse_size(text)


def test_shards_hold_whole_tensors_in_order() -> None:
    w = {f"t{i}": torch.zeros(n) for i, n in enumerate([10, 10, 30, 5, 5])}  # float32: 4 B
    parts = shard(w, max_bytes=80)
    assert [list(p) for p in parts] == [["t0", "t1"], ["t2"], ["t3", "t4"]]  # t2 alone: 120 B
    assert shard(w, max_bytes=10**6) == [w]


def test_a_tied_group_is_stored_under_its_first_name() -> None:
    w = {"embed.weight": torch.ones(2), "head.weight": torch.ones(2), "bias": torch.zeros(2),
         "other_bias": torch.zeros(2)}  # equal, but not tied: both stay
    assert list(untied(w, [["embed.weight", "head.weight"]])) == ["embed.weight", "bias",
                                                                  "other_bias"]


def _checkpoint(storage: Path, step: int, export: dict[str, bytes], tied: list) -> None:
    model = {"model.embed.weight": torch.arange(6.0).reshape(3, 2),
             "lm_head.weight": torch.arange(6.0).reshape(3, 2), "norm.weight": torch.ones(2)}
    step_dir = storage / step_dir_name(step)
    dcp.save({"model": model}, storage_writer=FsspecWriter(str(step_dir)), no_dist=True)
    for name, data in export.items():
        (step_dir / f"export.{name}").write_bytes(data)
    write_manifest(str(storage), step, {"world_size": 1, "tied": tied, "task": "t:T"},
                   ranks=1, key=signing_key())


def test_a_model_directory_from_a_signed_checkpoint(tmp_path: Path) -> None:
    storage = tmp_path / "checkpoints"
    config = json.dumps({"model_type": "llama"}).encode()
    _checkpoint(storage, 7, {"config.json": config, "tokenizer.json": b"{}"},
                [["model.embed.weight", "lm_head.weight"]])
    out = tmp_path / "hf"
    info, path = export_newest(str(storage), None, out, trust=trust(), on_skip=print,
                               write=lambda c, w, o: write_hf(c, w, o, max_shard_bytes=16),
                               check=check_out_dir)
    assert info.step == 7 and path == out
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        INDEX, "tokenizer.json"]
    assert (out / "config.json").read_bytes() == config
    index = json.loads((out / INDEX).read_text())
    assert index["weight_map"] == {"model.embed.weight": "model-00001-of-00002.safetensors",
                                   "norm.weight": "model-00002-of-00002.safetensors"}
    assert index["metadata"]["total_size"] == 6 * 4 + 2 * 4
    from safetensors.torch import load_file

    first = load_file(str(out / "model-00001-of-00002.safetensors"))
    assert torch.equal(first["model.embed.weight"], torch.arange(6.0).reshape(3, 2))
    # Unsharded by default, and an existing directory is never touched.
    out2 = tmp_path / "hf2"
    write_hf(find_step(str(storage), 7, trust()), {"a": torch.ones(1)}, out2,
             max_shard_bytes=10**9)
    assert (out2 / SINGLE).exists() and not (out2 / INDEX).exists()
    with pytest.raises(CheckpointError, match="already exists; refusing to overwrite it"):
        write_hf(find_step(str(storage), 7, trust()), {"a": torch.ones(1)}, out2,
                 max_shard_bytes=10**9)


def test_a_checkpoint_of_no_hugging_face_model_is_refused_by_name(tmp_path: Path) -> None:
    storage = tmp_path / "checkpoints"
    _checkpoint(storage, 3, {}, [])
    with pytest.raises(CheckpointError, match=r"step 3 has no Hugging Face config.json: its "
                                              r"task \(t:T\) returns none from export_files"):
        write_hf(find_step(str(storage), 3, trust()), {}, tmp_path / "hf",
                 max_shard_bytes=10**9)
    assert not (tmp_path / "hf").exists()
