"""Per-rank memory of a training layout, computed from the model's shape: no process group.

`estimate(shape, layout)` counts, for the busiest rank, the bytes of what training keeps:
parameters, gradients and optimizer state (ZeRO, Rajbhandari et al. 2020), the transient
buffers of the data-parallel wrapper, and activations (Korthikanti et al. 2022). It models
stalwart's own recipe (parallel/data_parallel.py): FSDP2 with one unit per transformer block
plus a root unit, AdamW, and a bf16 compute copy over fp32 master weights.

Contract: an estimate, not a measurement. It leaves out the CUDA context, allocator
fragmentation and kernel workspaces (keep ~10% headroom). A part it cannot know from the
shape it was given is None, never a guess, and `complete` says whether the total has it all.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

# The values [parallel] accepts are the values a plan accepts.
from stalwart.core.config import AC_MODES, PP_SCHEDULES, PRECISIONS
from stalwart.core.errors import StalwartError

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig
    from stalwart.core.task import TrainTask


class PlanError(StalwartError, ValueError):
    """A model shape or layout that cannot be planned: names the field and the bad value."""


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise PlanError(message)


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    n_params: int
    """Unique parameters of the whole model (a tied embedding and output head count once)."""
    n_layers: int | None = None
    """Transformer blocks; each is one FSDP unit. None: unknown."""
    d_model: int | None = None
    """Hidden size (h in the activation formulas)."""
    n_heads: int | None = None
    """Attention heads (a); the tensor-parallel degree must divide it."""
    seq_len: int | None = None
    """Tokens per sequence (s)."""
    vocab_size: int | None = None
    """Size of the logits; None leaves the logits out of the activations."""
    ffn_hidden: int | None = None
    """Feed-forward hidden width (used to size a block when block_params is not given)."""
    block_params: int | None = None
    """Parameters of one transformer block, the largest FSDP unit. None: unknown."""
    trainable: int | None = None
    """Parameters that train (adapters on a frozen base); None: all of them. A frozen one
    has no gradient and no optimizer state."""
    n_experts: int | None = None
    """Routed experts per MoE layer; None: a dense model (no expert parallelism)."""
    expert_params: int | None = None
    """Parameters of all routed experts: expert parallelism splits them, unsharded."""

    def __post_init__(self) -> None:
        for name, value in vars(self).items():  # every size is optional but positive
            _check(value is None or value >= 1, f"{name} must be >= 1, got {value}")
        _check(None in (self.d_model, self.n_heads) or self.d_model % self.n_heads == 0,
               f"n_heads = {self.n_heads} must divide d_model = {self.d_model}")
        if self.block_params is not None and self.n_layers is not None:
            _check(self.n_layers * self.block_params <= self.n_params,
                   f"{self.n_layers} blocks of {self.block_params:,} parameters exceed the "
                   f"parameter count {self.n_params:,}")

    @classmethod
    def from_task(cls, task: TrainTask, config: JobConfig | None) -> ModelShape:
        """The task's model counted on the meta device (no memory, no init cost), with the
        shape its `TrainTask.model_dims` hook gives; without one, the count alone."""
        import torch

        try:
            with torch.device("meta"):
                model = task.build_model(config)
            n_params = sum(p.numel() for p in model.parameters())  # a tied weight counts once
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        except Exception as exc:  # user code: any error belongs in the message
            raise PlanError(
                f"cannot build the model of task {type(task).__name__} on the meta device to "
                f"count its parameters ({type(exc).__name__}: {exc}); implement "
                f"TrainTask.model_dims or use --params") from exc
        dims = task.model_dims(model)
        frozen = {"trainable": trainable or None} if trainable < n_params else {}
        if dims is None:
            return dataclasses.replace(cls.from_param_count(n_params), **frozen)
        return cls(n_params=n_params, n_layers=dims.n_layers, d_model=dims.d_model,
                   n_heads=dims.n_heads, seq_len=dims.seq_len, vocab_size=dims.vocab_size,
                   ffn_hidden=dims.ffn_hidden, block_params=dims.block_params,
                   n_experts=dims.n_experts, expert_params=dims.expert_params, **frozen)

    @classmethod
    def from_param_count(cls, n_params: int, *, n_layers: int | None = None,
                         d_model: int | None = None, n_heads: int | None = None,
                         seq_len: int | None = None, vocab_size: int | None = None,
                         ffn_hidden: int | None = None) -> ModelShape:
        """A bare parameter count, with whatever of the shape is known."""
        shape = cls(n_params=n_params, n_layers=n_layers, d_model=d_model, n_heads=n_heads,
                    seq_len=seq_len, vocab_size=vocab_size, ffn_hidden=ffn_hidden)
        if d_model is not None:
            # The example GPT's block: wq wk wv wo (4h^2), SwiGLU w1 w2 w3 (3hf), two norms.
            ffn = ffn_hidden or 32 * math.ceil(int(8 * d_model / 3) / 32)  # GPTConfig.ffn_dim
            block = 4 * d_model * d_model + 3 * d_model * ffn + 2 * d_model
        elif n_layers is not None:
            block = n_params // n_layers  # no width: every parameter is in some block
        else:
            return shape
        return dataclasses.replace(shape, block_params=block)  # checks blocks <= n_params

    @property
    def activations_known(self) -> bool:
        return None not in (self.n_layers, self.d_model, self.n_heads, self.seq_len)

    @property
    def root_params(self) -> int | None:
        """Parameters outside the blocks (embeddings, final norm, head): the FSDP root unit."""
        if self.block_params is None or self.n_layers is None:
            return None
        return self.n_params - self.n_layers * self.block_params


DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")
"""A layout's [parallel] degrees, in the order ParallelConfig.layout gives them."""


