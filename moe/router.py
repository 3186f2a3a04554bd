"""Token-choice top-k router: fp32 scores, selection, and the per-expert balancing bias.

Shapes: T tokens, D = d_model, E experts, k choices per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from config.model import MoEConfig
from moe.init import chunk_seed


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

    ``expert_bias`` is DeepSeek-V3's correction bias b_i (sec. 2.1.2, eq. 16): it is added
    to the scores for *selection only*; the combine weights use the raw scores. It is a
    buffer, not a parameter: with aux-loss-free balancing (``bias_update_rate`` > 0)
    ``update_bias`` nudges it after each optimizer step from the load the trainer
    measured; without, it stays as initialised (zero) or as imported (a DeepSeek-V3
    checkpoint's ``e_score_correction_bias``), and selection always uses it: one bias,
    whether trained here or loaded.

    Group-limited routing (``n_group`` > 1 with ``topk_group`` < ``n_group``; DeepSeek-V3's
    node-limited routing, sec. 2.1.2, and its released ``noaux_tc`` gate): experts form
    ``n_group`` groups of consecutive ids, each token keeps the ``topk_group`` groups whose
    two best biased scores sum highest and picks its k among their experts only. Placing
    a group's experts on one device bounds how many devices a token's copies reach.
    The chosen weights (raw scores, renormalised if asked) are multiplied by
    ``routed_scaling_factor``: with sigmoid scores renormalised to sum to one, DeepSeek-V3
    scales the routed experts' sum against the shared expert's by 2.5.

    GPT-OSS routes by top-k of the logits, then a softmax over the k chosen logits. That is this router's
    ``softmax`` with ``renormalize``: the softmax is monotonic, so the top-k of the probabilities are the top-k
    of the logits, and ``exp(l_i) / sum_{j in top-k} exp(l_j)`` is the full softmax's p_i divided by the sum of
    the chosen p_j (the full softmax's denominator cancels). So the family needs no routing of its own, only
    the logit bias ``gate_bias`` (``moe.router_bias``); the full-softmax ``probs`` still feed the balancing loss.
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
        self.n_group, self.groups_per_token = config.n_group, config.groups_per_token
        self.routed_scaling_factor = config.routed_scaling_factor
        self.gate = nn.Parameter(torch.empty(config.num_experts, d_model))
        # GPT-OSS's learned logit bias (``moe.router_bias``): unlike ``expert_bias`` it is trained by the loss and
        # shifts the combine weights too, not only the selection
        self.gate_bias = nn.Parameter(torch.empty(config.num_experts)) if config.router_bias else None
        self.register_buffer("expert_bias", torch.zeros(config.num_experts), persistent=True)

    def forward(self, x: Tensor, expert_ids: Tensor | None = None) -> RouterOutput:
        """x: [T, D] in any dtype -> RouterOutput (all fp32 but the ids). ``expert_ids`` [T, k], when given, are the
        choices (hash routing's): the scores then only weight them."""
        x = x.float()
        if self.training and self.jitter_eps > 0:
            noise = torch.empty_like(x).uniform_(1.0 - self.jitter_eps, 1.0 + self.jitter_eps)
            x = x * noise
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = x @ self.gate.float().t()  # [T, E]
            if self.gate_bias is not None:
                logits = logits + self.gate_bias.float()
        if self.score_func == "softmax":
            scores = probs = torch.softmax(logits, dim=-1)
        else:  # DeepSeek-V3's sigmoid, or DeepSeek-V4's sqrt(softplus(l)): positive scores, each on its own
            scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else F.softplus(logits).sqrt()
            probs = scores / scores.sum(dim=-1, keepdim=True)

        if self.force_balance:  # (over hash routing's choices too)
            expert_ids = self._round_robin(x.shape[0], x.device)
        elif expert_ids is None:
            expert_ids = self.select(scores)
        weights = scores.gather(1, expert_ids)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return RouterOutput(expert_ids=expert_ids, weights=weights, probs=probs, logits=logits)

    @torch.no_grad()
    def select(self, scores: Tensor) -> Tensor:
        """The k experts of each token, best first: top-k of the biased scores within the token's best groups.

        scores: [T, E] -> [T, k] int64. Selection is not differentiable (the gradient reaches the gate through
        the gathered weights), so nothing here is kept for backward. A group's score is the sum of its two best
        biased scores (one, for groups of one expert): DeepSeek-V3's released gate, which ranks groups by
        more than their single best expert without letting a group's many weak experts outweigh a strong one.
        """
        biased = scores + self.expert_bias  # [T, E]
        if self.groups_per_token < self.n_group:
            tokens, num_experts = biased.shape
            per_group = num_experts // self.n_group
            grouped = biased.view(tokens, self.n_group, per_group)
            group_scores = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [T, n_group]
            best_groups = group_scores.topk(self.groups_per_token, dim=-1).indices  # [T, topk_group]
            allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
            biased = biased.masked_fill(~allowed.repeat_interleave(per_group, dim=1), float("-inf"))
        return torch.topk(biased, self.top_k, dim=-1).indices

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


class HashRouter(TopKRouter):
    """Hash routing (Roller et al. 2021, "Hash Layers For Large Sparse Models"; DeepSeek-V4's first MoE layers): a
    fixed table ``tid2eid`` [V, k] picks each token's k experts from its id; the learned gate's scores (the
    ``moe.score_func`` of ``TopKRouter``) still weight the chosen experts, renormalised and scaled as there.

    The table is a persistent buffer, not trained: an import brings the checkpoint's; a new model draws k distinct
    experts per token id from a generator seeded by the layer's name alone (``reset_table``), the same on every
    rank and in every layout. No balancing bias applies (``expert_bias`` stays, unused, for the state's shape).
    """

    def __init__(self, d_model: int, config: MoEConfig, vocab_size: int):
        super().__init__(d_model, config)
        self.register_buffer("tid2eid", torch.zeros(vocab_size, config.top_k, dtype=torch.long), persistent=True)

    def forward(self, x: Tensor, token_ids: Tensor) -> RouterOutput:
        """x: [T, D], token_ids: [T] -> RouterOutput, the experts those of ``tid2eid[token_ids]``."""
        return super().forward(x, self.tid2eid[token_ids])

    @torch.no_grad()
    def reset_table(self, name: str) -> None:
        """k distinct experts per token id, uniformly at random: each row the top-k of its own uniform draws."""
        generator = torch.Generator().manual_seed(chunk_seed(0, name, ()))
        vocab, rows = self.tid2eid.shape[0], 4096
        for start in range(0, vocab, rows):
            draws = torch.rand(min(rows, vocab - start), self.num_experts, generator=generator)
            self.tid2eid[start:start + rows].copy_(draws.topk(self.top_k, dim=-1).indices)
