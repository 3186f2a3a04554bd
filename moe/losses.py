"""Router balancing terms, and the autograd seam that lets them reach backward by themselves.

Shapes: T tokens, E experts, k choices per token, B sequences (T = B * S).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def load_balancing_loss(probs: Tensor, expert_ids: Tensor, num_experts: int, num_sequences: int = 1,
                        reduce_counts: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """Switch/GShard load-balancing loss ``E * sum_i f_i * P_i``.

    Switch Transformer (Fedus et al. 2022, eq. 4): ``f_i`` is the fraction of the
    router's assignments that went to expert ``i`` (counted before any capacity drop)
    and ``P_i`` the mean router probability of expert ``i``. The loss is 1 under a
    perfectly uniform router and grows as load concentrates; only ``P`` carries
    gradient. With ``num_sequences > 1`` the tokens are taken as ``[B, S]`` and the
    loss is computed per sequence and averaged (the sequence-wise balance loss of
    DeepSeek-V3, sec. 2.1.2).

    Under context parallelism a rank holds only some tokens of each sequence: ``reduce_counts`` sums the counts over
    the ranks holding the others, so ``f_i`` is the whole sequence's, while ``P_i`` stays the mean over this rank's
    tokens. The mean of the ranks' losses is then the whole sequence's loss, and each rank's gradient reaches its
    own tokens' probabilities as one process's would (times cp, which averaging the gradients over cp undoes).

    probs: [T, E] per-token probabilities summing to 1; expert_ids: [T, k].
    """
    tokens, k = expert_ids.shape
    seq_probs = probs.reshape(num_sequences, tokens // num_sequences, num_experts)
    seq_ids = expert_ids.reshape(num_sequences, -1)
    counts = torch.zeros(num_sequences, num_experts, device=probs.device, dtype=probs.dtype)
    counts.scatter_add_(1, seq_ids, torch.ones_like(seq_ids, dtype=probs.dtype))
    if reduce_counts is not None:
        counts = reduce_counts(counts)
    fraction = counts / counts.sum(dim=1, keepdim=True)  # f_i per sequence: [B, E] (each row sums to its T·k)
    mean_prob = seq_probs.mean(dim=1)  # P_i per sequence: [B, E]
    return num_experts * (fraction * mean_prob).sum(dim=1).mean()


def z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss (Zoph et al. 2022, eq. 5): mean over tokens of logsumexp(logits)^2.

    It keeps router logits small, which keeps the fp32 softmax well conditioned.
    """
    return torch.logsumexp(logits.float(), dim=-1).square().mean()


class _InjectLossGradient(torch.autograd.Function):
    """Identity on ``output`` whose backward also sends gradient ``scale`` into ``loss``.

    The balancing losses are computed deep inside an MoE layer. Rather than collecting
    them in global lists for the trainer to sum (and re-plumbing that through pipeline
    stages and activation checkpointing), the layer ties each loss to its own output:
    when backward reaches the output it starts the loss's backward too, exactly as if
    ``scale * loss`` had been added to the final objective.
    """

    @staticmethod
    def forward(ctx, output: Tensor, loss: Tensor, scale: float) -> Tensor:
        ctx.save_for_backward(loss)
        ctx.scale = scale
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.full_like(loss, ctx.scale), None


def attach_loss(output: Tensor, loss: Tensor, scale: float = 1.0) -> Tensor:
    """Return ``output`` unchanged; on backward, ``scale * loss`` contributes its gradient.

    ``scale`` is the coefficient times the trainer's loss scale (``1 / micro-batches``
    under gradient accumulation), so an injected loss is weighted exactly as the
    language-model loss it rides along with.
    """
    if not loss.requires_grad or scale == 0.0:
        return output
    return _InjectLossGradient.apply(output, loss, scale)
