"""The key-value cache that generation attends through (``inference/generate.py``), for every attention kind.

Generation appends one position at a time and attends to everything kept, so each new token costs one
position's projections instead of the whole prefix's (the key-value cache of Pope et al. 2022, "Efficiently
Scaling Transformer Inference", sec. 2). Keys are stored rotated: RoPE depends only on a key's own position.
Latent attention keeps its up-projected keys and values here too, as grouped-query attention does: the smaller
cache of c + r numbers per token that MLA allows (absorbing ``wkv_b`` into the queries) is not built. Sparse
attention's indexer keeps its one key per position beside them (``index_keys``): its next queries score every
kept position. Linear attention (``moe/attention/gated_delta.py``) keeps no keys: its cache is the recurrence's
state and its convolution's last inputs, the same size whatever the number of positions seen.
"""

from __future__ import annotations

import torch
from torch import Tensor


class LayerCache:
    """One attention layer's keys and values of the positions seen so far, [B, heads, S_seen, width]; or, for
    linear attention, its state [B, heads, dk, dv] and the convolution's last inputs [B, channels, kernel - 1]."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.index_keys: Tensor | None = None  # [B, S_seen, index_head_dim]: the lightning indexer's keys
        self.state: Tensor | None = None
        self.conv_inputs: Tensor | None = None
        self.seen = 0  # positions the state has taken in (linear attention)

    @property
    def length(self) -> int:
        return self.seen if self.keys is None else self.keys.shape[2]

    def advance(self, state: Tensor, new: int) -> None:
        """Linear attention: keep the state after ``new`` more positions."""
        self.state, self.seen = state, self.seen + new

    def extend(self, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Add the new positions' [B, heads, S_new, width] keys and values; return every key and value kept, and
        the boolean mask SDPA needs for queries at the new positions (None where ``is_causal`` or no mask does).

        SDPA's ``is_causal`` aligns its mask to the top left, wrong once keys outnumber queries: query i (position
        start + i) sees keys 0 .. start + i. So: the first positions, causal; one new token, every key (no mask);
        several new tokens after cached ones, this mask."""
        start, new = self.length, keys.shape[2]
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys, self.values = torch.cat((self.keys, keys), dim=2), torch.cat((self.values, values), dim=2)
        mask = None
        if start > 0 and new > 1:
            mask = torch.ones(new, start + new, dtype=torch.bool, device=keys.device).tril(diagonal=start)
        return self.keys, self.values, mask

    def extend_index(self, keys: Tensor) -> Tensor:
        """Add the new positions' indexer keys [B, S_new, d]; return every one kept [B, S_seen, d]."""
        self.index_keys = keys if self.index_keys is None else torch.cat((self.index_keys, keys), dim=1)
        return self.index_keys


class KVCache:
    """The key-value cache of a whole model: one ``LayerCache`` per attention layer, by layer name."""

    def __init__(self) -> None:
        self.layers: dict[str, LayerCache] = {}

    def layer(self, name: str) -> LayerCache:
        return self.layers.setdefault(name, LayerCache())

    @property
    def length(self) -> int:
        """Positions already in the cache: the position the next token takes."""
        return next(iter(self.layers.values())).length if self.layers else 0
