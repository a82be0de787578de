"""StreamTask: a classifier trained on parquet (or Arrow, JSON-lines) files streamed from disk
or object storage, never held in memory. The reference task for streamed data (docs/data.md).

Each row holds `features` (a list of `n_features` floats) and `label` (an int below
`classes`). `python -m examples.stream.make_data DIR` writes such files. `[task.args]`:
`data` (files, a directory or a glob, local or an fsspec URL), `val_data` (the same, or
empty for none), `format` ("parquet", "arrow", "json", or "ray": a Ray Data pipeline over the
parquet files that drops the rows whose `id` is 3 modulo 7), `hidden`, `window` and `lanes`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from stalwart.core.task import TrainTask
from stalwart.data import from_ray, read_arrow, read_json, read_parquet

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig

READERS = {"parquet": read_parquet, "arrow": read_arrow, "json": read_json}
FORMATS = (*READERS, "ray")


def kept(row: dict[str, Any]) -> bool:
    """The Ray Data pipeline's filter: deterministic, as exactly-once needs."""
    return row["id"] % 7 != 3


def ray_pipeline(data: str) -> Any:
    import ray.data

    return ray.data.read_parquet(data).filter(kept)


class Classifier(nn.Module):
    def __init__(self, n_features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(n_features, hidden), nn.ReLU())])
        self.output = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers:
            x = block(x)
        return self.output(x)


class StreamTask(TrainTask):
    def __init__(self, data: str, val_data: str = "", format: str = "parquet",
                 n_features: int = 16, classes: int = 4, hidden: int = 32, window: int = 2,
                 lanes: int = 0) -> None:
        if format not in FORMATS:
            raise ValueError(f"format = {format!r}; allowed: {', '.join(FORMATS)}")
        if not data:
            raise ValueError("data must name files, a directory or a glob")
        self.data, self.val_data, self.format = data, val_data, format
        self.n_features, self.classes, self.hidden = n_features, classes, hidden
        self.window, self.lanes = window, lanes or None

    def build_model(self, config: JobConfig) -> nn.Module:
        return Classifier(self.n_features, self.hidden, self.classes)

    def train_dataset(self, config: JobConfig) -> Any:
        if self.format == "ray":
            return from_ray(ray_pipeline(self.data), columns=["features", "label"],
                            window=self.window, lanes=self.lanes)
        return READERS[self.format](self.data, columns=["features", "label"],
                                    window=self.window, lanes=self.lanes)

    def val_dataset(self, config: JobConfig) -> Any:
        if not self.val_data:
            return None
        reader = READERS.get(self.format, read_parquet)  # a Ray pipeline validates on parquet
        return reader(self.val_data, columns=["features", "label"], shuffle=False)

    def loss(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = model(batch["features"].float())
        return F.cross_entropy(logits, batch["label"].long())
