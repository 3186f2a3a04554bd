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
yet; in generation they wait in the cache until their window closes (``moe/kv_cache.py``'s ``CompressorCache``:
each entry is made once, from the projections kept). The lightning indexer of compressed sparse attention
compresses its own keys the same way, d = index_head_dim.

Shapes: B sequences, S positions, D = d_model, m = ``rate``, n = S // m entries, d = ``width``, r rotary channels.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from moe.attention.trailing_rope import rotate_trailing
from moe.kv_cache import CompressorCache
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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: CompressorCache | None = None) -> Tensor:
        """x [B, S, D]; cos, sin: the compressed RoPE's tables of positions 0.. [>= S, r/2] -> [B, n, d].

        In generation x is the new positions, and ``cache`` keeps the open window's projections and the entries
        (``moe/kv_cache.py``): the result is every entry made so far, each made once, when its window closes."""
        if cache is None:
            used = x[:, :x.shape[1] // self.rate * self.rate]  # the whole windows' positions
            return self.pool(self.kv_proj(used), self.gate_proj(used), 0, None, cos, sin)[0]
        values, gates, first = cache.whole_windows(self.kv_proj(x), self.gate_proj(x), self.rate)  # [B, S, s·d]
        entries, previous = self.pool(values, gates, first, cache.previous, cos, sin)
        return cache.add(entries, previous)

    def pool(self, values: Tensor, gates: Tensor, first: int, previous: tuple[Tensor, Tensor] | None, cos: Tensor,
             sin: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """The entries [B, k, d] of k whole windows' values and gates [B, k·m, s·d] (before the position bias),
        the first being window ``first``; and, overlapping, the last window's series a (values and biased gates
        [B, 1, m, d]) for the entry after them (None when k = 0 or the windows do not overlap). ``previous``: the
        series a of window ``first`` - 1 (None: nothing before, which takes no weight)."""
        batch, entries, m = values.shape[0], values.shape[1] // self.rate, self.rate
        values = values.view(batch, entries, m, self.kv_proj.out_features)  # [B, k, m, d or 2d]
        gates = gates.view(batch, entries, m, self.gate_proj.out_features) + self.position_bias
        last = None
        if self.overlap:
            if entries > 0:
                last = values[:, -1:, :, :self.width].clone(), gates[:, -1:, :, :self.width].clone()
            before = previous or (values.new_zeros(batch, 1, m, self.width),
                                  gates.new_full((batch, 1, m, self.width), float("-inf")))
            values, gates = self._overlapping(values, before[0]), self._overlapping(gates, before[1])
        weights = torch.softmax(gates.float(), dim=2).to(values.dtype)  # over the window's positions, per channel
        pooled = self.kv_norm((weights * values).sum(dim=2))  # [B, k, d]
        starts = (first + torch.arange(entries, device=values.device)) * m
        return rotate_trailing(pooled, cos[starts], sin[starts]), last

    def _overlapping(self, series: Tensor, before: Tensor) -> Tensor:
        """[B, k, m, 2d] (series a | series b per position) -> [B, k, 2m, d]: window w - 1's series a (``before``
        [B, 1, m, d] for the first window), then window w's series b."""
        previous, own = series[..., :self.width], series[..., self.width:]
        before = before[:, :series.shape[1]].to(previous.dtype)  # none where there is no window
        return torch.cat((torch.cat((before, previous[:, :-1]), dim=1), own), dim=2)


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
