"""Local token permutation: group assignments by expert, drop beyond capacity, un-permute and combine.

An *assignment* is one (token, choice) pair; ``T * k`` of them, numbered ``a = t * k + j``.
Shapes: T tokens, D = d_model, E experts, k choices, N kept assignments (N <= T * k).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from moe import workspace


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ``C = ceil(capacity_factor * k * T / E)`` (Switch Transformer sec. 2.2, for k choices)."""
    return math.ceil(capacity_factor * top_k * num_tokens / num_experts)


def count_per_expert(ids: Tensor, num_bins: int) -> Tensor:
    """How often each value in ``[0, num_bins)`` occurs in ``ids``: [num_bins] int64.

    ``torch.bincount`` without its host synchronisation: on CUDA bincount reads the largest id on the host to
    size its output, a sync per call on the hot path; a scatter-add into a fixed-size buffer needs none.
    """
    flat = ids.reshape(-1)
    return flat.new_zeros(num_bins).scatter_add_(0, flat, torch.ones_like(flat))


@dataclass
class DispatchPlan:
    """Where each kept assignment goes; computed once, used to permute and to combine."""

    order: Tensor  # [N] assignment ids grouped by expert (expert-major); rows of the grouped tensor
    token_index: Tensor  # [N] the token each grouped row reads (order // k)
    assignment_row: Tensor  # [T*k] the grouped row holding each assignment; N where it was dropped
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
    selected = count_per_expert(flat_ids, num_experts)
    if capacity is not None and drop_policy == "probability":
        order = torch.argsort(_expert_then_weight_key(flat_ids, weights.reshape(-1)), stable=True)
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
    num_kept = order.numel()
    assignment_row = order.new_full((flat_ids.numel(),), num_kept)
    assignment_row[order] = torch.arange(num_kept, device=order.device)
    return DispatchPlan(
        order=order,
        token_index=torch.div(order, top_k, rounding_mode="floor"),
        assignment_row=assignment_row,
        tokens_per_expert=kept,
        selected_per_expert=selected,
        num_dropped=num_dropped,
    )


def _expert_then_weight_key(flat_ids: Tensor, flat_weights: Tensor) -> Tensor:
    """One int64 sort key per assignment that a stable sort puts expert-major and, within an expert, by
    combine weight, highest first (ties by position): one sort instead of a sort by weight and another by
    expert (on the CPU ``moe-8x`` step each of the two was about as costly as the whole key).

    The weights are the router's, non-negative; as fp32 (the router's dtype) they order like their bit
    patterns read as int32, so ``2³¹ − 1 − bits`` orders them highest first in the key's low 31 bits. Adding
    0.0 turns a -0.0 into +0.0.
    """
    bits = (flat_weights.float() + 0.0).view(torch.int32).to(torch.int64)
    return flat_ids.to(torch.int64) * 2**31 + (2**31 - 1 - bits)


def permute(x: Tensor, plan: DispatchPlan) -> Tensor:
    """Tokens grouped by expert: [T, D] -> [N, D] (a token appears once per kept choice). See ``_Permute``."""
    return _Permute.apply(x, plan.token_index, plan.assignment_row)


class _Permute(torch.autograd.Function):
    """``x[token_index]``, with a backward that gathers each token's gradient rather than scatter-adding it.

    A token's gradient is the sum of its kept rows' gradients. ``index_select``'s own backward adds them
    with ``index_add``, a scatter: in bf16 on CPU about 4x the time of gathering the same rows (the
    standard layer's [8192, 512] rows into [4096, 512], timed in one process), and on CUDA its atomics
    make the order of the sum, so the result, vary between runs. Here each token gathers its k rows in
    choice order, as the combine's forward does (dropped assignments read a zero row): deterministic.
    """

    @staticmethod
    def forward(ctx, x, token_index, assignment_row):
        ctx.save_for_backward(assignment_row)
        ctx.num_tokens = x.shape[0]
        return workspace.gather_rows(x, token_index)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_rows):
        (assignment_row,) = ctx.saved_tensors
        num_rows = grad_rows.shape[0]
        if num_rows < assignment_row.numel():  # some assignments were dropped: they point at an extra zero row
            grad_rows = torch.cat([grad_rows, grad_rows.new_zeros(1, grad_rows.shape[1])])
        return sum_choices(grad_rows, assignment_row.view(ctx.num_tokens, -1)), None, None


