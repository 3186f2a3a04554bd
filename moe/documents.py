"""Document masking for packed sequences: each token attends only within its own document, and its rotary
position counts from that document's start.

Pretraining packs documents end to end into fixed-length windows. Plain causal attention lets a token attend to
the unrelated documents before it in the window; with ``data.document_mask`` it does not, so every document is
computed as if it were alone. Llama 3 pretraining masks this way (Dubey et al. 2024, arXiv:2407.21783, sec. 3.2:
"an attention mask that prevents self-attention between different documents within the same sequence");
Megatron-LM's GPT datasets have the same mask (``reset_attention_mask``) and, beside it, position ids that restart
after each end of document (``reset_position_ids``), as here. With RoPE a score depends only on the difference of
two positions (Su et al. 2021, RoFormer sec. 3.2), so under the mask the restart changes no logit but by
rounding: a document is rotated by exactly the angles it gets alone.

The documents are read from the tokens themselves: a document ends at (and includes) the end-of-document token
(``data.document_end``), so the token after it starts the next. The window's first tokens may be the tail of a
document that began before it: they form document 0 with positions from 0, as that tail alone would be.
Reading them from the tokens needs no state beside the batch: no change to the token cache, the sampler or its
checkpointed state, and the validation windows are treated exactly as the training ones. The price: the end token
must be one token that means nothing else (``data/tokenizer.py``: ``document_end_token``).

Under context parallelism (``moe/sequence_shards.py``) a rank holds only some positions of each sequence as
queries, and the keys of all of them gathered from every rank: the same structure then carries that rank's rows of
the mask, over the keys in their gathered order, and the rotary tables of its own positions. A batch without
document masking is then one document per sequence, so that there is one way to attend to a sequence's shards.

Shapes: B sequences, S positions, Sq of them this rank's queries (S without context parallelism), r/2 rotary
frequencies.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from moe.sequence_shards import SequenceShards


class Documents(NamedTuple):
    """A batch's documents as attention needs them, made once per forward pass and shared by every layer.

    One mask for all layers also means one [B, 1, S, S] tensor saved for backward, not one per layer. A named
    tuple, so the machinery that walks a block's arguments (FSDP's input casts, activation checkpointing,
    compile) sees its tensors.
    """

    ids: Tensor  # [B, S] int64: the document each position belongs to, counted from the window's first
    cos: Tensor  # [B, 1, Sq, r/2]: the rotary tables at each query's place in its document
    sin: Tensor
    # [B, 1, Sq, S] bool: query i may see key j (j at or before i, in the same document); None for a
    # context-parallel rank's shards of whole sequences that no layer masks (``SequenceShards.causal_attention``)
    mask: Tensor | None
    query_pos: Tensor  # [Sq]: the queries' positions in the sequence (0 .. S - 1 without context parallelism)
    key_pos: Tensor  # [S]: the keys' positions, in the order attention sees them
    shards: SequenceShards | None = None  # the context-parallel cut the queries come from

    @property
    def sharded(self) -> bool:
        """Whether the queries are a context-parallel rank's shard of the sequence (not all of it, in order)."""
        return self.shards is not None


def document_ids(tokens: Tensor, end_id: int) -> Tensor:
    """tokens [B, S] -> [B, S]: the number of documents that ended before each position (its end token
    belongs to the document it ends)."""
    ends = (tokens == end_id).long()
    return ends.cumsum(dim=1) - ends


def document_positions(ids: Tensor) -> Tensor:
    """ids [B, S] -> [B, S]: each position's distance from the first position of its document."""
    index = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return index - torch.where(starts, index, 0).cummax(dim=1).values


def documents_of(ids: Tensor, cos_table: Tensor, sin_table: Tensor, shards: SequenceShards | None = None,
                 masked: bool = True) -> Documents:
    """What attention needs from ``ids`` [B, S] (the whole sequences' ids); ``cos_table``, ``sin_table``: the model's
    rotary tables [L, r/2]. With ``shards`` the queries are this context-parallel rank's positions and the keys every
    rank's, in the order their all-gather delivers them; ``masked`` false (whole sequences, and no layer with a
    window or sinks) leaves the mask out: at 128k positions and cp = 8 it would be 2 GiB."""
    seq = ids.shape[1]
    query_pos = torch.arange(seq, device=ids.device) if shards is None else shards.positions(seq, ids.device)
    key_pos = torch.arange(seq, device=ids.device) if shards is None else shards.key_positions(seq, ids.device)
    positions = document_positions(ids)[:, query_pos]
    mask = None
    if masked:
        mask = ((ids[:, query_pos, None] == ids[:, None, key_pos]) & (key_pos[None, :] <= query_pos[:, None]))[:, None]
    return Documents(ids, cos_table[positions][:, None], sin_table[positions][:, None], mask, query_pos, key_pos,
                     shards)


def rotary_tables(cos: Tensor, sin: Tensor, start: int, seq: int,
                  documents: Documents | None) -> tuple[Tensor, Tensor]:
    """The rotary tables an attention layer turns its S queries and keys by: the model's tables [L, r/2] at
    positions start .. start + S - 1, or with ``documents`` each position's place in its document [B, 1, S, r/2]."""
    if documents is None:
        return cos[start:start + seq], sin[start:start + seq]
    return documents.cos, documents.sin
