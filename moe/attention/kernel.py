"""The kernel core every attention kind runs on: which kernel computes a layer's softmax(q·kᵀ)·v, and running it.

No parameters and no modules: functions of the queries, keys and values a kind has made, the layer's options
(sliding ``window``, attention ``sinks``) and the context (generation's cache, packed documents, a context-parallel
rank's share of the sequence). ``choose_kernel`` is the one rule of which kernel runs; every attention kind calls
it through ``attend``, and the memory model asks it the same question (``moe/attention/saved.py``), so the two
cannot drift apart. The kernels:

- ``causal``: one SDPA call, causal (``is_causal``), or under generation's cache mask (``LayerCache.extend``).
- ``masked``: one SDPA under a boolean [.., Sq, K] mask: packed documents' (``moe/documents.py``), a layer's
  window and sink (``fold_in_sink``), a context-parallel rank's positions. SDPA computes every score of the mask.
- ``blocked_window``: a whole sequence at least four windows long computes only the scores near the diagonal
  (``blocked_window_attention``): O(S · 2W) instead of O(S²/2).
- ``chunks``: a context-parallel rank's whole sequences without a mask (``SequenceShards.causal_attention``).
- ``sparse``: one SDPA under the mask of each query's selected keys among the visible ones (sparse attention's
  indexer, ``moe/attention/sparse_latent.py``), a [B, 1, Sq, K] mask per sequence: every score computed.
- ``gathered``: each query's selected keys gathered and scored alone, block by block of queries
  (``moe/attention/gathered.py``): O(Sq·k) scores, on one key head (latent attention's absorbed form).
- the same two, ``masked`` or ``sparse``, over keys beyond the positions' own (DeepSeek-V4's compressed entries,
  ``attend_under_mask``), under the layer's own mask.

Shapes: B sequences, h query heads, hkv key/value heads, Sq queries, K keys, d channels per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

from config.model import ModelConfig
from moe.documents import Documents
from moe.saved_activations import FP32, INDEX, MicroBatch

CAUSAL, MASKED, BLOCKED_WINDOW, CHUNKS, SPARSE = "causal", "masked", "blocked_window", "chunks", "sparse"
GATHERED = "gathered"
# keys per selected key from which gathering each query's selected keys beats one masked SDPA over all of them
# (``benchmarks/sparse_attention.py`` measures the break-even; docs/performance.md has the table)
GATHER_RATIO = 16
SINK_CHANNELS = 8  # channels added to queries, keys and values to carry the attention sink (``fold_in_sink``)


def blocked_window(seq: int, window: int | None) -> bool:
    """Whether a whole sequence of ``seq`` positions is at least four windows long: shorter, the blocks' doubled
    keys would cost about what they save."""
    return window is not None and seq >= 4 * window


def choose_kernel(seq: int, window: int | None = None, sinks: bool = False, start: int = 0, sharded: bool = False,
                  documents_masked: bool = False, selected: int | None = None, keys: int = 0,
                  cached: bool = False, appended: bool = False) -> str:
    """The kernel a layer runs on ``seq`` queries from position ``start`` (after cached ones in generation).

    A layer with keys ``appended`` to its positions' (compressed entries: ``attend_under_mask``) attends under its
    own mask over them all, one per sequence where keys are ``selected`` per query, else one for all.
    Sparse attention keeps ``selected`` (k) of the ``keys`` (K) each query chooses among: with K <= k it keeps them
    all and attends as a dense layer would (the rules below); with K >= ``GATHER_RATIO``·k it gathers each query's
    k keys (``gathered``: cost O(Sq·k)) but in generation (``cached``: the cache holds every head's keys, not the
    latents the gathered kernel reads); otherwise it attends under the selection's mask (``sparse``: O(Sq·K)).
    A layer with a ``window`` or ``sinks`` attends under its own mask (blocked when the whole sequence is long
    enough and in one process); a context-parallel rank's queries (``sharded``) of whole sequences attend by chunks
    unless the documents carry a mask (packed documents, or a model with windowed or sink layers:
    ``attends_by_chunks``); packed documents otherwise attend under their mask; the rest causally.
    """
    if appended:
        return SPARSE if selected else MASKED
    if selected is not None and keys > selected:
        return GATHERED if keys >= GATHER_RATIO * selected and not cached else SPARSE
    if window is not None or sinks:
        return BLOCKED_WINDOW if start == 0 and not sharded and blocked_window(seq, window) else MASKED
    if sharded and not documents_masked:
        return CHUNKS
    return MASKED if documents_masked else CAUSAL


def attends_by_chunks(model: ModelConfig) -> bool:
    """Whether a context-parallel rank's whole sequences attend with no mask over the whole sequence: where every
    layer's kernel is then ``chunks`` (no layer has a window or sinks, whose kernel is ``masked``). The one rule the
    model (``moe.documents.documents_of``'s ``masked``) and the memory model's mask bytes follow; packed documents
    need the mask anyway."""
    window = model.sliding_window if model.slides else None  # some layer's window (every sliding layer's alike)
    return choose_kernel(model.seq_len, window, model.attention_sinks, sharded=True) == CHUNKS


def training_kernel(model: ModelConfig, mb: MicroBatch, window: int | None = None, sinks: bool = False,
                    selected: int | None = None, appended: bool = False) -> str:
    """The kernel a layer runs on a training micro-batch of whole sequences (packed documents' masks are not in
    the memory model), ``choose_kernel``'s answer that the kinds' ``saved_bytes`` count: a context-parallel rank's
    positions of them attend by chunks, or under the whole-sequence mask where some layer needs one; ``selected``
    keys per query (sparse attention) among the whole sequence's cp·s, and keys ``appended`` (compressed entries)
    under the layer's own."""
    sharded = mb.cp > 1
    return choose_kernel(mb.positions, window, sinks, sharded=sharded,
                         documents_masked=sharded and not attends_by_chunks(model), selected=selected,
                         keys=mb.positions * mb.cp, appended=appended)


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float, start: int = 0, window: int | None = None,
           sinks: Tensor | None = None, cache_mask: Tensor | None = None,
           documents: Documents | None = None, selected: Tensor | None = None) -> Tensor:
    """softmax(scale · q·kᵀ + mask)·v by the kernel ``choose_kernel`` picks: q [B, h, Sq, dq] at positions
    start.., k [B, hkv, K, dq], v [B, hkv, K, dv] (K = start + Sq, or every rank's gathered keys under context
    parallelism) -> [B, h, Sq, dv].

    Keys and values of other widths (latent attention's n + r against v) are zero-padded to one width, which
    changes no score (a zero channel adds nothing to q·k) and no kept output channel: SDPA's fused kernels need one
    head width, and without them it falls back to its math path, which keeps every head's [Sq, K] weights for
    backward (measured on CPU: 8.6 GB per 4,096-token sequence and layer at DeepSeek-V3's 128 heads).
    ``cache_mask``: generation's mask for several new positions after cached ones (``LayerCache.extend``).
    ``selected``: [B, 1, Sq, K] bool, the keys each query attends to, already within those it may see (sparse
    attention, where ``choose_kernel`` said ``sparse``).
    """
    seq, v_dim = q.shape[2], v.shape[-1]
    sharded = documents is not None and documents.sharded
    masked = documents is not None and documents.mask is not None
    kernel = SPARSE if selected is not None else choose_kernel(seq, window, sinks is not None, start, sharded, masked)
    q, k, v = _one_width(q, k, v)
    if kernel == SPARSE:
        out = _attend_masked(q, k, v, scale, selected, sinks)
    elif kernel == BLOCKED_WINDOW:
        out = blocked_window_attention(q, k, v, scale, window, sinks, None if documents is None else documents.ids)
    elif kernel == MASKED:
        out = _attend_masked(q, k, v, scale, _allowed(q, k, start, window, documents), sinks)
    elif kernel == CHUNKS:
        out = documents.shards.causal_attention(q, k, v, scale)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=cache_mask, is_causal=cache_mask is None and start == 0,
                                             scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[..., :v_dim]


