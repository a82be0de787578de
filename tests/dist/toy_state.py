"""A rank's state for the memory tier's dist tests: a tensor of its own and a step."""

from __future__ import annotations

import torch

from stalwart.checkpointing.memory.tier import StateAccess


class Toy:
    """A rank's state: its own tensor (named after the rank, so shards are distinct), a step."""

    def __init__(self, rank: int, elements: int = 4) -> None:
        self.tensors = {f"w{rank}": torch.full((elements,), float(rank))}
        self.step = 0

    def state_dict(self) -> dict:
        return {"model": dict(self.tensors), "train": {"step": self.step}}

    def view(self) -> StateAccess:
        return StateAccess(state_dict=self.state_dict,
                           scalar_state=lambda: {"train": {"step": self.step}},
                           signature=lambda: tuple(sorted(self.tensors)),
                           load_state_dict=self.load, device=torch.device("cpu"))

    def load(self, state: dict) -> None:
        self.tensors = dict(state["model"])
        self.step = state["train"]["step"]
