"""A mixture-of-experts GPT: the reference GPT with each block's feed-forward replaced by
routed SwiGLU experts (Mixtral, DeepSeek-MoE).

Routing: a linear router scores every expert, the top `top_k` take the token, their softmax
weights renormalised over the chosen. Dropless: every token reaches its experts, whatever
their load (no capacity factor, so no token is dropped and the result does not depend on how
the batch is split over ranks). An optional shared expert sees every token. The
load-balancing auxiliary loss (Switch Transformer) is `n_experts x sum_e f_e x P_e`, f_e the
share of routed slots that went to expert e and P_e its mean router probability, over each
micro-batch's tokens.

Experts are kept in a ModuleDict keyed by their global id: under expert parallelism a rank
holds only its own (examples/moe/task.py), under the whole model's names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from stalwart.examples.gpt.model import GPT, FeedForward, GPTConfig, GPTConfigError

if TYPE_CHECKING:
    from stalwart.parallel.expert_parallel import ExpertShard


@dataclass(frozen=True, kw_only=True)
class MoEConfig(GPTConfig):
    n_experts: int = 8
    """Routed experts per block."""
    top_k: int = 2
    """Experts each token is routed to."""
    expert_hidden: int = 0
    """SwiGLU hidden width of each expert; 0 means the dense ffn_dim / top_k (rounded up to a
    multiple of 32), so a token's compute stays that of the dense model."""
    shared_expert: bool = True
    """Add one expert of the same width that every token goes through."""
    aux_loss_coef: float = 0.01
    """Weight of the load-balancing loss in the training loss."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("n_experts", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise GPTConfigError(name, value, "must be an int >= 1")
        if self.top_k > self.n_experts:
            raise GPTConfigError("top_k", self.top_k, f"must be <= n_experts = {self.n_experts}")
        value = self.expert_hidden
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise GPTConfigError("expert_hidden", value, "must be an int >= 0 (0: ffn_dim / "
                                 "top_k)")
        if not isinstance(self.shared_expert, bool):
            raise GPTConfigError("shared_expert", self.shared_expert, "must be true or false")
        coef = self.aux_loss_coef
        if (not isinstance(coef, int | float) or isinstance(coef, bool)
                or not math.isfinite(coef) or coef < 0):
            raise GPTConfigError("aux_loss_coef", coef, "must be a finite number >= 0")

    @property
    def expert_dim(self) -> int:
        if self.expert_hidden:
            return self.expert_hidden
        return 32 * math.ceil(self.ffn_dim / self.top_k / 32)


class Expert(FeedForward):
    """One SwiGLU expert, `expert_dim` wide."""

    def __init__(self, cfg: MoEConfig):
        nn.Module.__init__(self)
        self.w1 = nn.Linear(cfg.d_model, cfg.expert_dim, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.expert_dim, bias=False)
        self.w2 = nn.Linear(cfg.expert_dim, cfg.d_model, bias=False)


class MoE(nn.Module):
    """Router, routed experts (those this rank holds) and the optional shared expert."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.top_k
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): Expert(cfg) for e in range(cfg.n_experts)})
        self.shared = Expert(cfg) if cfg.shared_expert else None
        self.shard: ExpertShard | None = None
        """Set under expert parallelism: the other experts live on the ep peers."""
        self.aux_loss: Tensor | None = None
        self.load: Tensor | None = None
        """Share of this forward's routed slots each expert took (detached)."""

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, D]
        probs = self.router(flat).float().softmax(dim=-1)  # [N, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [N, k]
        weights = weights / weights.sum(dim=-1, keepdim=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.n_experts)  # [E]
        share = counts.float() / chosen.numel()
        self.aux_loss = self.n_experts * (share * probs.mean(dim=0)).sum()
        self.load = share.detach()
        # Every (token, expert) slot, sorted by expert: each expert's rows are contiguous.
        slots = chosen.flatten().argsort(stable=True)
        tokens = slots // self.top_k
        routed = flat[tokens]
        if self.shard is None:
            outs = [self.experts[str(e)](rows) for e, rows in
                    enumerate(routed.split(counts.tolist()))]
            done = torch.cat(outs)
        else:
            from stalwart.parallel.expert_parallel import run_experts

            mine = [self.experts[str(e)] for e in self.shard.local_experts(self.n_experts)]
            done = run_experts(self.shard, routed, counts, mine)
        scaled = done * weights.flatten()[slots].unsqueeze(-1).to(done.dtype)
        out = torch.zeros_like(flat).index_add(0, tokens, scaled)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(shape)


class MoEGPT(GPT):
    """The reference GPT with an MoE layer in place of each block's feed-forward."""

    def __init__(self, cfg: MoEConfig):
        super().__init__(cfg)
        for layer in self.layers:
            layer.feed_forward = MoE(cfg)
        self.init_weights()

    def moe_layers(self) -> list[MoE]:
        return [layer.feed_forward for layer in self.layers
                if isinstance(layer.feed_forward, MoE)]

    @torch.no_grad()
    def init_weights(self) -> None:
        """The GPT's draws, then each MoE layer's, in a fixed order (so every layout starts
        from the same weights); GPT.__init__ calls this before the MoE layers exist."""
        super().init_weights()
        cfg = self.cfg
        residual_std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        for moe in self.moe_layers():
            nn.init.normal_(moe.router.weight, std=cfg.init_std)
            for expert in [*moe.experts.values(), *([moe.shared] if moe.shared else [])]:
                nn.init.normal_(expert.w1.weight, std=cfg.init_std)
                nn.init.normal_(expert.w3.weight, std=cfg.init_std)
                nn.init.normal_(expert.w2.weight, std=residual_std)

    def take_aux_loss(self) -> Tensor:
        """The load-balancing loss of the last forward, summed over the MoE layers, taken:
        a layer that kept it would keep the forward's graph alive, and through it the
        expert-parallel groups the graph's all-to-alls saved (a cycle the collector cannot
        see, through autograd's C++ nodes)."""
        losses = []
        for moe in self.moe_layers():
            losses.append(moe.aux_loss)
            moe.aux_loss = None
        return torch.stack(losses).sum()

    def expert_load(self) -> Tensor:
        """Each expert's share of the routed slots in the last forward, averaged over layers."""
        return torch.stack([moe.load for moe in self.moe_layers()]).mean(dim=0)
