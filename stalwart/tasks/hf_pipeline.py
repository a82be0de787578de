"""Pipeline stages of a Llama-style Hugging Face causal LM: contiguous runs of decoder layers,
the embedding on the first stage, the final norm and head on the last.

Parameter names equal the whole model's (`model.layers.5.self_attn.q_proj.weight`,
`lm_head.weight`), so each rank reads its slices of the pretrained files by the files' own
names, and checkpoints move between pipelined and other layouts. Every stage computes its
own attention mask and rotary embeddings from the position ids, which travel between stages
with the hidden states: packed rows keep their documents apart in every stage.

A pipeline takes (inputs, targets) pairs: `PipelineRows` stacks a packed row's token and
position ids as the inputs, and shifts its labels as the targets (the last stage's
`output_loss` sees next-token targets, -100 where no loss is taken).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from stalwart.parallel.blocks import stage_layer_ids


class _Body(nn.Module):
    """The `model.` part of a stage: what LlamaModel holds, a stage's share of it."""

    def __init__(self, inner: nn.Module, layer_ids: list[int], *, first: bool,
                 last: bool) -> None:
        super().__init__()
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): inner.layers[i] for i in layer_ids})
        self.norm = inner.norm if last else None
        self.rotary_emb = inner.rotary_emb


class CausalLMStage(nn.Module):
    def __init__(self, model: nn.Module, layer_ids: list[int], *, first: bool,
                 last: bool) -> None:
        super().__init__()
        self.config = model.config
        self.model = _Body(model.model, layer_ids, first=first, last=last)
        self.lm_head = model.lm_head if last else None

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Any:
        """First stage: x is [B, 2, T] token and position ids. Later ones: the hidden states
        [B, T, H] and the position ids [B, T]. Returns (hidden, positions), or the last
        stage's logits."""
        from transformers.masking_utils import create_causal_mask

        if self.model.embed_tokens is not None:
            tokens, positions = x[:, 0], x[:, 1].contiguous()  # it is sent on
            h = self.model.embed_tokens(tokens)
        else:
            h = x
        assert positions is not None
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  cache=None, position_ids=positions)
        rotary = self.model.rotary_emb(h, position_ids=positions)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=rotary,
                      position_ids=positions)
        if self.lm_head is not None:
            return self.lm_head(self.model.norm(h)).float()
        if isinstance(h, DTensor):  # split along the sequence (TP): whole, to be sent on
            h = h.full_tensor()
        return h, positions


def split_stages(model: nn.Module, stage_ids: list[int], num_stages: int
                 ) -> list[CausalLMStage]:
    layer_ids = stage_layer_ids(model.config.num_hidden_layers, num_stages)
    return [CausalLMStage(model, layer_ids[s], first=s == 0, last=s == num_stages - 1)
            for s in stage_ids]


def rank_union(model: nn.Module, stage_ids: list[int], num_stages: int) -> CausalLMStage:
    """One module holding every parameter of this rank's stages under the whole model's
    names (the optimizer's, the checkpoints' and the weight files'): it shares the stages'
    submodules and is never run."""
    layer_ids = stage_layer_ids(model.config.num_hidden_layers, num_stages)
    ids = sorted(i for s in stage_ids for i in layer_ids[s])
    return CausalLMStage(model, ids, first=0 in stage_ids, last=num_stages - 1 in stage_ids)


class PipelineRows:
    """Packed rows as a pipeline's (inputs, targets) pairs."""

    def __init__(self, rows: Any) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def get_batch(self, indices: Any) -> tuple[Tensor, Tensor]:
        batch = self.rows.get_batch(indices)
        inputs = torch.stack([batch["input_ids"], batch["position_ids"]], dim=1)
        # The model's own loss shifts its labels; output_loss does not: shift them here.
        labels = batch["labels"]
        targets = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
        return inputs, targets
