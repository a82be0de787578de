"""Pipeline stages of the reference GPT: contiguous runs of blocks, the embedding on the first
stage and the final norm and head on the last. Parameter names equal the whole model's
(`layers.5.attention.wq.weight`), so a checkpoint moves between pipelined and other layouts.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from stalwart.examples.gpt.model import GPT
from stalwart.parallel.blocks import stage_layer_ids


class GPTStage(nn.Module):
    def __init__(self, model: GPT, layer_ids: list[int], *, first: bool, last: bool) -> None:
        super().__init__()
        self.cfg = model.cfg
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layer_ids})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("rope_cos", model.rope_cos.clone(), persistent=False)
        self.register_buffer("rope_sin", model.rope_sin.clone(), persistent=False)

    def forward(self, h: Tensor) -> Tensor:
        """tokens [B, T] (first stage) or hidden [B, T, D] -> hidden, or logits (last stage)."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(h)
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.output is not None:
            h = self.output(self.norm(h)).float()
        return h


def split_stages(model: GPT, stage_ids: list[int], num_stages: int) -> list[GPTStage]:
    layer_ids = stage_layer_ids(model.cfg.n_layers, num_stages)
    return [GPTStage(model, layer_ids[s], first=s == 0, last=s == num_stages - 1)
            for s in stage_ids]


def rank_union(model: GPT, stage_ids: list[int], num_stages: int) -> GPTStage:
    """One module holding every parameter of this rank's stages (for the optimizer and the
    checkpoint): it shares the stages' submodules and is never run."""
    layer_ids = stage_layer_ids(model.cfg.n_layers, num_stages)
    ids = sorted(i for s in stage_ids for i in layer_ids[s])
    with torch.no_grad():
        return GPTStage(model, ids, first=0 in stage_ids, last=num_stages - 1 in stage_ids)
