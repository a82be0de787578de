"""Your own model, trained fault-tolerantly from a plain script: `python examples/quickstart.py`.
The data, the task and its loss live here in `__main__`; Ray ships them to the workers."""

import torch
from torch import nn

import stalwart


class Waves:  # y = sin(3x) + noise at n points of [-2, 2]; batches are dicts
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 1, generator=g) * 4 - 2
        self.y = torch.sin(3 * self.x) + 0.05 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def get_batch(self, indices):  # stalwart picks the indices each rank reads
        idx = torch.as_tensor(indices)
        return {"x": self.x[idx], "y": self.y[idx]}


class WavesTask(stalwart.TrainTask):
    def __init__(self, *, width: int = 64) -> None:
        self.width = width

    def build_model(self, config):
        w = self.width
        return nn.Sequential(nn.Linear(1, w), nn.Tanh(), nn.Linear(w, w), nn.Tanh(),
                             nn.Linear(w, 1))

    def train_dataset(self, config):
        return Waves(4096, seed=0)

    def val_dataset(self, config):
        return Waves(512, seed=1)

    def loss(self, model, batch):  # the loss, and a metric of its own: mae, then val_mae
        error = model(batch["x"]) - batch["y"]
        return error.pow(2).mean(), {"mae": error.abs().mean()}


if __name__ == "__main__":
    result = stalwart.Trainer(task=WavesTask, config={
        "train": {"steps": 300, "global_batch_size": 64, "micro_batch_size": 32, "lr": 1e-2},
        "checkpoint": {"persist_every": 100}, "run": {"name": "quickstart", "log_every": 50},
    }).fit()
    print(f"{result.state} at step {result.step}: val_loss {result.metrics['val_loss']:.4f}, "
          f"val_mae {result.metrics['val_mae']:.3f}")
    print(f"newest checkpoint: step {result.checkpoint.step} at {result.checkpoint.path}")
