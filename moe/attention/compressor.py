"""DeepSeek-V4's key/value compressor: one entry per ``rate`` positions, a softmax-gated sum of their projections.

For a window of positions i (DeepSeek-V4 report, sec. 2.3.1-2.3.2): C(i) = x(i)·W_kv and Z(i) = x(i)·W_z + B (a
learned bias per place in the window), and the window's entry is RMSNorm(sum_i softmax_i(Z(i)) ⊙ C(i)), the softmax
over the window's positions per channel. RoPE then turns the entry's trailing channels at the window's first
position. A query at position t may see entry w once every position that fed it is at or before t: w < (t + 1) //
rate (``visible_entries``).

Heavily compressed attention's compressor (``overlap`` false) pools windows of ``rate`` positions, one after the
other. Compressed sparse attention's (``overlap`` true) pools windows of 2 · rate, each starting ``rate`` after the
last: every position makes two projections, ``kv_proj`` and ``gate_proj`` 2·d wide, the first d channels
(series a) feeding the next entry and the last d (series b) its own, so entry w pools series a of window w - 1 and
series b of window w (entry 0's missing half takes no weight). Positions after the last whole window feed nothing
yet. The lightning indexer of compressed sparse attention compresses its own keys the same way, d = index_head_dim.

Shapes: B sequences, S positions, D = d_model, m = ``rate``, n = S // m entries, d = ``width``, r rotary channels.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe.attention.trailing_rope import rotate_trailing
from moe.norm import RMSNorm
from moe.param_tensors import ParamTensor
from moe.saved_activations import FP32, MicroBatch, norm_bytes


class Compressor(nn.Module):
    """x [B, S, D] -> its n = S // m compressed entries [B, n, d], normalised and rotated (``forward``)."""

    def __init__(self, d_model: int, width: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.width, self.rate, self.overlap = width, rate, overlap
        series = 2 if overlap else 1
        self.kv_proj = nn.Linear(d_model, series * width, bias=False)
        self.gate_proj = nn.Linear(d_model, series * width, bias=False)
        self.position_bias = nn.Parameter(torch.empty(rate, series * width))  # B: one per place in the window
        self.kv_norm = RMSNorm(width, eps=eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, S, D]; cos, sin: the compressed RoPE's tables of positions 0.. [>= S, r/2] -> [B, n, d]."""
        batch, seq, _ = x.shape
        entries, m = seq // self.rate, self.rate
        used = x[:, :entries * m]
        values = self.kv_proj(used).view(batch, entries, m, self.kv_proj.out_features)  # [B, n, m, d or 2d]
        gates = self.gate_proj(used).view(batch, entries, m, self.gate_proj.out_features) + self.position_bias
        if self.overlap:
            values, gates = self._overlapping(values, 0.0), self._overlapping(gates, float("-inf"))
        weights = torch.softmax(gates.float(), dim=2).to(values.dtype)  # over the window's positions, per channel
        pooled = self.kv_norm((weights * values).sum(dim=2))  # [B, n, d]
        starts = torch.arange(entries, device=x.device) * m
        return rotate_trailing(pooled, cos[starts], sin[starts])

    def _overlapping(self, series: Tensor, missing: float) -> Tensor:
        """[B, n, m, 2d] (series a | series b per position) -> [B, n, 2m, d]: window w - 1's series a (``missing``
        before the first window), then window w's series b."""
        previous, own = series[..., :self.width], series[..., self.width:]
        before_first = torch.full_like(previous[:, :1], missing)
        return torch.cat((torch.cat((before_first, previous[:, :-1]), dim=1), own), dim=2)


def compressor_tensors(d_model: int, width: int, rate: int, overlap: bool, i: int | None,
                       input_grad: bool = True) -> list[ParamTensor]:
    """A compressor's weights, whole on every rank: ``kv_proj`` and ``gate_proj`` [s·d, D] (s = 2 with
    ``overlap``), ``position_bias`` [m, s·d] (added, no matmul's weight: no autocast copy), ``kv_norm`` [d].
    Without ``input_grad`` (the indexer's, which reads the block input detached): no autocast copy of its weights
    is saved either."""
    series = 2 if overlap else 1
    return [ParamTensor("attention", i, (series * width, d_model), input_grad=input_grad),
            ParamTensor("attention", i, (series * width, d_model), input_grad=input_grad),
            ParamTensor("attention", i, (rate, series * width), input_grad=False), ParamTensor("norm", i, (width,))]


def compressor_saved_bytes(mb: MicroBatch, width: int, rate: int, overlap: bool, rotary: int) -> int:
    """What a compressor saves on a training micro-batch of whole sequences (its input is the block input, counted
    by the layer): the pooled values [B, n, m', d] (m' = 2m with ``overlap``: a new tensor of the two series;
    else a view of ``kv_proj``'s output) and their softmax weights, fp32 (and under bf16 their cast to the
    values' dtype too); the norm's (fused in fp32, or its fp32 upcast and output beside rstd); the RoPE tables
    at the n window starts, cos and sin [n, r/2] in fp32. Of the whole sequence (every context-parallel rank's
    positions): n = cp·s // m."""
    per_sequence = mb.positions * mb.cp // rate
    entries, slots = mb.sequences * per_sequence, (2 if overlap else 1) * rate
    total = entries * slots * width * (FP32 + mb.compute + (mb.compute if mb.bf16 else 0))
    return total + norm_bytes(entries, width, fused=not mb.bf16) + per_sequence * rotary * FP32


def visible_entries(query_pos: Tensor, entries: int, rate: int) -> Tensor:
    """[Sq, n] bool: the query at position t sees entry w when every position that fed w is at or before it,
    w < (t + 1) // rate."""
    threshold = (query_pos + 1) // rate
    return torch.arange(entries, device=query_pos.device)[None, :] < threshold[:, None]
