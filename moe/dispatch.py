"""Local token permutation: group assignments by expert, drop beyond capacity, un-permute and combine.

An *assignment* is one (token, choice) pair; ``T * k`` of them, numbered ``a = t * k + j``.
Shapes: T tokens, D = d_model, E experts, k choices, N kept assignments (N <= T * k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ``C = ceil(capacity_factor * k * T / E)`` (Switch Transformer sec. 2.2, for k choices)."""
    return math.ceil(capacity_factor * top_k * num_tokens / num_experts)


@dataclass
class DispatchPlan:
    """Where each kept assignment goes; computed once, used to permute and to combine."""

    order: Tensor  # [N] assignment ids grouped by expert (expert-major); rows of the grouped tensor
    token_index: Tensor  # [N] the token each grouped row reads (order // k)
    tokens_per_expert: Tensor  # [E] int64: kept assignments per expert (the grouped-GEMM group sizes)
    selected_per_expert: Tensor  # [E] int64: assignments the router made per expert, before any drop
    num_dropped: Tensor  # scalar int64: assignments beyond capacity


def plan_dispatch(
    expert_ids: Tensor,
    weights: Tensor,
    num_experts: int,
    capacity: int | None,
    drop_policy: str = "probability",
) -> DispatchPlan:
    """Group the router's assignments by expert, keeping at most ``capacity`` per expert.

    Within an expert, assignments are ordered by priority and the first ``capacity``
    are kept: ``probability`` keeps the highest combine weights (ties by position),
    ``position`` keeps the earliest tokens (Switch Transformer's behaviour). A dropped
    assignment contributes nothing; the residual connection around the MoE layer
    still carries its token. ``capacity=None`` is dropless: every assignment is kept
    and the groups have whatever sizes the router produced.

    expert_ids: [T, k] int64; weights: [T, k].
    """
    top_k = expert_ids.shape[1]
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    selected = torch.bincount(flat_ids, minlength=num_experts)
    if capacity is not None and drop_policy == "probability":
        # stable sort by weight (descending), then stable sort by expert: expert-major, best first
        by_weight = torch.argsort(weights.reshape(-1), descending=True, stable=True)
        order = by_weight[torch.argsort(flat_ids[by_weight], stable=True)]
    else:
        order = torch.argsort(flat_ids, stable=True)  # expert-major, position order within an expert

    if capacity is None:
        kept, num_dropped = selected, selected.new_zeros(())
    else:
        group_start = torch.cumsum(selected, 0) - selected  # [E]
        rank_in_expert = torch.arange(order.numel(), device=order.device) - group_start[flat_ids[order]]
        keep = rank_in_expert < capacity
        order = order[keep]
        kept = selected.clamp(max=capacity)
        num_dropped = flat_ids.numel() - kept.sum()
    return DispatchPlan(
        order=order,
        token_index=torch.div(order, top_k, rounding_mode="floor"),
        tokens_per_expert=kept,
        selected_per_expert=selected,
        num_dropped=num_dropped,
    )


def permute(x: Tensor, plan: DispatchPlan) -> Tensor:
    """Tokens grouped by expert: [T, D] -> [N, D] (a token appears once per kept choice)."""
    return x.index_select(0, plan.token_index)


def unpermute_and_combine(expert_out: Tensor, plan: DispatchPlan, weights: Tensor) -> Tensor:
    """Weighted sum of each token's expert outputs: [N, D] -> [T, D].

    Results are written back to their assignment slots ([T*k, D], zero where dropped)
    and reduced with one batched matmul, ``out[t] = sum_j weights[t, j] * slot[t, j]``.
    This is deterministic (no scatter-add races on GPU) and gives the gradient of the
    combine weights for free.
    """
    num_tokens, top_k = weights.shape
    dim = expert_out.shape[-1]
    slots = expert_out.new_zeros(num_tokens * top_k, dim).index_copy(0, plan.order, expert_out)
    combined = torch.bmm(weights.to(expert_out.dtype).unsqueeze(1), slots.view(num_tokens, top_k, dim))
    return combined.squeeze(1)
