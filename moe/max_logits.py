"""Each attention head's largest pre-softmax logit, recorded for QK-clip (``training/qk_clip.py``).

QK-clip (Kimi K2 technical report, 2025, sec. 2.1 "MuonClip") rescales a head's query and key weights after an
optimizer step in which its largest logit ``S_max^h = max scale · q_i · k_j`` over the batch's allowed (query,
key) pairs went past a threshold. SDPA returns no logits, so a training forward of an attention module that
holds a ``LogitTracker`` computes them again here from its queries and keys, with no gradient, and keeps the
running maximum per head over the step's micro-batches. Without a tracker (the default) nothing is computed.

Shapes: B sequences, S positions, h query heads, hkv key heads, d channels per head.
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe.documents import Documents

# the most logits one chunk of queries holds (64 MiB in fp32): the [B, h, S, S] logits of a long sequence would not
# fit beside the step's activations, so the queries are taken a chunk of rows at a time
CHUNK_LOGITS = 1 << 24


@torch.no_grad()
def max_attention_logits(q: Tensor, k: Tensor, scale: float, window: int | None = None,
                         documents: Documents | None = None) -> Tensor:
    """The largest ``scale · q · k`` of each query head over the batch, the queries and the keys each may see.

    q [B, h, Sq, d] and k [B, hkv, Sk, d] after RoPE, at positions 0..S-1 (Sq = Sk = S), or at ``documents``'
    ``query_pos`` and ``key_pos`` (a context-parallel rank's queries against every rank's gathered keys); query
    head i reads key head ``i // (h / hkv)`` (SDPA's ``enable_gqa``). A query sees the keys at or before its
    position, within ``window`` positions when given (itself and window - 1 before), and where ``documents``' mask
    [B, 1, Sq, Sk] (packed documents) allows. An attention sink is no key and is left out: its logit is a learned
    bias, not a product of q and k. Returns [h] fp32, computed in fp32 whatever the autocast (the threshold is
    compared to the true product).
    """
    batch, heads, seq, dim = q.shape
    kv_heads, keys_len = k.shape[1], k.shape[2]
    mask = None if documents is None else documents.mask
    query_positions = torch.arange(seq, device=q.device) if documents is None else documents.query_pos
    key_pos = torch.arange(keys_len, device=q.device) if documents is None else documents.key_pos
    best = torch.full((heads,), -torch.inf, device=q.device)
    chunk = max(1, CHUNK_LOGITS // (batch * heads * keys_len))
    with torch.autocast(q.device.type, enabled=False):
        grouped = q.float().view(batch, kv_heads, heads // kv_heads, seq, dim)  # [B, hkv, g, Sq, d]
        keys = k.float().transpose(-2, -1)[:, :, None]  # [B, hkv, 1, d, Sk]
        for lo in range(0, seq, chunk):
            hi = min(seq, lo + chunk)
            logits = grouped[:, :, :, lo:hi] @ keys  # [B, hkv, g, c, Sk]
            query_pos = query_positions[lo:hi, None]
            allowed = key_pos <= query_pos  # [c, Sk]
            if window is not None:
                allowed = allowed & (key_pos > query_pos - window)
            if mask is not None:
                allowed = allowed & mask[:, :, None, lo:hi]  # [B, 1, 1, c, Sk]
            best = torch.maximum(best, logits.masked_fill_(~allowed, -torch.inf).amax(dim=(0, 3, 4)).reshape(heads))
    return best * scale  # scaled after the max: rounding is monotonic, so the same number, and one pass fewer


class LogitTracker:
    """The running per-head maximum of an attention module's logits since it was last taken.

    An attention module holding one records ``max_attention_logits`` in each training forward (evaluation and
    generation record nothing); ``training/qk_clip.py`` takes the step's maxima after the optimizer step. Under
    tensor parallelism a module holds its rank's heads only, and so does its tracker.
    """

    def __init__(self) -> None:
        self.max_logits: Tensor | None = None  # [heads here] fp32

    def record(self, logits: Tensor) -> None:
        self.max_logits = logits if self.max_logits is None else torch.maximum(self.max_logits, logits)

    def take(self) -> Tensor | None:
        """The maxima recorded since the last take (None if no forward ran), and forget them."""
        taken, self.max_logits = self.max_logits, None
        return taken
