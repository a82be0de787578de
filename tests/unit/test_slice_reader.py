"""The slice reader gives DCP exactly the bytes of each requested slice: rows read straight
into the shard, columns and other dtypes through safetensors, and a damaged file refused."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from stalwart.core.errors import TaskError
from stalwart.tasks.slice_reader import _read_file

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


@dataclass
class Index:
    fqn: str


@dataclass
class Request:
    storage_index: Index
    storage_offsets: tuple[int, ...]
    lengths: tuple[int, ...]


class Planner:
    """DCP's side of a read: where each request lands, and what was committed."""

    def __init__(self, dests: dict[str, torch.Tensor]) -> None:
        self.dests, self.committed = dests, []

    def resolve_tensor(self, req: Request) -> torch.Tensor:
        return self.dests[req.storage_index.fqn]

    def commit_tensor(self, req: Request, tensor: torch.Tensor) -> None:
        self.committed.append(req.storage_index.fqn)


def weights(tmp_path: Path, dtype: torch.dtype = torch.float32) -> tuple[Path, dict]:
    tensors = {"a": torch.arange(48, dtype=torch.float32).reshape(6, 8).to(dtype),
               "b": torch.linspace(-1, 1, 10).to(dtype)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def test_rows_columns_and_a_whole_tensor_are_read_exactly(tmp_path):
    path, full = weights(tmp_path)
    dests = {"a": torch.empty(2, 8), "b": torch.empty(10), "c": torch.empty(6, 3)}
    requests = [Request(Index("a"), (3, 0), (2, 8)), Request(Index("b"), (0,), (10,))]
    planner = Planner(dests)
    _read_file(str(path), requests, planner)
    assert torch.equal(dests["a"], full["a"][3:5]) and torch.equal(dests["b"], full["b"])
    columns = Planner({"a": torch.empty(6, 3)})
    _read_file(str(path), [Request(Index("a"), (0, 4), (6, 3))], columns)
    assert torch.equal(columns.dests["a"], full["a"][:, 4:7])
    assert planner.committed == ["a", "b"] and columns.committed == ["a"]


def test_a_bf16_file_is_converted_into_fp32_shards(tmp_path):
    path, full = weights(tmp_path, torch.bfloat16)
    planner = Planner({"a": torch.empty(3, 8)})
    _read_file(str(path), [Request(Index("a"), (1, 0), (3, 8))], planner)
    assert torch.equal(planner.dests["a"], full["a"][1:4].float())


def test_a_truncated_or_foreign_file_is_refused_by_name(tmp_path):
    path, _ = weights(tmp_path)
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(TaskError, match="model.safetensors is truncated"):
        _read_file(str(path), [Request(Index("b"), (0,), (10,))], Planner({"b": torch.empty(10)}))
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(TaskError, match="is not a safetensors file"):
        _read_file(str(path), [], Planner({}))
