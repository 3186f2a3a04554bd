"""Token-choice top-k router: fp32 scores, selection, and the per-expert balancing bias.

Shapes: T tokens, D = d_model, E experts, k choices per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from config.model import MoEConfig


@dataclass
class RouterOutput:
    """What the router decided for a batch of tokens."""

    expert_ids: Tensor  # [T, k] int64: chosen experts, best first
    weights: Tensor  # [T, k] fp32: combine weights of the chosen experts
    probs: Tensor  # [T, E] fp32: per-token distribution over experts (sums to 1), for the aux loss and stats
    logits: Tensor  # [T, E] fp32: raw gate outputs, for the z-loss


class TopKRouter(nn.Module):
    """Scores every expert for every token and keeps the k best.

    The gate is computed in fp32 whatever the autocast dtype: a bf16 softmax over
    near-equal logits flips top-k choices from step to step (Switch Transformer's
    "selective precision", sec. 2.4). Its weight stays replicated under tensor
    parallelism for the same reason: every rank must route identically.

    ``expert_bias`` implements auxiliary-loss-free balancing (DeepSeek-V3, sec. 2.1.2):
    it is added to the scores for *selection only*; the combine weights use the raw
    scores. It is a buffer, not a parameter: ``update_bias`` nudges it after each
    optimizer step from the load the trainer measured.
    """

    def __init__(self, d_model: int, config: MoEConfig):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.top_k
        self.score_func = config.score_func
        self.renormalize = config.renormalize
        self.jitter_eps = config.jitter_eps
        self.force_balance = config.force_balance
        self.bias_update_rate = config.bias_update_rate
        self.gate = nn.Parameter(torch.empty(config.num_experts, d_model))
        self.register_buffer("expert_bias", torch.zeros(config.num_experts), persistent=True)

    def forward(self, x: Tensor) -> RouterOutput:
        """x: [T, D] in any dtype -> RouterOutput (all fp32 but the ids)."""
        x = x.float()
        if self.training and self.jitter_eps > 0:
            noise = torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
            x = x * noise
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = x @ self.gate.float().t()  # [T, E]
        if self.score_func == "softmax":
            scores = probs = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            probs = scores / scores.sum(dim=-1, keepdim=True)

        if self.force_balance:
            expert_ids = self._round_robin(x.shape[0], x.device)
        elif self.bias_update_rate > 0:
            expert_ids = torch.topk(scores + self.expert_bias, self.top_k, dim=-1).indices
        else:
            expert_ids = torch.topk(scores, self.top_k, dim=-1).indices
        weights = scores.gather(1, expert_ids)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return RouterOutput(expert_ids=expert_ids, weights=weights, probs=probs, logits=logits)

    def _round_robin(self, num_tokens: int, device: torch.device) -> Tensor:
        """DEBUG/BENCHMARK ONLY: assignment j of token t goes to expert (t*k + j) mod E.

        Every expert gets the same load (to within one) and each token k distinct
        experts; the router's output is ignored for selection. Used to benchmark and
        test the MoE machinery without routing skew. Never train a model with it.
        """
        slots = torch.arange(num_tokens * self.top_k, device=device)
        return (slots % self.num_experts).view(num_tokens, self.top_k)

    @torch.no_grad()
    def update_bias(self, tokens_per_expert: Tensor) -> None:
        """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower over-loaded ones.

        DeepSeek-V3 sec. 2.1.2: ``b_i += rate * sign(mean_load - load_i)`` once per
        optimizer step, from the load summed over the step's micro-batches (and over
        data-parallel ranks, so every replica applies the same update).
        """
        if self.bias_update_rate <= 0:
            return
        load = tokens_per_expert.float().to(self.expert_bias.device)
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