def attend_under_mask(q: Tensor, k: Tensor, v: Tensor, scale: float, allowed: Tensor,
                      sinks: Tensor | None = None) -> Tensor:
    """softmax(scale · q·kᵀ over the ``allowed`` keys, with the layer's ``sinks``)·v for a kind whose keys go
    beyond its positions', with their mask ([Sq, K] or [B, 1, Sq, K] bool): DeepSeek-V4's compressed layers, whose
    keys are the window's positions then the compressed entries (``moe/attention/compressed.py``); the ``masked``
    or ``sparse`` kernel of ``choose_kernel``'s ``appended`` keys. One SDPA over every score of [Sq, K]: it costs
    what dense attention over the K keys costs, whatever the mask leaves out. q [B, h, Sq, d], k and v
    [B, hkv, K, d] -> [B, h, Sq, d]."""
    v_dim = v.shape[-1]
    q, k, v = _one_width(q, k, v)
    return _attend_masked(q, k, v, scale, allowed, sinks)[..., :v_dim]


def _one_width(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q, k and v zero-padded to the wider of the query/key and the value widths (``attend``)."""
    qk_dim, v_dim = q.shape[-1], v.shape[-1]
    if v_dim < qk_dim:
        v = F.pad(v, (0, qk_dim - v_dim))
    elif qk_dim < v_dim:
        q, k = F.pad(q, (0, v_dim - qk_dim)), F.pad(k, (0, v_dim - qk_dim))
    return q, k, v


def visible_keys(queries: int, keys: int, start: int, documents: Documents | None, device: torch.device) -> Tensor:
    """The keys each of ``queries`` queries may see among ``keys``, causally: [Sq, K] bool for queries at positions
    start.. against keys 0..K-1, or with ``documents`` their mask [B, 1, Sq, K] (within each document), or where
    whole sequences carry none (context parallelism) the positions' order, [Sq, K]."""
    if documents is None:
        query_pos = torch.arange(start, start + queries, device=device)
        return torch.arange(keys, device=device)[None, :] <= query_pos[:, None]
    if documents.mask is not None:
        return documents.mask
    return documents.key_pos[None, :] <= documents.query_pos[:, None]


def _allowed(q: Tensor, k: Tensor, start: int, window: int | None, documents: Documents | None) -> Tensor:
    """The boolean mask of the ``masked`` kernel: causal over positions (the documents' mask [B, 1, Sq, K] with
    ``documents``, shared by every layer; else [Sq, K] from positions start.. against 0..K-1), and the window. One
    mask shared by heads (and by sequences without documents)."""
    if documents is None:
        query_pos = torch.arange(start, start + q.shape[2], device=q.device)[:, None]
        key_pos = torch.arange(k.shape[2], device=q.device)[None, :]
        allowed = key_pos <= query_pos
    else:
        query_pos, key_pos = documents.query_pos[:, None], documents.key_pos[None, :]
        allowed = documents.mask
    if window is not None:  # a new tensor: the documents' mask is every layer's
        allowed = allowed & (key_pos > query_pos - window)
    return allowed


def blocked_window_attention(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int, sinks: Tensor | None = None,
                             ids: Tensor | None = None) -> Tensor:
    """Sliding-window attention that costs O(S · 2W) scores, not the O(S²/2) of a masked causal SDPA.

    The queries are cut into blocks of W (the window); the keys any query of block b can see lie in the
    2W positions [(b - 1)W, (b + 1)W), so each block attends to those alone, all blocks in one SDPA call
    with the blocks folded into the batch. One [W, 2W] mask pattern serves every block but the first,
    whose first W keys lie before position 0 (zero padding, masked). The sequence is padded to whole
    blocks; padded queries are dropped, and no real query sees a padded key (they come after it).
    With document ``ids`` [B, S] a query also sees only the keys of its own document: the ids are cut into the
    same blocks as the queries and keys. Padding takes id -1, never a real document's, and a padded query keeps
    itself in view, so no row of the mask is empty (SDPA would give NaN there, and NaN times a zero gradient
    still reaches the values' gradient).
    q [B, h, S, d], k and v [B, hkv, S, d] -> [B, h, S, d].
    """
    batch, heads, seq, hd = q.shape
    kv_heads = k.shape[1]
    blocks = -(-seq // window)
    pad = blocks * window - seq

    def key_blocks(x: Tensor) -> Tensor:  # [B, hkv, S, d] -> [B·nb, hkv, 2W, d]
        padded = F.pad(x, (0, 0, window, pad))  # W zero positions before, the tail to whole blocks after
        windows = padded.unfold(2, 2 * window, window)  # [B, hkv, nb, d, 2W]
        return windows.permute(0, 2, 1, 4, 3).reshape(batch * blocks, kv_heads, 2 * window, hd)

    q_blocks = F.pad(q, (0, 0, 0, pad)).view(batch, heads, blocks, window, hd).transpose(1, 2)
    q_blocks = q_blocks.reshape(batch * blocks, heads, window, hd)
    i = torch.arange(window, device=q.device)[:, None]  # query i of a block: position b·W + i
    j = torch.arange(2 * window, device=q.device)[None, :]  # key j of its block: position (b - 1)·W + j
    pattern = (j <= i + window) & (j > i)  # causal and within the window: 0 <= query - key < W
    first = pattern & (j >= window)  # block 0: keys j < W are the padding before position 0
    allowed = torch.stack([first] + [pattern] * (blocks - 1)).repeat(batch, 1, 1)[:, None]  # [B·nb, 1, W, 2W]
    if ids is not None:
        query_ids = F.pad(ids, (0, pad), value=-1).view(batch * blocks, 1, window, 1)
        key_ids = F.pad(ids, (window, pad), value=-1).unfold(1, 2 * window, window)  # [B, nb, 2W]
        allowed = allowed & (query_ids == key_ids.reshape(batch * blocks, 1, 1, 2 * window))
    out = _attend_masked(q_blocks, key_blocks(k), key_blocks(v), scale, allowed, sinks)
    out = out.reshape(batch, blocks, heads, window, hd).transpose(1, 2).reshape(batch, heads, blocks * window, hd)
    return out[:, :, :seq]


def _attend_masked(q: Tensor, k: Tensor, v: Tensor, scale: float, allowed: Tensor, sinks: Tensor | None) -> Tensor:
    """One SDPA under the boolean mask ``allowed``, with the layer's sinks folded in: q [..., h, Sq, d], k and
    v [..., hkv, K, d] -> [..., h, Sq, d]."""
    hd = q.shape[-1]
    if sinks is not None:
        q, k, v, allowed = fold_in_sink(q, k, v, allowed, sinks)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out[..., :hd]


def fold_in_sink(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor,
                 sinks: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The attention sink as one more key with a zero value, seen by every query: q [..., h, Sq, d], k and
    v [..., hkv, K, d], ``allowed`` [..., Sq, K], ``sinks`` [h] (one logit per head: GPT-OSS's) -> the same with
    d + ``SINK_CHANNELS`` wide queries, keys and values and K + 1 keys (the sink first).

    The sink's logit must be s_h for every query of head h. Each query head gets ``SINK_CHANNELS`` extra
    channels holding (s_h · sqrt(d), 0, ...); the sink key has (1, 0, ...) there and the real keys zeros,
    which leaves their logits as they were. With SDPA's scale at 1/sqrt(d) (the one kind with sinks, grouped-query
    attention, scales so) the sink's logit is exactly s_h and its
    gradient reaches ``sinks`` through the query channel: one extra key and a few channels, and no additive
    [h, S, K] mask per head. A multiple of 8 channels keeps the head width aligned for the fused kernels. The
    values are padded with zero channels to the same width (``_attend_masked`` drops them from the output): with a
    value narrower than the query, SDPA has no fused kernel on CPU and falls back to its math path, which keeps
    the whole [h, Sq, K] attention matrix in fp32 for backward (at sequence 512 and 8 heads, 11.8 MB against
    4.0 MB). Heads are counted from the tensors: a tp rank holds only its share.
    """
    hd = q.shape[-1]
    sinks = sinks.to_local() if isinstance(sinks, DTensor) else sinks  # [h] here
    sink_query = q.new_zeros(*q.shape[:-1], SINK_CHANNELS)
    sink_query[..., 0] = (sinks * hd ** 0.5).to(q.dtype)[:, None]
    q = torch.cat((q, sink_query), dim=-1)
    sink_key = k.new_zeros(*k.shape[:-2], 1, hd + SINK_CHANNELS)
    sink_key[..., hd] = 1.0
    k = torch.cat((sink_key, F.pad(k, (0, SINK_CHANNELS))), dim=-2)
    v = F.pad(torch.cat((v.new_zeros(*v.shape[:-2], 1, hd), v), dim=-2), (0, SINK_CHANNELS))
    allowed = torch.cat((allowed.new_ones(*allowed.shape[:-1], 1), allowed), dim=-1)
    return q, k, v, allowed


def kernel_saved_bytes(kernel: str, mb: MicroBatch, heads: int, kv_heads: int, width: int,
                       value_width: int | None = None, window: int | None = None, sink: bool = False,
                       appended: int = 0) -> int:
    """What ``kernel`` saves for backward in one layer on ``mb``'s positions (``choose_kernel``'s answer for it;
    ``gathered``, which reads latents and no SDPA, is counted by its one user, ``sparse_latent.gathered_kernel_bytes``):
    SDPA's q and output ([b, heads, s, width] each), k and v (every rank's s·cp keys under context parallelism,
    ``value_width`` wide where the kind stores its values otherwise: latent attention's view of its up-projection),
    the [b, heads, s] log-sum-exp (fp32), and the kernel's mask: an additive [s, K] one in the compute dtype for
    ``masked`` (shared by heads and sequences), one per block for ``blocked_window`` (b·nb blocks of W queries
    seeing 2W keys, their k and v saved per block), the chunks' own for ``chunks`` (``_chunk_extras``), one per
    sequence for ``sparse``. A sink adds one key and ``SINK_CHANNELS`` channels to q, k, v and the output;
    ``appended`` keys (compressed entries) join the positions' keys."""
    seq = mb.positions
    if kernel == BLOCKED_WINDOW:
        batches, queries, keys = mb.sequences * -(-seq // window), window, 2 * window
    else:
        batches, queries, keys = mb.sequences, seq, seq * mb.cp + appended
    keys, width = keys + int(sink), width + int(sink) * SINK_CHANNELS
    value_width = width if value_width is None else value_width
    total = batches * (queries * 2 * heads * width + keys * kv_heads * (width + value_width)) * mb.compute
    total += batches * queries * heads * FP32  # log-sum-exp
    if kernel == MASKED:
        total += queries * keys * mb.compute
    elif kernel in (SPARSE, BLOCKED_WINDOW):  # a mask per sequence (the selection) or per block of windows
        total += batches * queries * keys * mb.compute
    elif kernel == CHUNKS:
        total += _chunk_extras(mb)
    return total


def _chunk_extras(mb: MicroBatch) -> int:
    """What attending by chunks saves beyond q, k, v, the outputs and their log-sum-exps, per layer: the keys'
    order (S int64, one index for k and v) and, but on a CPU (two flash calls merged, no mask), each chunk's
    additive [C, end] mask in the compute dtype (C = S/(2·cp) queries, the keys up to the chunk's end), but for the
    first rank's front chunk, the square causal case with no mask."""
    chunk, cp = mb.positions // 2, mb.cp
    if mb.cpu:
        return 2 * cp * chunk * INDEX

    def masks(rank: int) -> int:
        ends = ((rank + 1) * chunk, (2 * cp - rank) * chunk)
        return sum(chunk * end for end in ends if end != chunk) * mb.compute

    ranks = range(cp) if mb.cp_rank is None else [mb.cp_rank]
    return 2 * cp * chunk * INDEX + max(masks(rank) for rank in ranks)
