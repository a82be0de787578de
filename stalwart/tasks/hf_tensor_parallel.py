"""Tensor parallelism for Llama-style Hugging Face blocks (Llama, Mistral, Qwen2, ...).

Each block's q/k/v and gate/up projections are split by columns and o/down by rows, so a
block needs one collective after its attention and one after its MLP. With sequence
parallelism the activations between those (the residual stream and the two norms) are
split along the sequence too: the collectives become an all-gather before each column split
and a reduce-scatter after each row split, and each rank keeps 1/tp of them.

The embedding and the output head stay whole on every rank (a tied pair cannot take two
layouts). So the mask and rotary embeddings are computed on the whole sequence, the first
block cuts the sequence, and the final norm gathers it back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from stalwart.parallel.blocks import blocks_of

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
           "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")
SEQ = Shard(1)  # [batch, sequence, hidden]


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh, *,
                          sequence_parallel: bool) -> None:
    """Split `model`'s blocks over `tp_mesh` in place (a whole model or a pipeline stage)."""
    blocks = blocks_of(model)
    if not sequence_parallel:
        plan = {**{n: ColwiseParallel() for n in COLWISE},
                **{n: RowwiseParallel() for n in ROWWISE}}
        for block in blocks:
            parallelize_module(block, tp_mesh, plan)
        return
    plan = {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": SEQ},
                                        desired_input_kwarg_layouts={
                                            "hidden_states": Replicate()}),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(SEQ,), desired_input_layouts=(Replicate(),)),
        **{n: ColwiseParallel() for n in COLWISE},
        **{n: RowwiseParallel(output_layouts=SEQ, use_local_output=False) for n in ROWWISE},
    }
    for block in blocks:
        parallelize_module(block, tp_mesh, plan)
    if blocks:  # the whole sequence in (as the embedding gives it), this rank's part on
        parallelize_module(blocks[0], tp_mesh, PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(SEQ,),
            use_local_output=False))
    norm = _final_norm(model)
    if norm is not None:  # the whole sequence again, for a head that is whole on every rank
        parallelize_module(norm, tp_mesh, PrepareModuleInput(
            input_layouts=(SEQ,), desired_input_layouts=(Replicate(),), use_local_output=True))


def _final_norm(model: nn.Module) -> nn.Module | None:
    """The norm before the head: `model.model.norm` (None on a stage without it)."""
    inner = getattr(model, "model", None)
    return getattr(inner, "norm", None)
