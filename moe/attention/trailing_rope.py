"""DeepSeek-V4's RoPE: interleaved pairs on the trailing channels of a head, and its compressed layers' tables.

V4 (``transformers``' ``deepseek_v4.apply_rotary_pos_emb``; DeepSeek's released inference code) lays each head out
as [content | rotary] and turns the last r channels in adjacent pairs (2i, 2i + 1), where ``moe/rope.py`` turns the
first r in pairs (i, i + r/2): the same angles (pair i by position · θ^(-2i/r)), so the model's tables serve, and a
permutation of channels apart. Turning by -angle (``inverse``) undoes a turn: V4 turns its attention output back at
the query's position, since its values are its rotated keys.

The compressed layers (``moe/attention/compressed.py``) turn by tables of their own: ``model.compressed_attention``'s
base and YaRN (``compressed_rope_tables``), with the tables unscaled (V4 leaves YaRN's attention factor at 1).

Shapes: r = ``model.rotary_dim`` rotated channels; tables [S, r/2].
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from config.model import ModelConfig
from moe.rope import rope_tables


def rotate_trailing(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Turn the last r = 2 · cos.shape[-1] channels of x [.., d] in adjacent pairs by the tables (broadcast against
    [.., r/2]), in fp32, back in x's dtype; the first d - r channels as they are. ``inverse``: by -angle."""
    rotary = 2 * cos.shape[-1]
    content, pairs = x[..., :-rotary], x[..., -rotary:].float().unflatten(-1, (-1, 2))
    even, odd = pairs.unbind(-1)
    if inverse:  # the transposed turn, written out: negating the table would make (and save) a new one
        turned = torch.stack((even * cos + odd * sin, odd * cos - even * sin), dim=-1)
    else:
        turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    turned = turned.flatten(-2)
    return torch.cat((content, turned.to(x.dtype)), dim=-1)


def compressed_rope_config(config: ModelConfig) -> ModelConfig:
    """``config`` with the compressed layers' RoPE in place of the model's (``moe.rope.rope_tables`` reads it)."""
    section = config.compressed_attention
    yarn = section.rope_scaling == "yarn"
    return dataclasses.replace(
        config, rope_theta=section.rope_theta, rope_scaling=section.rope_scaling, rope_factor=section.rope_factor,
        rope_original_seq_len=section.rope_original_seq_len, yarn_beta_fast=section.yarn_beta_fast,
        yarn_beta_slow=section.yarn_beta_slow, yarn_mscale=None, yarn_mscale_all_dim=None,
        yarn_attention_factor=1.0 if yarn else None, yarn_truncate=True)


def compressed_rope_tables(config: ModelConfig) -> tuple[Tensor, Tensor]:
    """The compressed layers' cos and sin [seq_len, r/2]."""
    return rope_tables(compressed_rope_config(config))
