"""The checks of the model's DeepSeek Sparse Attention keys (``model.index_topk``, ``index_n_heads``,
``index_head_dim``, GLM-5's ``indexer_types``; the module is ``moe/attention/sparse_latent.py``), kept beside
``config/model.py`` so that module stays about the transformer's shape."""

from __future__ import annotations

from config.schema import require


def validate_sparse_attention(model) -> None:
    """Refuse impossible sparse-attention settings of ``model`` (a ``config.model.ModelConfig``) before any tensor
    exists."""
    if not model.sparse_attention:
        given = [key for key in ("index_n_heads", "index_head_dim", "indexer_types") if getattr(model, key) is not None]
        require(not given, f"model.{given[0] if given else ''} is a sparse-attention setting: it needs "
                           "model.index_topk (null: dense attention)")
        return
    require(model.latent_attention and model.q_lora_rank is not None,
            "model.index_topk: sparse attention's indexer reads latent attention's query latent; set "
            "model.kv_lora_rank and model.q_lora_rank (DeepSeek-V3.2: 512 and 1536), or leave index_topk null")
    require_indexer_sizes(model, "sparse attention (model.index_topk set)",
                          "DeepSeek-V3.2: index_topk 2048, index_n_heads 64, index_head_dim 128",
                          "qk_rope_head_dim", "the indexer's rotary channels")
    types = model.indexer_types
    require(types is None or (len(types) == model.n_layers and set(types) <= {"full", "shared"}
                              and types[0] == "full"),
            f"model.indexer_types={types!r}: one 'full' or 'shared' per layer ({model.n_layers}), the first "
            "'full' (a shared layer attends to the keys the full layer before it selected)")


def require_indexer_sizes(model, needed_by: str, example: str, rotary_key: str, rotary_what: str) -> None:
    """A lightning indexer's sizes (DeepSeek-V3.2's, DeepSeek-V4's): ``index_topk``, ``index_n_heads`` and
    ``index_head_dim`` positive, the head wide enough for the rotary channels ``model.<rotary_key>``."""
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        value = getattr(model, key)
        require(value is not None and value > 0,
                f"model.{key}={value}: {needed_by} needs a positive integer ({example})")
    rotary = getattr(model, rotary_key)
    require(rotary <= model.index_head_dim,
            f"model.index_head_dim={model.index_head_dim} must hold {rotary_what}, model.{rotary_key}={rotary}")
