"""A task for the ray tests that read the workers' log lines on the driver: the reference GPT,
saying when it builds its model (once as a worker warms up, once per world it joins)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from stalwart.examples.gpt.task import GPTTask

if TYPE_CHECKING:
    import torch

    from stalwart.core.config import JobConfig


class LoudGPTTask(GPTTask):
    def build_model(self, config: JobConfig) -> torch.nn.Module:
        print("building the model", flush=True)
        return super().build_model(config)
