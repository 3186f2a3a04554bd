"""The ``model.compressed_attention`` section: DeepSeek-V4's attention settings beyond the model's shape.

DeepSeek-V4 (``transformers``' ``deepseek_v4``; its technical report, sec. 2.3) attends in every layer with one
key/value head shared by the query heads, over a sliding window of ``model.sliding_window`` positions, and in its
compressed layers over compressed entries too: ``heavily_compressed_attention`` layers over one entry per
``hca_rate`` positions (all of those a query may see), ``compressed_sparse_attention`` layers over one entry per
``csa_rate`` positions (each from a window of 2 · csa_rate) of which a lightning indexer picks ``model.index_topk``
per query (``model.index_n_heads`` heads of ``model.index_head_dim``). The model's own keys say the rest:
``head_dim`` (queries and the shared key/value), ``rotary_dim`` (RoPE's channels, the trailing ones of a head),
``q_lora_rank`` (the query bottleneck), ``layer_types`` (each layer's word), ``rope_theta`` (the sliding layers'
RoPE). The compressed layers turn by their own RoPE (``rope_theta`` here, with YaRN when ``rope_scaling`` is yarn;
its tables are not scaled: V4's attention factor is 1), and every layer's output goes through a grouped
projection: ``o_groups`` groups of heads, each projected to ``o_lora_rank``, then mixed to d_model.

Set (any mapping, ``{}`` for the defaults) the section turns the attention kinds of ``moe/attention/shared_kv.py``
and ``moe/attention/compressed.py`` on; null (the default) leaves the model's attention as it was. The defaults are
DeepSeek-V4-Flash's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from config.schema import require
from config.sparse_attention import require_indexer_sizes

# ``model.layer_types``' words for V4's attention, and the kind each layer of that word gets (``moe/attention/``)
COMPRESSED_LAYER_KINDS = {"sliding_attention": "sliding_shared_kv",
                          "heavily_compressed_attention": "heavily_compressed",
                          "compressed_sparse_attention": "compressed_sparse"}


@dataclass
class CompressedAttentionConfig:
    """DeepSeek-V4's attention settings (the module docstring says how they combine with ``model``'s keys)."""

    csa_rate: int = 4  # positions per compressed entry in compressed_sparse_attention layers (V4: 4)
    hca_rate: int = 128  # positions per compressed entry in heavily_compressed_attention layers (V4: 128)
    o_groups: int = 8  # groups of heads in the grouped output projection (V4-Flash: 8)
    o_lora_rank: int = 1024  # each group's projection width before the mix to d_model (V4: 1024)
    # the compressed layers' RoPE (the compressed entries', their queries', the indexer's): base and YaRN (V4:
    # 160000 with yarn, factor 16 over 65536 positions, betas 32 and 1)
    rope_theta: float = 160000.0
    rope_scaling: Literal["none", "yarn"] = "none"
    rope_factor: float = 1.0
    rope_original_seq_len: int | None = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0

    def validate(self, model) -> None:
        """Refuse settings V4's attention cannot run with, given the ``model`` section (``config.model``'s
        ``ModelConfig``) it belongs to."""
        for key in ("csa_rate", "hca_rate", "o_groups", "o_lora_rank"):
            require(getattr(self, key) > 0, f"model.compressed_attention.{key}={getattr(self, key)} must be positive")
        require(self.rope_theta > 0, f"model.compressed_attention.rope_theta={self.rope_theta} must be positive")
        yarn = self.rope_scaling == "yarn"
        require(not yarn or (self.rope_factor > 0 and (self.rope_original_seq_len or 0) > 0),
                f"model.compressed_attention.rope_scaling=yarn needs a positive rope_factor and "
                f"rope_original_seq_len (V4: 16 and 65536), got {self.rope_factor} and {self.rope_original_seq_len}")
        require(yarn or (self.rope_factor == 1.0 and self.rope_original_seq_len is None),
                "model.compressed_attention.rope_factor and rope_original_seq_len are YaRN settings: set "
                "model.compressed_attention.rope_scaling: yarn, or leave them at 1.0 and null")
        self._validate_model(model)

    def _validate_model(self, model) -> None:
        require(model.head_dim is not None and model.rotary_dim is not None and model.q_lora_rank is not None,
                "model.compressed_attention (DeepSeek-V4's attention) needs model.head_dim, model.rotary_dim and "
                "model.q_lora_rank (V4-Flash: 512, 64, 1024)")
        require(model.sliding_window is not None and model.layer_types is not None,
                "model.compressed_attention needs model.sliding_window (every V4 layer attends within it; V4: 128) "
                f"and model.layer_types, one of {list(COMPRESSED_LAYER_KINDS)} per layer")
        for index, word in enumerate(model.layer_types):
            require(word in COMPRESSED_LAYER_KINDS, f"model.layer_types[{index}]={word!r} is not a layer of "
                                                    f"DeepSeek-V4's attention; valid: {list(COMPRESSED_LAYER_KINDS)}")
        require(model.kv_lora_rank is None, "model.kv_lora_rank is latent attention's; DeepSeek-V4's attention "
                                            "(model.compressed_attention) has no latent: leave it null")
        require(model.n_kv_heads in (None, 1), f"model.n_kv_heads={model.n_kv_heads}: DeepSeek-V4's attention has "
                                               "one key/value head shared by every query head; leave it null or 1")
        groups = self.o_groups
        require(model.n_heads % groups == 0, f"model.compressed_attention.o_groups={groups} must divide "
                                             f"model.n_heads={model.n_heads} (each group holds whole heads)")
        for flag in ("qk_norm", "qkv_bias", "attn_output_bias", "attention_sinks", "attn_output_gate"):
            require(not getattr(model, flag), f"model.{flag}=true does not apply to DeepSeek-V4's attention (it has "
                                              "its own norms and sinks): set it false")
        require(model.rope_scaling == "none", "model.rope_scaling is the sliding layers' RoPE, which V4 does not "
                                              "stretch: set the compressed layers' YaRN in model.compressed_attention")
        if "compressed_sparse_attention" in model.layer_types:
            require_indexer_sizes(model, "compressed_sparse_attention layers' indexer",
                                  "V4-Flash: index_topk 512, index_n_heads 64, index_head_dim 128", "rotary_dim",
                                  "the rotary channels")
