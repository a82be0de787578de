"""A small decoder-only transformer (GPT) used as the example workload.

Llama-style blocks: RMSNorm pre-norm, rotary position embeddings, causal
scaled-dot-product attention and a SwiGLU feed-forward, with the output head
tied to the token embedding. Module names (``layers.N.attention.wq`` ...)
are kept stable because tensor-parallel plans refer to them by name.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from stalwart.core.task import SequenceShard


class GPTConfigError(ValueError):
    """A GPTConfig field that is out of its range or of the wrong type, by name (GPTTask
    reports it as `task.args.<field>`)."""

    def __init__(self, field: str, value: object, allowed: str) -> None:
        super().__init__(f"GPTConfig.{field} = {value!r} is invalid: {allowed}")
        self.field, self.value, self.allowed = field, value, allowed


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    vocab_size: int = 256
    """Number of token ids; 256 covers byte-level tokens."""
    seq_len: int = 128
    """Maximum sequence length (length of the precomputed rotary tables)."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 4
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads; must divide d_model, and d_model / n_heads must be even."""
    ffn_hidden: int = 0
    """SwiGLU hidden width; 0 means int(8 * d_model / 3) rounded up to a multiple of 32."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    norm_eps: float = 1e-5
    """Epsilon of the RMSNorm layers."""
    init_std: float = 0.02
    """Std of the normal weight init (residual output projections get std / sqrt(2 * n_layers))."""
    tie_embeddings: bool = True
    """Use the token embedding as the output head too (one matrix). Pipeline parallelism needs
    it off: the embedding and the head then live on different stages."""

    def __post_init__(self) -> None:
        # Every field by its kind: GPTTask builds this from [task.args] on the driver, so a
        # TOML value of the wrong type (a string, a bool, inf) must fail here, not in a worker.
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "ffn_hidden"):
            value, least = getattr(self, name), 0 if name == "ffn_hidden" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise GPTConfigError(name, value, f"must be an int >= {least}" + (
                    " (0: the SwiGLU default)" if name == "ffn_hidden" else ""))
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if (not isinstance(value, int | float) or isinstance(value, bool)
                    or not math.isfinite(value) or value <= 0):
                raise GPTConfigError(name, value, "must be a finite number > 0")
        if not isinstance(self.tie_embeddings, bool):
            raise GPTConfigError("tie_embeddings", self.tie_embeddings, "must be true or false")
        if self.d_model % self.n_heads != 0:
            raise GPTConfigError("n_heads", self.n_heads, f"must divide d_model = {self.d_model}")
        if self.head_dim % 2 != 0:
            # Rotary embeddings rotate pairs of channels.
            raise GPTConfigError("n_heads", self.n_heads, f"must make head_dim = d_model / "
                                 f"n_heads even (it is {self.head_dim})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_dim(self) -> int:
        if self.ffn_hidden:
            return self.ffn_hidden
        # SwiGLU has three matrices, so 2/3 of the usual 4*d keeps the FLOPs of a GELU MLP.
        multiple_of = 32
        hidden = int(8 * self.d_model / 3)
        return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def rotary_tables(
    seq_len: int, head_dim: int, theta: float, device: torch.device
) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [seq_len, head_dim // 2], in float32."""
    channels = torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
    freqs = 1.0 / theta ** (channels / head_dim)  # [hd/2]
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    angles = torch.outer(positions, freqs)  # [seq_len, hd/2]
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + head_dim/2) of x [B, H, T, hd] by position; cos/sin are [T, hd/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)  # each [B, H, T, hd/2]
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.context: SequenceShard | None = None
        """Set under context parallelism: this rank holds part of each sequence."""

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)  # each [B, T, H * hd]
        # Heads come from the projection's real width, not the config: under a
        # tensor-parallel colwise split each rank only holds a slice of the heads.
        n_heads = q.shape[-1] // self.head_dim
        q = q.view(B, T, n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(B, T, n_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, n_heads, self.head_dim).transpose(1, 2)
        # The tables cover seq_len, or this rank's positions under context parallelism; take
        # this sequence's (the rank's whole share here, even when the residual stream outside
        # attention is split along it by sequence parallelism).
        q, k = apply_rotary(q, cos[:T], sin[:T]), apply_rotary(k, cos[:T], sin[:T])
        if self.context is not None:  # keys and values from the other cp ranks too
            y = self.context.attention(q, k, v)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, hd]
        y = y.transpose(1, 2).reshape(B, T, n_heads * self.head_dim)
        return self.wo(y)  # [B, T, d_model]


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attention_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self._tie_weights()
        self.context: SequenceShard | None = None
        """Set by set_context: the model sees only this rank's part of each sequence."""
        # Derived from the config, so not saved in checkpoints; init_weights
        # refills them because to_empty() leaves them uninitialised.
        shape = (cfg.seq_len, cfg.head_dim // 2)
        self.register_buffer("rope_cos", torch.empty(shape, dtype=torch.float32), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape, dtype=torch.float32), persistent=False)
        self.init_weights()

    def _tie_weights(self) -> None:
        # One Parameter used twice: the byte embedding doubles as the output head.
        if self.cfg.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> GPT:
        # to_empty() (meta -> real device) replaces each Parameter with a new object,
        # which silently unties the head from the embedding; tie again afterwards.
        result = super()._apply(fn, recurse)
        self._tie_weights()
        return result

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialise all parameters and rotary buffers in place from torch's global RNG."""
        cfg = self.cfg
        self._tie_weights()
        cos, sin = rotary_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta, self.rope_cos.device)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        # A fixed draw order keeps the result identical however the model was built.
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        nn.init.normal_(self.tok_embeddings.weight, std=cfg.init_std)
        for layer in self.layers:
            attn, ffn = layer.attention, layer.feed_forward
            # A subclass's own feed-forward (examples/moe) initialises itself.
            dense = [ffn.w1, ffn.w3] if isinstance(ffn, FeedForward) else []
            for linear in (attn.wq, attn.wk, attn.wv, *dense):
                nn.init.normal_(linear.weight, std=cfg.init_std)
            # Projections that write into the residual stream are scaled down so
            # its variance does not grow with depth (GPT-2).
            nn.init.normal_(attn.wo.weight, std=residual_std)
            if dense:
                nn.init.normal_(ffn.w2.weight, std=residual_std)
            nn.init.ones_(layer.attention_norm.weight)
            nn.init.ones_(layer.ffn_norm.weight)
        nn.init.ones_(self.norm.weight)
        if not cfg.tie_embeddings:  # drawn last, so a tied model's draws are unchanged
            nn.init.normal_(self.output.weight, std=cfg.init_std)

    def set_context(self, shard: SequenceShard) -> None:
        """Context parallelism: forward takes this rank's tokens of each sequence
        (shard.positions of them) and attention reaches the whole sequence."""
        self.context = shard
        for layer in self.layers:
            layer.attention.context = shard

    def forward(self, tokens: Tensor) -> Tensor:
        """tokens [B, T] int64 -> logits [B, T, vocab_size] float32 (T: this rank's share
        of the sequence under context parallelism)."""
        T = tokens.shape[1]
        whole = T * (self.context.size if self.context is not None else 1)
        if whole > self.cfg.seq_len:
            raise ValueError(f"sequence length {whole} exceeds GPTConfig.seq_len="
                             f"{self.cfg.seq_len}")
        cos, sin = self.rope_cos, self.rope_sin  # tables [seq_len, hd/2]
        if self.context is not None:  # the rotations of this rank's positions
            positions = self.context.positions(T, tokens.device)
            cos, sin = cos[positions], sin[positions]
        h = self.tok_embeddings(tokens)  # [B, T, d_model]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h)).float()  # [B, T, vocab_size]

    def num_params(self) -> int:
        """Number of unique parameters (the tied embedding/output weight counts once)."""
        return sum(p.numel() for p in self.parameters())