@dataclass(frozen=True, kw_only=True)
class PlanLayout:
    """One parallel layout to plan for: the four degrees and the options that size memory."""

    dp_replicate: int = 1
    """Data-parallel replicas (DDP alone, the outer dimension of HSDP with dp_shard > 1 or pp > 1)."""
    dp_shard: int = 1
    """FSDP2 sharding degree: parameters, gradients and optimizer state are split over it."""
    tp: int = 1
    """Tensor-parallel degree."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks, which FSDP2 shards over too."""
    ep: int = 1
    """Expert-parallel degree: the experts split over ep of the dp_shard ranks, whole (FSDP2
    shards only the dense part then)."""
    pp: int = 1
    """Pipeline stages."""
    zero3: bool = True
    """FSDP2 reshard_after_forward: free gathered blocks after forward (ZeRO-3), or keep them
    until backward (what stalwart calls ZeRO-2)."""
    mixed_precision: str = "fp32"
    """fp32, or bf16: bf16 compute copies over fp32 master weights, fp32 gradient reduction."""
    cpu_offload: bool = False
    """FSDP2 CPUOffloadPolicy: sharded parameters, gradients and optimizer state in host memory."""
    activation_checkpointing: str = "none"
    """none, selective (recompute attention) or full (keep only each block's input)."""
    sequence_parallel: bool = True
    """With tp > 1, also split the activations outside the matmuls along the sequence."""
    micro_batch_size: int = 1
    """Sequences per forward/backward on one rank (b)."""
    pp_microbatches: int | None = None
    """Micro-batches per pipeline step; None means pp (the fewest that fill the pipeline)."""
    pp_schedule: str = "1f1b"
    """As parallel.pp_schedule: gpipe holds every micro-batch; the 1F1B family (1f1b,
    interleaved_1f1b, zero_bubble) holds about pp on the first stage."""

    def __post_init__(self) -> None:
        for name in (*DEGREES, "micro_batch_size"):
            _check(getattr(self, name) >= 1, f"{name} must be >= 1, got {getattr(self, name)}")
        _check(self.pp_microbatches is None or self.pp_microbatches >= 1,
               f"pp_microbatches must be >= 1, got {self.pp_microbatches}")
        for name, allowed in (("mixed_precision", PRECISIONS), ("pp_schedule", PP_SCHEDULES),
                              ("activation_checkpointing", AC_MODES)):
            _check(getattr(self, name) in allowed, f"{name} must be one of "
                   f"{', '.join(allowed)}, got {getattr(self, name)!r}")

    @property
    def devices(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def uses_fsdp(self) -> bool:
        # As parallel/data_parallel.py decides: DDP has no sharding, DTensor, mixed-precision
        # or offload support, so any of those puts FSDP2 in charge (with dp_shard 1 if need be);
        # nor can it take a pipeline schedule, so replicas of a stage are FSDP2's too; context
        # parallel peers are FSDP2's as well (it shards over dp_shard x cp).
        return (self.dp_shard > 1 or self.tp > 1 or self.cp > 1
                or (self.pp > 1 and self.dp_replicate > 1)
                or self.mixed_precision != "fp32" or self.cpu_offload)

    @property
    def zero_stage(self) -> int:
        """0 when nothing is sharded (DDP or one data-parallel rank), else 3 or 2."""
        return 0 if self.fsdp_degree == 1 else 3 if self.zero3 else 2

    def degrees(self) -> dict[str, int]:
        """The [parallel] degrees this layout sets, as ParallelConfig.layout names them."""
        return {name: getattr(self, name) for name in DEGREES}

    @property
    def fsdp_degree(self) -> int:
        """Ranks FSDP2 shards each parameter over: dp_shard x cp."""
        return self.dp_shard * self.cp

    def describe(self) -> str:
        cp = f" x cp={self.cp}" if self.cp > 1 else ""
        ep = f" (ep={self.ep})" if self.ep > 1 else ""
        return (f"dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard}{cp} x "
                f"tp={self.tp} x pp={self.pp}{ep}, ZeRO-{self.zero_stage}")


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    params: int
    """Bytes of the rank's stored parameters: its fp32 shard (the master weights under bf16)."""
    grads: int
    """Bytes of the rank's fp32 gradient shard (FSDP2 reduce-scatters into the parameter dtype)."""
    optimizer: int
    """Bytes of AdamW's exp_avg and exp_avg_sq for the rank's shard (fp32)."""
    buffers: int | None
    """Peak transient bytes of the wrapper: gathered parameters, unsharded gradients, DDP buckets."""
    activations: int | None
    """Peak bytes of saved activations (with logits); None when the shape lacks the sizes."""
    offloaded: bool
    """params, grads and optimizer live in host memory, not on the device."""

    @property
    def state(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def device(self) -> int:
        """Bytes on the device; a lower bound when not `complete`."""
        return ((0 if self.offloaded else self.state) + (self.buffers or 0)
                + (self.activations or 0))

    @property
    def host(self) -> int:
        return self.state if self.offloaded else 0

    @property
    def complete(self) -> bool:
        return None not in (self.buffers, self.activations)


def estimate(shape: ModelShape, layout: PlanLayout) -> MemoryEstimate:
    """Bytes on the busiest rank of `layout` (the first pipeline stage) for `shape`."""
    rank_params = _rank_params(shape, layout)
    # ZeRO (section 3.1, Figure 1): (2 + 2 + K) x params / N_d with K = 12 for mixed-precision Adam (fp32
    # master, m, v), the same 16 bytes as pure fp32 Adam (4 + 4 + 8). FSDP2 splits the 16
    # differently: the fp32 sharded parameter IS the master weight and its gradient stays
    # fp32 (reduce_dtype), so params 4 + grads 4 + optimizer 8 (m, v); the bf16 copies exist
    # only while a unit is gathered and are counted in `buffers`. Every stored tensor is
    # sharded over dp_shard (x cp) under ZeRO-2 and ZeRO-3 alike (FSDP2 never keeps a full copy).
    shard = math.ceil(rank_params / layout.fsdp_degree)
    if layout.ep > 1 and shape.expert_params:
        # The experts are split over ep ranks whole; FSDP2 shards only the rest.
        experts = math.ceil(shape.expert_params / layout.pp / layout.tp)
        shard = (math.ceil((rank_params - experts) / layout.fsdp_degree)
                 + math.ceil(experts / layout.ep))
    # Frozen parameters (a LoRA fine-tune's base) have no gradient and no optimizer state:
    # those scale with the trainable share, spread as the parameters are.
    trained = shard if shape.trainable is None else \
        math.ceil(shard * shape.trainable / shape.n_params)
    return MemoryEstimate(params=4 * shard, grads=4 * trained, optimizer=8 * trained,
                          buffers=_buffers(shape, layout, rank_params),
                          activations=_activations(shape, layout), offloaded=layout.cpu_offload)


def _rank_params(shape: ModelShape, layout: PlanLayout) -> int:
    """Parameters on one rank of the largest pipeline stage, before data-parallel sharding."""
    if shape.block_params is not None and shape.n_layers is not None:
        # Stages split the blocks; the first also holds every non-block parameter (embedding,
        # and counted there too: norm and head), so it is the largest. Conservative when an
        # untied head sits on the last stage instead.
        stage = (math.ceil(shape.n_layers / layout.pp) * shape.block_params
                 + shape.n_params - shape.n_layers * shape.block_params)
    else:
        stage = math.ceil(shape.n_params / layout.pp)
    return math.ceil(stage / layout.tp)  # Megatron: every matrix is split over tp


def _buffers(shape: ModelShape, layout: PlanLayout, rank_params: int) -> int | None:
    if not layout.uses_fsdp:
        # DDP copies every gradient into flat all-reduce buckets (gradient_as_bucket_view is
        # off): a second fp32 gradient set. One rank with no wrapper has none.
        return 4 * rank_params if layout.dp_replicate * layout.fsdp_degree > 1 else 0
    compute = 2 if layout.mixed_precision == "bf16" else 4  # bytes of a gathered parameter
    if shape.block_params is None:
        # Without the block size only ZeRO-2's dominant term is known: all of the rank's
        # parameters gathered (below), less one block's gradient buffer.
        return None if layout.zero3 else compute * rank_params
    block = math.ceil(shape.block_params / layout.tp)
    if layout.ep > 1 and shape.expert_params and shape.n_layers:
        block -= shape.expert_params // shape.n_layers  # a rank's experts are never gathered
    # One block's unsharded gradient waits for its reduce-scatter; under bf16 FSDP2 upcasts
    # it into an fp32 buffer to reduce in fp32.
    grad_buffer = block * (compute + (4 if compute != 4 else 0))
    if not layout.zero3:
        # reshard_after_forward=False: each block stays gathered from its forward to its
        # backward, so after the last forward every parameter of the rank is unsharded.
        return compute * rank_params + grad_buffer
    # ZeRO-3: the root unit (embedding, norm, head) stays gathered all step (stalwart shards
    # it with reshard_after_forward=False); of the blocks, the one computing and the next,
    # prefetched by FSDP2 while the first runs, are gathered at once.
    root = math.ceil((shape.root_params or 0) / layout.tp)
    return compute * (root + 2 * block) + grad_buffer


def _activations(shape: ModelShape, layout: PlanLayout) -> int | None:
    """Peak saved activations on the busiest stage (Korthikanti et al. 2022, Table 2)."""
    if not shape.activations_known:
        return None
    s, b, h, a = shape.seq_len, layout.micro_batch_size, shape.d_model, shape.n_heads
    t, split = layout.tp, layout.sequence_parallel or layout.tp == 1
    # Context parallel: a rank keeps the activations of its s / cp tokens, and for attention's
    # backward the keys and values it gathered from the other cp ranks (2 x 2 bytes each).
    mine = s / layout.cp
    gathered = 4 * (s - mine) * b * h / t

    def per_layer(mode: str) -> float:
        # Bytes per block per micro-batch with 16-bit activations and 1-byte dropout masks:
        # sbh(34 + 5as/h), from a GPT block with a 4h MLP (a SwiGLU MLP saves ~4sbh more).
        # Tensor parallel splits the 24 sbh inside the matmul regions over t; sequence
        # parallel splits the other 10 (norms, dropouts) too. Selective recompute drops the
        # 5as^2b of attention scores (flash attention never stores them); an upper bound for
        # stalwart's op-level policy, which also recomputes norms and element-wise ops. Full
        # recompute keeps only each block's input, 2sbh (split by t with sequence parallel).
        # Under context parallel the scores are the rank's queries by every key: mine x s.
        if mode == "full":
            return 2 * mine * b * h / (t if split else 1)
        attention = 5 * a * mine * s * b / t if mode == "none" else 0.0
        return mine * b * h * (34 / t if split else 10 + 24 / t) + attention + gathered

    # Convention: bf16 activations are the paper's figure; fp32 ones are twice it (the 1-byte
    # masks, 2sbh + as^2b, are then doubled too: an overestimate of 3% to at most 10%).
    scale = 1 if layout.mixed_precision == "bf16" else 2
    mode = layout.activation_checkpointing
    stage = math.ceil(shape.n_layers / layout.pp) * per_layer(mode) * scale
    # Full recompute rebuilds one block's whole set in its backward, on top of the inputs.
    working = per_layer("none") * scale if mode == "full" else 0.0
    # The fp32 logits (paper: 4sbv/t, vocab-parallel loss) and the log-softmax output that
    # cross entropy saves beside them: 8sbV/t, on the last stage only.
    logits = 8 * mine * b * shape.vocab_size / t if shape.vocab_size else 0.0
    m = layout.pp_microbatches or layout.pp
    if layout.pp == 1:
        peak = stage + working + logits  # accumulation frees each micro-batch in its backward
    elif layout.pp_schedule != "gpipe":
        # The first stage runs pp forwards before its first backward; the last runs one.
        # (Interleaved and zero-bubble schedules hold about as many: modelled the same.)
        peak = max(min(layout.pp, m) * stage, stage + logits) + working
    else:  # GPipe: every stage holds all m micro-batches until the backwards start
        peak = m * (stage + logits) + working
    return math.ceil(peak)
