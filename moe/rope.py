"""Rotary position embedding (RoPE), plain or stretched by YaRN.

Shapes: S positions, r = the rotated channels of a head (``ModelConfig.rope_dim``).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from config.model import ModelConfig


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature sqrt(1/t) = 0.1 · mscale · ln(s) + 1 for a context stretched s times
    (Peng et al. 2023, sec. 3.4, eq. 22; ``mscale`` is DeepSeek's coefficient on ln s). 1 when not stretched."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(config: ModelConfig) -> float:
    """The scale YaRN puts on the rotary tables (so on every q·k through them, squared).

    Given outright (``yarn_attention_factor``), or DeepSeek's ratio mscale(s, yarn_mscale) / mscale(s,
    yarn_mscale_all_dim) when both are set (1 for DeepSeek-V3, whose two are equal: it scales the softmax
    instead, ``latent_softmax_scale``), else the paper's mscale(s).
    """
    if config.yarn_attention_factor is not None:
        return config.yarn_attention_factor
    if config.yarn_mscale and config.yarn_mscale_all_dim:
        return (yarn_mscale(config.rope_factor, config.yarn_mscale)
                / yarn_mscale(config.rope_factor, config.yarn_mscale_all_dim))
    return yarn_mscale(config.rope_factor)


def yarn_inverse_frequencies(config: ModelConfig) -> Tensor:
    """YaRN's "NTK-by-parts" frequencies [r/2] (Peng et al. 2023, sec. 3.2, eqs. 17-19).

    A pair i of channels turns 2π·L/λ_i times over the pretraining context L. Pairs that turn more than
    ``yarn_beta_fast`` times keep their frequency (extrapolation is safe: they have seen every phase), pairs that
    turn fewer than ``yarn_beta_slow`` times are interpolated (frequency / s), and those between blend linearly.
    The pair index where a pair turns b times is r·ln(L / (2πb)) / (2·ln θ); the bounds are rounded outward
    (floor, ceil) and clamped to the pairs, as the released YaRN and DeepSeek-V3 code do, or with
    ``yarn_truncate`` false (GPT-OSS) kept fractional and only clamped, so the ramp starts and ends between pairs.
    """
    dim, base, factor = config.rope_dim, config.rope_theta, config.rope_factor
    original = config.rope_original_seq_len

    def pair_turning(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(config.yarn_beta_fast), pair_turning(config.yarn_beta_slow)
    if config.yarn_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-pair ramp: keep the division finite
    extrapolated = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    interpolated_share = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return extrapolated / factor * interpolated_share + extrapolated * (1 - interpolated_share)


def rope_tables(config: ModelConfig) -> tuple[Tensor, Tensor]:
    """cos and sin of the rotary angles, [seq_len, r/2] (Su et al. 2021, RoFormer eq. 34), YaRN's frequencies
    and scale where ``rope_scaling`` is yarn."""
    dim = config.rope_dim
    if config.rope_scaling == "yarn":
        inv_freq, scale = yarn_inverse_frequencies(config), yarn_attention_factor(config)
    else:
        inv_freq, scale = 1.0 / config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim), 1.0
    angles = torch.outer(torch.arange(config.seq_len, dtype=torch.float32), inv_freq)
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale


def apply_partial_rope(x: Tensor, cos: Tensor, sin: Tensor, rotary: int) -> Tensor:
    """RoPE on the first ``rotary`` channels of x [.., d] (``apply_rope``'s pairs), the rest as they are: partial
    rotary (GLM's heads, the lightning indexer's); x whole, with no copy of the rest, when ``rotary`` is d."""
    if rotary == x.shape[-1]:
        return apply_rope(x, cos, sin)
    rotated, kept = x.split([rotary, x.shape[-1] - rotary], dim=-1)
    return torch.cat((apply_rope(rotated, cos, sin), kept), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + r/2) of x: [B, heads, S, r] by the position's angles, in fp32 (or x's wider
    dtype), back in x's dtype. ``cos`` and ``sin`` are constants (no gradient); they broadcast against x's halves."""
    return _Rotate.apply(x, cos, sin)


class _Rotate(torch.autograd.Function):
    """RoPE with its backward written out: the gradient is the transposed rotation of the output's gradient
    (turning by -angle; with YaRN's scaled tables the same transpose), so backward saves nothing but the
    tables and makes one pass, where autograd through the split, the four products and the concatenation made
    about ten, and one fp32 pass fewer forward (the halves written in place). On the CPU ``moe-8x`` step RoPE
    was the heaviest part of attention outside SDPA and the projections (``benchmarks/train_step.py``)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        ctx.save_for_backward(cos, sin)
        return _turn(x, cos, sin, inverse=False)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _turn(grad, cos, sin, inverse=True), None, None


def _turn(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    """(a, b) -> (a·cos - b·sin, a·sin + b·cos) on x's halves a and b, or the transpose with ``inverse``, in
    fp32 at least; the result in x's dtype."""
    compute = torch.promote_types(x.dtype, torch.float32)
    first, second = x.to(compute).chunk(2, dim=-1)
    out = torch.empty(first.shape[:-1] + (2 * first.shape[-1],), dtype=compute, device=x.device)
    low, high = out.chunk(2, dim=-1)
    sign = 1 if inverse else -1
    torch.mul(first, cos, out=low).addcmul_(second, sin, value=sign)
    torch.mul(second, cos, out=high).addcmul_(first, sin, value=-sign)
    return out.to(x.dtype)
