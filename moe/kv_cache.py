"""The key-value cache that generation attends through (``inference/generate.py``), for every attention kind.

Generation appends one position at a time and attends to everything kept, so each new token costs one
position's projections instead of the whole prefix's (the key-value cache of Pope et al. 2022, "Efficiently
Scaling Transformer Inference", sec. 2). Keys are stored rotated: RoPE depends only on a key's own position.
Latent attention keeps its up-projected keys and values here too, as grouped-query attention does: the smaller
cache of c + r numbers per token that MLA allows (absorbing ``wkv_b`` into the queries) is not built. Sparse
attention's indexer keeps its one key per position beside them (``index_keys``): its next queries score every
kept position. Linear attention (``moe/attention/gated_delta.py``) keeps no keys: its cache is the recurrence's
state and its convolution's last inputs, the same size whatever the number of positions seen.

DeepSeek-V4's layers (``moe/attention/shared_kv.py``, ``compressed.py``) keep what their next queries can reach, as
DeepSeek's released inference code and ``transformers``' ``DeepseekV4HCACache``/``DeepseekV4CSACache`` do: the
last ``sliding_window`` - 1 positions of the one shared key/value head (``slide``), and per compressor (the layer's,
and compressed sparse attention's indexer's) a ``CompressorCache``: the entries made so far, the projections of
the positions after the last whole window (the open window: no entry yet), and, for overlapping windows, the last
whole window's first series, which the next entry pools. So a step costs O(window + positions / rate), not a
recompute of the layer over every position.

The cache holds the sequences it began with: a call with another number of them is refused by name (the rows of
a batch share their positions, so a batch of prompts is prompts of one length: the model has no padding mask).
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_batch(new: Tensor, kept: Tensor | None) -> None:
    """Refuse new positions of another number of sequences than the cache holds."""
    if kept is not None and new.shape[0] != kept.shape[0]:
        raise ValueError(f"the key-value cache holds {kept.shape[0]} sequences and this call continues "
                         f"{new.shape[0]}: a cache serves the batch it began with (start a new KVCache)")


class LayerCache:
    """One attention layer's keys and values of the positions seen so far, [B, heads, S_seen, width]; or, for
    linear attention, its state [B, heads, dk, dv] and the convolution's last inputs [B, channels, kernel - 1]."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None
        self.index_keys: Tensor | None = None  # [B, S_seen, index_head_dim]: the lightning indexer's keys
        self.state: Tensor | None = None
        self.conv_inputs: Tensor | None = None
        self.sliding_keys: Tensor | None = None  # [B, 1, < window, hd]: DeepSeek-V4's last positions' key/value head
        self.compressors: dict[str, CompressorCache] = {}  # DeepSeek-V4's compressors' states, by compressor
        self.seen = 0  # positions taken in (linear attention's state, DeepSeek-V4's window)

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
        check_batch(keys, self.keys)
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys, self.values = torch.cat((self.keys, keys), dim=2), torch.cat((self.values, values), dim=2)
        mask = None
        if start > 0 and new > 1:
            mask = torch.ones(new, start + new, dtype=torch.bool, device=keys.device).tril(diagonal=start)
        return self.keys, self.values, mask

    def slide(self, keys: Tensor, window: int) -> Tensor:
        """Add the new positions' [B, heads, S_new, width] keys within a sliding ``window``: return the kept ones
        then the new ones (every key a new query may see, and more for all but the last query), and keep the last
        window - 1 for the next call, which is all its first query reaches back to."""
        check_batch(keys, self.sliding_keys)
        every = keys if self.sliding_keys is None else torch.cat((self.sliding_keys, keys), dim=2)
        self.sliding_keys = every[:, :, max(0, every.shape[2] - (window - 1)):].clone()  # not a view of all of them
        self.seen += keys.shape[2]
        return every

    def compressor(self, name: str) -> CompressorCache:
        """The state of this layer's compressor ``name`` (made empty on first use)."""
        return self.compressors.setdefault(name, CompressorCache())

    def extend_index(self, keys: Tensor) -> Tensor:
        """Add the new positions' indexer keys [B, S_new, d]; return every one kept [B, S_seen, d]."""
        self.index_keys = keys if self.index_keys is None else torch.cat((self.index_keys, keys), dim=1)
        return self.index_keys


class CompressorCache:
    """One DeepSeek-V4 compressor's state (``moe/attention/compressor.py``): one entry per ``rate`` positions, made
    once its window is whole.

    ``entries`` [B, n, d]: made so far, normalised and rotated. ``open_window``: the values and gates (before the
    position bias) [B, p < rate, s·d] of the positions after the last whole window. ``previous``: overlapping
    windows' last whole window's series a, values and gates (with its position bias) [B, 1, rate, d], which the
    next entry pools beside its own series b. Each whole window made one entry, so the next window's index is the
    number of entries."""

    def __init__(self) -> None:
        self.entries: Tensor | None = None
        self.open_window: tuple[Tensor, Tensor] | None = None
        self.previous: tuple[Tensor, Tensor] | None = None

    def whole_windows(self, values: Tensor, gates: Tensor, rate: int) -> tuple[Tensor, Tensor, int]:
        """Add the new positions' values and gates [B, S_new, s·d]; return those of the windows now whole
        [B, k · rate, s·d] (k >= 0) and the first one's index, and keep the rest open."""
        if self.open_window is not None:
            check_batch(values, self.open_window[0])
            values = torch.cat((self.open_window[0], values), dim=1)
            gates = torch.cat((self.open_window[1], gates), dim=1)
        whole = values.shape[1] // rate * rate
        self.open_window = values[:, whole:].clone(), gates[:, whole:].clone()  # not views of all of them
        first = 0 if self.entries is None else self.entries.shape[1]
        return values[:, :whole], gates[:, :whole], first

    def add(self, entries: Tensor, previous: tuple[Tensor, Tensor] | None) -> Tensor:
        """Keep the new ``entries`` [B, k, d] after the others, and the last whole window's series a
        (``previous``, None when no window closed or they do not overlap); return every entry [B, n, d]."""
        self.entries = entries if self.entries is None else torch.cat((self.entries, entries), dim=1)
        if previous is not None:
            self.previous = previous
        return self.entries


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
