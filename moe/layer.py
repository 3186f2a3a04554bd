"""The MoE layer: route -> permute -> (token exchange) -> experts -> un-permute -> combine.

Shapes: B sequences of S tokens, T = B * S, D = d_model, E experts, k choices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from config.model import ModelConfig, MoEConfig
from moe.dispatch import count_per_expert, expert_capacity, permute, plan_dispatch, unpermute_and_combine
from moe.experts import GroupedExperts, compute_dtype
from moe.feed_forward import FeedForward
from moe.losses import attach_loss, load_balancing_loss, z_loss
from moe.param_tensors import ParamTensor
from moe.router import HashRouter, TopKRouter


@dataclass
class RoutingStats:
    """One forward pass's routing, as detached tensors (no host sync until someone reads them)."""

    tokens_per_expert: Tensor  # [E] assignments the router made to each expert, before drops
    num_dropped: Tensor  # assignments dropped for lack of capacity
    num_assignments: int  # T * k
    entropy: Tensor  # mean over tokens of the router distribution's entropy (nats)
    aux_loss: Tensor  # unscaled load-balancing loss (1.0 = perfectly balanced)
    z_loss: Tensor  # unscaled router z-loss
    top1_prob: Tensor  # mean over tokens of the router's highest probability (confidence)
    choice_share: Tensor  # [k] mean share of a token's combine weight that its j-th choice carries
    coselection: Tensor | None  # [E, E] tokens that chose both experts i and j (diagonal: tokens per expert); k >= 2

    @property
    def dropped_fraction(self) -> Tensor:
        return self.num_dropped.float() / self.num_assignments


