"""MoETask: the reference task with a mixture-of-experts GPT (examples/moe/model.py).

Same data and shapes as GPTTask; [task.args] also takes the MoE fields (n_experts, top_k,
expert_hidden, shared_expert, aux_loss_coef). The training loss is cross entropy plus
aux_loss_coef x the load-balancing loss; each step logs `aux_loss` and every expert's share of
the routed slots (`expert_load_<e>`). Experts split over `parallel.ep` ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from stalwart.core.errors import TaskError
from stalwart.core.task import ExpertPlace, ModelDims
from stalwart.examples.gpt.task import GPTTask
from stalwart.examples.moe.model import MoEConfig, MoEGPT

if TYPE_CHECKING:
    from stalwart.core.config import JobConfig
    from stalwart.parallel.dims import ParallelDims


class MoETask(GPTTask):
    config_class = MoEConfig

    def build_model(self, config: JobConfig) -> MoEGPT:
        return MoEGPT(self.model_config)

    def model_dims(self, model: MoEGPT) -> ModelDims:
        dims = super().model_dims(model)
        experts = sum(p.numel() for moe in model.moe_layers()
                      for p in moe.experts.parameters())
        return ModelDims(**{**dims.__dict__, "n_experts": self.model_config.n_experts,
                            "expert_params": experts})

    def check_layout(self, dims: ParallelDims) -> None:
        super().check_layout(dims)
        cfg = self.model_config
        for name, degree, why in (
                ("tp", dims.tp, "its experts have no tensor-parallel plan"),
                ("pp", dims.pp, "its loss adds each layer's load-balancing loss, which a "
                                "pipeline's last stage does not see"),
                ("cp", dims.cp, "the load-balancing loss is over a micro-batch's tokens, "
                                "which context parallelism splits")):
            if degree > 1:
                raise TaskError(f"parallel.{name} = {degree}: the MoE example cannot be split "
                                f"so: {why}; use parallel.ep for the experts")
        if cfg.n_experts % dims.ep:
            raise TaskError(f"parallel.ep = {dims.ep} is invalid: must divide the model's "
                            f"{cfg.n_experts} experts (task.args.n_experts)")

    def apply_expert_parallel(self, model: MoEGPT, shard: ExpertPlace
                              ) -> list[torch.nn.Parameter]:
        """Keep this rank's experts of every layer; returns their parameters."""
        kept = []
        for moe in model.moe_layers():
            mine = {str(e) for e in shard.local_experts(moe.n_experts)}
            for key in [k for k in moe.experts if k not in mine]:
                del moe.experts[key]
            moe.shard = shard
            kept += list(moe.experts.parameters())
        return kept

    def loss(self, model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        core: MoEGPT = getattr(model, "module", model)  # DDP keeps the model as .module
        ce = self.output_loss(model(inputs), targets)
        aux = core.take_aux_loss()
        metrics = {"aux_loss": aux.detach(),
                   **{f"expert_load_{e}": load for e, load in enumerate(core.expert_load())}}
        return ce + self.model_config.aux_loss_coef * aux, metrics
