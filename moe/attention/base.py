"""What every attention kind shares: one interface, and the context it attends in.

A kind (``moe/attention/grouped_query.py``, ``moe/attention/latent.py``, the kinds the next families add) owns its
projections and parameters and makes its queries, keys and values; the rest is the same for all and lives here
once: the rotary tables of its positions, generation's cache, the gather of every context-parallel rank's keys, the
logit tracker of QK-clip, and the kernel (``moe/attention/kernel.py``).

The interface: ``forward(x [B, S, D], cos, sin, cache=None, documents=None) -> [B, S, D]``, with ``cos``, ``sin``
the model's rotary tables (``moe/rope.py``), ``cache`` a ``LayerCache`` in generation (``moe/kv_cache.py``) and
``documents`` the batch's packed documents or this rank's share of each sequence under context parallelism
(``moe/documents.py``, ``moe/sequence_shards.py``). Tensor parallelism's input hooks count the positional
arguments, so a block passes the cache only when there is one and the documents by name.
"""

from __future__ import annotations

from torch import Tensor, nn

from config.model import ModelConfig
from moe.documents import Documents, rotary_tables
from moe.kv_cache import LayerCache
from moe.max_logits import LogitTracker, max_attention_logits


class AttentionKind(nn.Module):
    """The base of every attention kind: the context protocol, which a kind's ``forward`` calls in its order.

    ``gather_sequence`` ([.., S / cp, C] -> [.., S, C], the ranks' positions in ``SequenceShards.key_positions``'
    order) is an identity here; ``parallel/context.py`` makes it an all-gather over the context-parallel ranks (its
    backward sums each gathered position's gradient from every rank's queries). A kind calls it, once per layer,
    on what its queries need of every position, when ``documents.sharded``.
    ``logit_tracker`` is set by QK-clip (``training/qk_clip.py``): each training forward then records every head's
    largest logit over the keys its queries may see.
    """

    # whether the kind turns its queries by the documents' rotary tables (``positions``), which the batch's
    # documents hold once for every layer: the memory model counts them where some layer does
    reads_document_tables = True

    def __init__(self) -> None:
        super().__init__()
        self.gather_sequence = nn.Identity()
        self.logit_tracker: LogitTracker | None = None

    @staticmethod
    def positions(x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None,
                  documents: Documents | None) -> tuple[int, Tensor, Tensor]:
        """The first position of x's S positions (after the cached ones in generation) and the rotary tables they
        turn by: the model's tables [L, r/2] at positions start.., or each position's place in its document."""
        start = 0 if cache is None else cache.length
        cos, sin = rotary_tables(cos, sin, start, x.shape[1], documents)
        return start, cos, sin

    def track(self, q: Tensor, k: Tensor, scale: float, cache: LayerCache | None, documents: Documents | None,
              window: int | None = None) -> None:
        """Record each head's largest logit for QK-clip, in a training forward with a tracker (not in generation):
        q [B, h, Sq, d] and k [B, hkv, K, d] after RoPE, over the keys each query may see."""
        if self.logit_tracker is not None and self.training and cache is None:
            self.logit_tracker.record(max_attention_logits(q, k, scale, window, documents))

    @classmethod
    def flops_per_token(cls, model: ModelConfig) -> float:
        """Training FLOPs of one token's scores and weighted values in one layer of this kind (the projections are
        counted with the parameters): 6 · S · nh · (qk width + v width), which is PaLM's 12 · S · nh · hd
        (Chowdhery et al. 2022, appendix B) when queries, keys and values are hd wide; each kind states its
        widths (``score_width``), and a kind that attends to fewer keys, or is no softmax attention, its own count."""
        return 6.0 * model.n_heads * cls.score_width(model) * model.seq_len

    @staticmethod
    def context_flops_per_token(model: ModelConfig, cp: int) -> float:
        """Training FLOPs per token that a layer of this kind does under ``cp`` context-parallel ranks beyond one
        process's (``flops_per_token``): none for a kind whose ranks compute their own queries' part alone."""
        return 0.0

    @classmethod
    def context_gathers(cls, model: ModelConfig, tp: int, cp: int, act: int) -> tuple[tuple[str, int], ...]:
        """What context parallelism all-gathers over the cp ranks in one forward of a layer of this kind, per
        sequence: (what, bytes of the gathered whole) each, reduce-scattered back as gradients in backward; ``act``
        the activations' bytes per element. A softmax kind gathers its keys and values of every position
        (``sequence_gather_width`` elements each, which the kind states)."""
        return (("keys and values of the sequence", model.seq_len * cls.sequence_gather_width(model, tp) * act),)

    @staticmethod
    def forward_sums(model: ModelConfig) -> tuple[tuple[str, int], ...]:
        """What a training forward sums over the tensor-parallel ranks besides the attention output, (name, fp32
        elements per query position) each: nothing but in a kind that says so."""
        return ()

    def heads_to_clip(self) -> list[tuple[Tensor, Tensor]]:
        """The tensors QK-clip scales, each with the exponent of gamma for each row of a head (``training/qk_clip.py``
        says why these): a kind's statement of where its query and key heads live."""
        raise NotImplementedError(f"{type(self).__name__} states no heads for QK-clip")