def sum_choices(grouped: Tensor, rows: Tensor) -> Tensor:
    """``out[t] = sum_j grouped[rows[t, j]]``, added in choice order: a gather, not a scatter-add, so the sum
    is the same on every run and device. ``rows`` [T, k]; a dropped assignment points at a zero row."""
    out = workspace.gather_rows(grouped, rows[:, 0])
    for choice in range(1, rows.shape[1]):
        out += grouped.index_select(0, rows[:, choice])
    return out


def unpermute_and_combine(expert_out: Tensor, plan: DispatchPlan, weights: Tensor) -> Tensor:
    """Weighted sum of each token's expert outputs: [N, D] -> [T, D] in ``expert_out``'s dtype.

    ``out[t] = sum_j weights[t, j] * expert_out[row of (t, j)]``, a dropped assignment
    contributing exactly nothing (and receiving no gradient). See ``_WeightedCombine``.
    """
    return _WeightedCombine.apply(expert_out, weights, plan.order, plan.token_index, plan.assignment_row)


class _WeightedCombine(torch.autograd.Function):
    """The combine as one autograd node: in bf16 every pass over [N, D] shows.

    Forward scales each grouped row by its weight, into a buffer with one extra zero
    row that dropped assignments point at, then gathers each token's k rows and adds
    them in choice order: a gather, not a scatter-add, so the sum is deterministic on
    every device. Backward gathers the output gradient once per grouped row and
    derives both gradients from it; the weight gradients are dot products over D
    (accumulated in fp32 inside the reduction). Written with autograd ops, the same
    maths needs a zero-filled [T*k, D] slot buffer, a batched matmul of k-row
    matrices and their backward: two to three times the time on CPU.
    """

    @staticmethod
    def forward(ctx, expert_out, weights, order, token_index, assignment_row):
        num_tokens, top_k = weights.shape
        num_rows, dim = expert_out.shape
        grouped_weights = weights.reshape(-1).index_select(0, order).to(expert_out.dtype)  # [N]
        scaled = workspace.empty((num_rows + 1, dim), expert_out.dtype, expert_out.device)
        torch.mul(expert_out, grouped_weights.unsqueeze(1), out=scaled[:num_rows])
        scaled[num_rows] = 0  # what dropped assignments read
        out = sum_choices(scaled, assignment_row.view(num_tokens, top_k))
        ctx.save_for_backward(expert_out, grouped_weights, order, token_index)
        ctx.weights_shape, ctx.weights_dtype = weights.shape, weights.dtype
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        expert_out, grouped_weights, order, token_index = ctx.saved_tensors
        grad_rows = workspace.gather_rows(grad_out, token_index)  # [N, D]: d out[t] for each grouped row
        grad_expert_out = grad_weights = None
        if ctx.needs_input_grad[0]:
            grad_expert_out = torch.mul(grad_rows, grouped_weights.unsqueeze(1), out=workspace.empty(
                grad_rows.shape, grad_rows.dtype, grad_rows.device))
        if ctx.needs_input_grad[1]:
            grad_grouped = grad_rows.mul_(expert_out).sum(-1).to(ctx.weights_dtype)  # [N]; grad_rows is spent
            grad_weights = grad_grouped.new_zeros(ctx.weights_shape.numel())  # zero for dropped assignments
            grad_weights = grad_weights.index_copy_(0, order, grad_grouped).view(ctx.weights_shape)
        return grad_expert_out, grad_weights, None, None, None
