"""The reference GPT's tensor-parallel plan (Megatron-style), with sequence parallelism.

Attention: wq/wk/wv split by output columns (each rank holds n_heads / tp whole heads), wo
by input rows, so one reduction per attention block; the SwiGLU feed-forward likewise (w1,
w3 colwise, w2 rowwise). With sequence parallelism the residual stream between those
regions stays split along the sequence ([B, T/tp, D] per rank) and the norms run on their
slice; the reductions become reduce-scatters and all-gathers of the same total volume.
The tied embedding/output weight is split by vocabulary rows in both uses (Shard(0)), so it
stays one parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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

    from stalwart.examples.gpt.model import GPT


def apply_tensor_parallel(model: GPT, tp_mesh: DeviceMesh, *, sequence_parallel: bool) -> None:
    stream = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    # A pipeline stage holds only some of these (examples/gpt/pipeline.py): plan what is there.
    top = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=stream, output_layouts=Replicate())
        if sequence_parallel:
            top["norm"] = SequenceParallel()
    if top:
        parallelize_module(model, tp_mesh, top)

    for block in blocks_of(model):
        plan = {
            # Attention and feed-forward need the whole sequence: gather it on the way in.
            "attention": PrepareModuleInput(input_layouts=(stream, None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=stream),
            "feed_forward": PrepareModuleInput(input_layouts=(stream,),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=stream),
        }
        if sequence_parallel:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
        parallelize_module(block, tp_mesh, plan)

    # parallelize_module gave the embedding and the head a DTensor each; tie them again.
    if model.cfg.tie_embeddings and model.output is not None and model.tok_embeddings is not None:
        model.output.weight = model.tok_embeddings.weight
