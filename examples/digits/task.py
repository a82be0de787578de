"""DigitsTask: the smallest complete task. An MLP learns to read 8x8 handwritten digits.

Start here to train your own model: a TrainTask only says *what* to train (a model, its data,
and optionally loss, optimizer and schedule), and stalwart does the distributed rest. The
1,797 images of scikit-learn's `load_digits()` ship inside the scikit-learn package, so
nothing is downloaded. `[task.args]` in the config sets `hidden` (width of each hidden
layer), `depth` (number of hidden layers) and `val_fraction` (share of images held out).
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from stalwart.core.errors import TaskError
from stalwart.core.task import TrainTask

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig

N_PIXELS = 8 * 8
N_CLASSES = 10
NEEDS_SKLEARN = "DigitsTask needs scikit-learn: pip install scikit-learn"


class MLP(nn.Module):
    """64 pixel intensities -> `depth` x (Linear, ReLU) of width `hidden` -> 10 logits."""

    def __init__(self, hidden: int, depth: int) -> None:
        super().__init__()
        widths = [N_PIXELS] + [hidden] * depth
        # The hidden blocks go in `self.layers` on purpose: with FSDP (parallel.dp_shard > 1)
        # stalwart shards each entry of `model.layers` on its own, so a block's weights are
        # gathered just before it runs and freed after; the root module keeps the rest (here
        # the output layer). Activation checkpointing and torch.compile also work per entry.
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(n_in, n_out), nn.ReLU())
            for n_in, n_out in zip(widths[:-1], widths[1:], strict=True))
        self.output = nn.Linear(hidden, N_CLASSES)

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise every parameter from torch's global RNG, which stalwart seeds with
        train.seed before calling this, so every rank starts from the same weights."""
        for block in self.layers:
            linear = block[0]
            nn.init.kaiming_normal_(linear.weight, nonlinearity="relu")  # He init suits ReLU
            nn.init.zeros_(linear.bias)
        # A small output layer: the first predictions are near uniform (loss ~ ln 10).
        nn.init.normal_(self.output.weight, std=0.01)
        nn.init.zeros_(self.output.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, 64] float32 -> logits [B, 10]."""
        for block in self.layers:
            x = block(x)
        return self.output(x)


class DigitsDataset:
    """Images and labels held in memory; stalwart picks the indices each rank reads."""

    def __init__(self, images: np.ndarray, labels: np.ndarray) -> None:
        self.images = torch.from_numpy(images)  # [N, 64] float32 in [0, 1]
        self.labels = torch.from_numpy(labels)  # [N] int64 in 0..9

    def __len__(self) -> int:
        return len(self.labels)

    def get_batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return self.images[idx], self.labels[idx]


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """All 1,797 images as [N, 64] float32 scaled to [0, 1], and their labels [N] int64."""
    try:
        # Imported here rather than at the top, so that importing this module stays cheap.
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise TaskError(NEEDS_SKLEARN) from exc
    digits = load_digits()  # pixel intensities are integers 0..16
    return (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int64)


def split_indices(n: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) item indices: a fixed shuffle, the last `val_fraction` held out.

    The seed is fixed rather than train.seed, so every rank and every run holds out the
    same images and validation losses of different runs can be compared.
    """
    order = np.random.default_rng(0).permutation(n)
    n_val = min(max(round(n * val_fraction), 1), n - 1)
    return order[:n - n_val], order[n - n_val:]


class DigitsTask(TrainTask):
    def __init__(self, *, hidden: int = 128, depth: int = 2, val_fraction: float = 0.2) -> None:
        # Constructed on the driver first, so a bad value fails before any worker starts.
        # Name the config key in the message: the user sees it as the error.
        for name, value in (("hidden", hidden), ("depth", depth)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"task.args.{name} = {value!r} is invalid: must be an int >= 1")
        if not isinstance(val_fraction, float) or not 0 < val_fraction < 1:
            raise ValueError(f"task.args.val_fraction = {val_fraction!r} is invalid: must be "
                             f"a number between 0 and 1 (exclusive)")
        if importlib.util.find_spec("sklearn") is None:  # cheap: finds it, does not import it
            raise TaskError(NEEDS_SKLEARN)
        self.hidden = hidden
        self.depth = depth
        self.val_fraction = val_fraction
        self._datasets: tuple[DigitsDataset, DigitsDataset] | None = None

    # Nothing to download, so the default (no-op) prepare_data is enough.

    def build_model(self, config: JobConfig) -> MLP:
        # stalwart calls init_weights() (via TrainTask.init_weights) right after this.
        return MLP(self.hidden, self.depth)

    def _split(self) -> tuple[DigitsDataset, DigitsDataset]:
        if self._datasets is None:
            images, labels = load_digits_arrays()
            train, val = split_indices(len(labels), self.val_fraction)
            self._datasets = (DigitsDataset(images[train], labels[train]),
                              DigitsDataset(images[val], labels[val]))
        return self._datasets

    def train_dataset(self, config: JobConfig) -> DigitsDataset:
        return self._split()[0]

    def val_dataset(self, config: JobConfig) -> DigitsDataset:
        return self._split()[1]

    def loss(self, model: nn.Module, images: torch.Tensor, labels: torch.Tensor
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Cross entropy, and the share of images read right as the `accuracy` metric.

        stalwart averages a metric like the loss, over micro-batches and ranks, and logs it
        in metrics.jsonl as `accuracy` (and `val_accuracy` after each validation pass)."""
        logits = model(images)
        accuracy = (logits.argmax(dim=-1) == labels).float().mean()
        return nn.functional.cross_entropy(logits, labels), {"accuracy": accuracy}

    # The default AdamW and the warm-up + cosine schedule (train.lr, train.warmup_steps, ...)
    # suit this model as they are.
