"""Activation checkpointing of transformer blocks: trade recomputation for activation memory.

- full: keep only each block's input; recompute the whole block in backward.
- selective: keep the outputs of the expensive ops (matmuls, attention) and recompute the
  cheap ones (norms, activations, element-wise), the op-level policy of Korthikanti et al.
  2022 that TorchTitan also uses. Most of the memory saving for little recompute.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from stalwart.parallel.blocks import replace_blocks

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: torch.nn.Module, mode: str) -> None:
    """Wrap every block in place (state-dict names are unchanged: the wrapper strips its prefix)."""
    if mode == "none":
        return
    if mode == "full":
        wrap = partial(checkpoint_wrapper, preserve_rng_state=False)
    elif mode == "selective":
        wrap = partial(checkpoint_wrapper, preserve_rng_state=False,
                       context_fn=partial(create_selective_checkpoint_contexts, _policy))
    else:
        raise ValueError(f"unexpected activation checkpointing mode {mode!r}")
    replace_blocks(model, wrap)
