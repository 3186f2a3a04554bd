"""Attention kinds: one module per kind over one kernel core (``kernel.py``), all behind ``AttentionKind``'s
interface (``base.py``).

``KINDS`` maps a layer pattern's attention kind (``config.model.LayerSpec.attention``) to its module class; each
class also states what the kind costs (parameter tensors, score width, projections, saved activations, what
context and tensor parallelism exchange for it), which ``moe/accounting.py`` and ``analysis/`` sum over the
pattern. A new kind is a new module here, an entry in ``KINDS`` and in the config's pattern
(``docs/architecture.md``, "Adding a model family").
"""

from __future__ import annotations

from config.model import LayerSpec, ModelConfig
from moe.attention.base import AttentionKind
from moe.attention.compressed import CompressedSparseAttention, HeavilyCompressedAttention
from moe.attention.gated_delta import GatedDeltaAttention
from moe.attention.grouped_query import GroupedQueryAttention
from moe.attention.latent import LatentAttention
from moe.attention.shared_kv import SharedKVAttention
from moe.attention.sparse_latent import SharedSelectionAttention, SparseLatentAttention

__all__ = ["KINDS", "AttentionKind", "CompressedSparseAttention", "GatedDeltaAttention", "GroupedQueryAttention",
           "HeavilyCompressedAttention", "LatentAttention", "SharedKVAttention", "SharedSelectionAttention",
           "SparseLatentAttention", "attention_kind", "build_attention"]

KINDS: dict[str, type[AttentionKind]] = {"grouped_query": GroupedQueryAttention, "latent": LatentAttention,
                                         "sparse_latent": SparseLatentAttention, "gated_delta": GatedDeltaAttention,
                                         "shared_selection": SharedSelectionAttention,
                                         "sliding_shared_kv": SharedKVAttention,
                                         "heavily_compressed": HeavilyCompressedAttention,
                                         "compressed_sparse": CompressedSparseAttention}


def attention_kind(layer: LayerSpec) -> type[AttentionKind]:
    """The module class of ``layer``'s attention kind."""
    return KINDS[layer.attention]


def build_attention(config: ModelConfig, layer: LayerSpec) -> AttentionKind:
    """``layer``'s attention module."""
    return attention_kind(layer)(config, layer)