class MoELayer(nn.Module):
    """A sparse feed-forward layer: each token goes to its top-k of E experts.

    The phases, each a named step of ``forward``:

    1. **route**: ``TopKRouter`` scores experts in fp32 and picks k per token.
    2. **permute**: ``plan_dispatch`` groups assignments by expert and drops those
       beyond capacity (none when dropless); tokens are gathered in that order.
    3. **exchange + experts**: ``self.experts(grouped, tokens_per_expert)``. Locally
       the exchange is the identity; expert parallelism wraps ``self.experts`` with an
       all-to-all before and after, so this file does not change.
    4. **un-permute + combine**: each token's expert outputs, weighted by the router.

    An experts module with ``takes_routing`` set (expert parallelism's, ``parallel/expert.py``)
    replaces steps 2 (the gather) to 4: it takes the tokens, the dispatch plan and the weights
    and returns the combined output, so it can send a token once per destination rank and
    combine there. It is still called as the module (``self.experts(...)``), so FSDP's hooks
    on it run as before.
    5. shared experts (if any) see every token and are added unweighted, or with ``moe.shared_expert_gate``
       scaled by sigmoid(``shared_gate`` x) per token.

    The balancing losses ride on the output through ``attach_loss`` and so reach
    backward by themselves; ``aux_loss_scale`` is set by the trainer (1 / micro-batches
    under gradient accumulation). ``last_stats`` holds the latest pass's routing
    statistics for logging; recomputation (activation checkpointing) overwrites it
    with identical values rather than counting twice.
    """

    block_attribute = "moe"  # its name in a block (``moe/block.py``): parameter names say ``layers.i.moe.*``

    def __init__(self, d_model: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.router = TopKRouter(d_model, config)
        self.experts = GroupedExperts(config.num_experts, d_model, config.expert_hidden, config.activation,
                                      config.backend, bias=config.expert_proj_bias,
                                      swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit)
        limit = config.swiglu_limit if config.activation == "limited_swiglu" else None  # V4 clamps them too
        self.shared_experts = (FeedForward(d_model, config.shared_hidden, limit) if config.num_shared_experts
                               else None)
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if config.shared_expert_gate else None
        self.aux_loss_scale = 1.0
        # under context parallelism the balancing loss's assignment counts summed over the sequence's other ranks
        # (``parallel/context.py``); None: this rank holds whole sequences
        self.reduce_counts: Callable[[Tensor], Tensor] | None = None
        self.last_stats: RoutingStats | None = None

    @classmethod
    def for_block(cls, model: ModelConfig, moe: MoEConfig) -> MoELayer:
        """An MoE block's feed-forward."""
        return cls(model.d_model, moe)

    @staticmethod
    def parameter_tensors(model: ModelConfig, moe: MoEConfig, i: int | None) -> list[ParamTensor]:
        """What this kind costs, stated beside its forward: the router's gate [E, D] (and logit bias), the routed
        experts' stacks [E, ...] (dim 0 over ep, their hidden dim over etp: up and down, the gate where the
        activation is gated, and with ``expert_proj_bias`` their biases, the output's whole under etp), and the
        shared experts as a dense FFN of their width. Their saved activations depend on the exchange expert
        parallelism chooses (``parallel/expert.py``), so ``analysis/memory_activations.py`` states those."""
        d, e, h = model.d_model, moe.num_experts, moe.expert_hidden
        out = [ParamTensor("router", i, (e, d)), ParamTensor("experts", i, (e, d, h), expert_hidden_dim=2),
               ParamTensor("experts", i, (e, h, d), expert_hidden_dim=1)]
        if moe.gated:
            out.append(ParamTensor("experts", i, (e, d, h), expert_hidden_dim=2))
        if moe.router_bias:
            out.append(ParamTensor("router", i, (e,)))
        if moe.expert_proj_bias:
            out += [ParamTensor("experts", i, (e, h), expert_hidden_dim=1) for _ in range(1 + moe.gated)]
            out.append(ParamTensor("experts", i, (e, d)))
        if moe.num_shared_experts:
            out += FeedForward.parameter_tensors(model, moe, i, moe.shared_hidden)
        if moe.shared_expert_gate:
            out.append(ParamTensor("ffn", i, (1, d)))
        return out

    def forward(self, x: Tensor, token_ids: Tensor | None = None) -> Tensor:
        """x: [B, S, D] -> [B, S, D]; ``token_ids`` [B, S] for a hash-routed layer (``HashMoELayer``)."""
        batch, seq, dim = x.shape
        tokens = x.reshape(batch * seq, dim)
        cfg = self.config

        routed = self.router(tokens) if token_ids is None else self.router(tokens, token_ids.reshape(-1))
        capacity = None
        if cfg.capacity_factor is not None:
            capacity = expert_capacity(tokens.shape[0], cfg.top_k, cfg.num_experts, cfg.capacity_factor)
        plan = plan_dispatch(routed.expert_ids, routed.weights, cfg.num_experts, capacity, cfg.drop_policy)

        # Cast before gathering: the gather (and the all-to-all under expert parallelism)
        # then moves compute-dtype rows, which the experts need anyway. As for any tensor
        # autocast casts once and uses twice, a token's k gradients add in that dtype.
        compute_tokens = tokens.to(compute_dtype(tokens))
        if getattr(self.experts, "takes_routing", False):
            # expert parallelism's exchange (``parallel/expert.py``) permutes and combines itself: it sends a token
            # once per rank its experts live on, not once per expert
            out = self.experts(compute_tokens, plan, routed.weights)
        else:
            grouped = permute(compute_tokens, plan)
            expert_out = self.experts(grouped, plan.tokens_per_expert)
            out = unpermute_and_combine(expert_out, plan, routed.weights)
        if self.shared_experts is not None:
            shared = self.shared_experts(tokens)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(tokens)) * shared
            out = out + shared

        num_sequences = batch if cfg.aux_loss_scope == "sequence" else 1
        balance = load_balancing_loss(routed.probs, routed.expert_ids, cfg.num_experts, num_sequences,
                                      self.reduce_counts)
        router_z = z_loss(routed.logits)
        out = attach_loss(out, balance, cfg.aux_loss_coef * self.aux_loss_scale)
        out = attach_loss(out, router_z, cfg.z_loss_coef * self.aux_loss_scale)

        self.last_stats = self._stats(routed, plan.selected_per_expert, plan.num_dropped, balance, router_z)
        return out.view(batch, seq, -1)

    @torch.no_grad()
    def _stats(self, routed, selected: Tensor, dropped: Tensor, balance: Tensor, router_z: Tensor) -> RoutingStats:
        """A handful of small tensor ops per pass, all on the device: nothing here waits for the host."""
        probs, weights = routed.probs, routed.weights  # [T, E], [T, k]
        entropy = -(probs * torch.log(probs.clamp_min(1e-20))).sum(-1).mean()
        share = (weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)).mean(0)
        coselection = None
        if self.config.top_k >= 2:  # count (i, j) pairs among each token's choices; integer, so autocast-proof
            num_experts = probs.shape[1]
            pairs = routed.expert_ids[:, :, None] * num_experts + routed.expert_ids[:, None, :]  # [T, k, k]
            coselection = count_per_expert(pairs, num_experts * num_experts)
            coselection = coselection.view(num_experts, num_experts)
        return RoutingStats(
            tokens_per_expert=selected.detach(),
            num_dropped=dropped.detach(),
            num_assignments=probs.shape[0] * self.config.top_k,
            entropy=entropy,
            aux_loss=balance.detach(),
            z_loss=router_z.detach(),
            top1_prob=probs.max(-1).values.mean(),
            choice_share=share,
            coselection=coselection,
        )


class HashMoELayer(MoELayer):
    """An MoE layer whose experts the token ids pick (``HashRouter``; ``mlp_layer_types``' ``hash_moe``): the rest,
    dispatch, experts, shared experts and balancing statistics, is ``MoELayer``'s. Its forward takes the tokens'
    ids beside their states (``MoELayer.forward``'s ``token_ids``); the balancing losses still attach (their
    gradient reaches the gate through the weights) unless their coefficients are zero. Its parameters are
    ``MoELayer``'s: the table is a buffer."""

    def __init__(self, d_model: int, config: MoEConfig, vocab_size: int):
        super().__init__(d_model, config)
        self.router = HashRouter(d_model, config, vocab_size)

    @classmethod
    def for_block(cls, model: ModelConfig, moe: MoEConfig) -> HashMoELayer:
        return cls(model.d_model, moe, model.vocab_size)
