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


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + r/2) of x: [B, heads, S, r] by the position's angles."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return rotated.to(x.dtype)
