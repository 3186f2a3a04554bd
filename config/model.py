"""The model's sections of a run's config: the transformer's shape (``model``) and its MoE layers (``moe``).

``moe/`` builds from these two alone; each ``validate()`` refuses an impossible value before any tensor exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from config.compressed_attention import COMPRESSED_LAYER_KINDS, CompressedAttentionConfig
from config.hyper_connections import validate_hyper_connections
from config.schema import require
from config.sparse_attention import validate_sparse_attention

QK_NORM_TYPES = ("per_head", "per_layer")  # ``qk_norm_type``'s words (MiniMax-M2's config.json names them so)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention",  # ``layer_types``' words (HF's)
                         "heavily_compressed_attention", "compressed_sparse_attention")
# ``mlp_layer_types``' words; "hash_moe": an MoE layer whose experts a fixed table of the token id picks (DeepSeek-V4)
FEED_FORWARD_LAYER_TYPES = ("dense", "moe", "hash_moe")


@dataclass(frozen=True)
class LayerSpec:
    """One layer of the model's layer pattern (``ModelConfig.layer``): which attention kind it has (a module of
    ``moe/attention/``: ``grouped_query``, ``latent`` or ``gated_delta``) with that attention's sliding window, and
    which feed-forward kind (``dense`` or ``moe``). Blocks are built from it, and the accounting sums over it; layers of
    one spec cost the same."""

    attention: str
    feed_forward: str
    window: int | None = None

    @property
    def is_moe(self) -> bool:
        return self.feed_forward in ("moe", "hash_moe")


@dataclass
class ModelConfig:
    """Shape of the decoder-only transformer language model."""

    vocab_size: int = 256  # byte-level tokens by default
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention; None = n_heads (plain multi-head)
    head_dim: int | None = None  # per-head width; None = d_model / n_heads (Qwen3-MoE: 128 with d_model 2048, 32 heads)
    qk_norm: bool = False  # RMSNorm of each query and key head before RoPE (Qwen3; ViT-22B's QK normalization)
    # what one q/k norm spans: "per_head" (Qwen3, GLM-4.5: each head's hd channels, one weight [hd] for all heads) or
    # "per_layer" (MiniMax-M2: all heads' queries as one vector, weight [nh·hd], and all keys likewise, [nkv·hd])
    qk_norm_type: str = "per_head"
    qkv_bias: bool = False  # biases on the query, key and value projections (GLM-4.5, Qwen2); none on the output
    attn_output_bias: bool = False  # a bias on the attention output projection wo (GPT-OSS, with qkv_bias)
    # GPT-OSS's attention sinks: one learned logit per head that joins each softmax's denominator, with no value
    # (a query may attend to "nothing"; Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks")
    attention_sinks: bool = False
    # a sigmoid gate on each attention output channel, from its own projection of the block input, before wo
    # (Qwen3-Next's gated attention: Qiu et al. 2025, "Gated Attention for Large Language Models")
    attn_output_gate: bool = False
    # The layer pattern (``layer``): each layer's attention and feed-forward, as Hugging Face's layer_types and
    # mlp_layer_types say them. Sliding-window attention: in a "sliding_attention" layer a query sees itself and the
    # sliding_window - 1 positions before it. layer_types gives each layer's attention ("full_attention" or
    # "sliding_attention", GPT-OSS: alternating from a sliding first layer); null with a sliding_window = every
    # layer slides. mlp_layer_types gives each layer's feed-forward ("dense" or "moe"); null = the shorthand
    # moe_every / first_moe_layer below
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    mlp_layer_types: list[str] | None = None
    rotary_dim: int | None = None  # RoPE rotates the first rotary_dim channels of each head; None = all (GLM-4.5: half)
    seq_len: int = 256  # training context length
    ffn_hidden: int = 512  # hidden size of the dense SwiGLU FFN blocks
    # shorthand for mlp_layer_types: every moe_every-th layer (from first_moe_layer on) is MoE; 0 = no MoE layer
    moe_every: int = 1
    first_moe_layer: int = 0  # layers before it are dense (DeepSeek-V3 keeps its first 3 dense)
    tie_embeddings: bool = False
    # multi-token prediction (DeepSeek-V3 sec. 2.2): mtp_depth modules, module k predicting the token k+1 ahead from
    # the previous module's states and the embedding of token i+k, each through one block of the kind layer
    # n_layers + k - 1 would be; their mean cross-entropy weighted by mtp_loss_weight (DeepSeek-V3: 1 module, 0.3)
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    rope_theta: float = 10000.0
    # YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"): "none", or "yarn" to stretch the rotary
    # frequencies of a model pretrained on rope_original_seq_len positions by rope_factor (DeepSeek-V3: 40 x 4096)
    rope_scaling: Literal["none", "yarn"] = "none"
    rope_factor: float = 1.0
    rope_original_seq_len: int | None = None
    yarn_beta_fast: float = 32.0  # rotations per context below which a frequency is interpolated (YaRN's alpha/beta)
    yarn_beta_slow: float = 1.0
    yarn_mscale: float | None = None  # with yarn_mscale_all_dim: the rotary tables' scale is their ratio of mscales
    yarn_mscale_all_dim: float | None = None  # latent attention's softmax scale times mscale(factor, this)^2
    yarn_attention_factor: float | None = None  # the tables' scale given outright (None: from the mscales)
    # round the ramp's pair bounds outward to whole pairs (YaRN's and DeepSeek-V3's code); false keeps them
    # fractional (GPT-OSS, Hugging Face's rope_parameters "truncate": false)
    yarn_truncate: bool = True
    # multi-head latent attention (DeepSeek-V2 sec. 2.1, V3 sec. 2.1.1), on when kv_lora_rank is set: keys and
    # values come from one compressed latent of kv_lora_rank (RMS-normalised) per token, queries through an optional
    # q_lora_rank bottleneck (null: a full projection); RoPE acts on a decoupled qk_rope_head_dim part (one rotary
    # key shared by the heads), the other qk_nope_head_dim per head carry no position; values are v_head_dim wide
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # DeepSeek Sparse Attention (DSA; DeepSeek-V3.2 sec. 2.1, GLM-5), on when index_topk is set, over latent
    # attention with a q_lora_rank bottleneck: a lightning indexer of index_n_heads heads, index_head_dim channels
    # wide (the first qk_rope_head_dim of them rotary), scores every visible key for each query, and the query
    # attends to the index_topk best only (DeepSeek-V3.2: 64 heads of 128, top 2048)
    index_topk: int | None = None
    index_n_heads: int | None = None
    index_head_dim: int | None = None
    # GLM-5's cross-layer sharing (Hugging Face's indexer_types): per layer "full" (its own indexer) or "shared"
    # (no indexer: the keys the last full layer before it selected); null = every layer full
    indexer_types: list[str] | None = None
    # Gated DeltaNet linear attention (Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks"; moe/attention/
    # gated_delta.py) in the layers layer_types calls "linear_attention" (Qwen3-Next: three of every four):
    # linear_key_heads query/key heads of linear_key_head_dim channels, linear_value_heads value heads of
    # linear_value_head_dim (a multiple of the key heads: each key head serves that many consecutive value heads),
    # a causal depthwise convolution over linear_conv_kernel positions, the delta rule by chunks of linear_chunk_size
    linear_key_heads: int | None = None
    linear_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel: int = 4
    linear_chunk_size: int = 64
    linear_backend: Literal["torch", "fla", "auto"] = "auto"  # the rule's kernels (moe/attention/delta_rule_fla.py)
    # DeepSeek-V4's attention (``config/compressed_attention.py``): null = off, a mapping = on in every layer
    compressed_attention: CompressedAttentionConfig | None = None
    norm_eps: float = 1e-5
    # DeepSeek-V4's hyper-connections (``moe/hyper_connections.py``; checks in config/): hc_mult streams, 1 = off
    hc_mult: int = 1
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    init_std: float = 0.02  # std of every weight matrix; output projections are scaled by 1/sqrt(2*n_layers)
    # What an imported Hugging Face model's config.json says beyond its shape, kept for its export: the context it
    # was made for (max_position_embeddings, which a fine-tune at a shorter seq_len keeps; null: seq_len) and its
    # special tokens (null: the tokenizer's end-of-text token, if it has one)
    context_length: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] | None = None

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """The per-head width hd of queries, keys and values: ``head_dim``, or d_model / n_heads."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def attention_width(self) -> int:
        """n_heads · hd: the width of the queries and of the attention output (d_model unless ``head_dim`` is set)."""
        return self.n_heads * self.head_size

    @property
    def latent_attention(self) -> bool:
        """Whether attention is multi-head latent attention (``kv_lora_rank`` set)."""
        return self.kv_lora_rank is not None

    @property
    def sparse_attention(self) -> bool:
        """Whether latent attention attends to the keys a lightning indexer selects (``index_topk`` set; DeepSeek-V4's
        indexer, ``compressed_attention``'s, is another)."""
        return self.index_topk is not None and self.compressed_attention is None

    @property
    def lightning_indexer(self) -> bool:
        """Whether some layer selects keys by a lightning indexer (``sparse_attention``'s, V4's compressed sparse)."""
        return self.sparse_attention or "compressed_sparse_attention" in (self.layer_types or ())

    @property
    def rope_dim(self) -> int:
        """The channels of a query or key head that RoPE rotates: MLA's ``qk_rope_head_dim``, else ``rotary_dim``
        (partial rotary: the first ones), else hd."""
        if self.latent_attention:
            return self.qk_rope_head_dim
        return self.rotary_dim or self.head_size

    def attention_window(self, index: int) -> int | None:
        """Layer ``index``'s sliding window, or None for full causal attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[index] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def slides(self) -> bool:
        """Whether some layer attends within a sliding window (``attention_window``'s rule, without a loop)."""
        return self.sliding_window is not None and (self.layer_types is None or self.compressed_attention is not None
                                                    or "sliding_attention" in self.layer_types)

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index``'s feed-forward is MoE: ``mlp_layer_types``' word, or the shorthand's rule. The
        multi-token-prediction modules' blocks (``index`` >= n_layers) are of the kind the layers after the last
        would be: the shorthand's rule continued, or the last layer's word."""
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[min(index, self.n_layers - 1)] != "dense"
        if self.moe_every == 0 or index < self.first_moe_layer:
            return False
        return (index - self.first_moe_layer) % self.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        """The layers ``is_moe_layer`` picks among the n_layers (counted, not looped: the planner asks millions of
        times)."""
        if self.mlp_layer_types is not None:
            return self.n_layers - self.mlp_layer_types.count("dense")
        if self.moe_every == 0:
            return 0
        return len(range(self.first_moe_layer, self.n_layers, self.moe_every))

    def layer(self, index: int) -> LayerSpec:
        """Layer ``index``'s place in the layer pattern; indices n_layers + k are the multi-token-prediction modules'
        blocks (full attention, the feed-forward ``is_moe_layer`` says; with ``compressed_attention``, DeepSeek-V4's
        sliding layer: its published configs' ``compress_ratios`` give the MTP layer a 0, and its published
        ``mtp.*`` tensors have no compressor)."""
        attention = "latent" if self.latent_attention else "grouped_query"
        if self.sparse_attention:
            shared = index < self.n_layers and self.indexer_types is not None and self.indexer_types[index] == "shared"
            attention = "shared_selection" if shared else "sparse_latent"
        if index < self.n_layers and self.layer_types is not None and self.layer_types[index] == "linear_attention":
            attention = "gated_delta"
        window = self.attention_window(index) if index < self.n_layers else None
        if self.compressed_attention is not None:  # DeepSeek-V4's kinds, every one within the window
            word = self.layer_types[index] if index < self.n_layers else "sliding_attention"
            attention = COMPRESSED_LAYER_KINDS[word]
            window = self.sliding_window
        feed_forward = "moe" if self.is_moe_layer(index) else "dense"
        if self.mlp_layer_types is not None and index < self.n_layers:
            feed_forward = self.mlp_layer_types[index]
        return LayerSpec(attention, feed_forward, window)

    @property
    def layer_pattern(self) -> tuple[LayerSpec, ...]:
        """Every block's ``LayerSpec``: the n_layers layers, then the multi-token-prediction modules' blocks."""
        return tuple(self.layer(i) for i in range(self.n_layers + self.mtp_depth))

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "seq_len", "ffn_hidden"):
            require(getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}")
        if self.latent_attention:
            pass  # heads of their own widths (``_validate_latent_attention``)
        elif self.head_dim is None:
            require(
                self.d_model % self.n_heads == 0,
                f"model.n_heads={self.n_heads} does not divide model.d_model={self.d_model}; "
                f"valid head counts: {[h for h in range(1, 65) if self.d_model % h == 0]}, or set model.head_dim",
            )
            require(self.head_size % 2 == 0,
                     f"head dimension d_model/n_heads={self.head_size} must be even for RoPE; or set model.head_dim")
        else:
            require(self.head_dim > 0 and self.head_dim % 2 == 0,
                     f"model.head_dim={self.head_dim} must be a positive even number (RoPE rotates pairs), or null")
        require(
            self.n_kv_heads is None or (self.n_kv_heads > 0 and self.n_heads % self.n_kv_heads == 0),
            f"model.n_kv_heads={self.n_kv_heads} must divide model.n_heads={self.n_heads}",
        )
        self._validate_mlp_layer_types()
        require(self.moe_every >= 0, f"model.moe_every must be >= 0, got {self.moe_every}")
        require(
            0 <= self.first_moe_layer < self.n_layers or self.moe_every == 0,
            f"model.first_moe_layer={self.first_moe_layer} must be in [0, n_layers={self.n_layers})",
        )
        require(self.qk_norm_type in QK_NORM_TYPES,
                f"model.qk_norm_type={self.qk_norm_type!r} must be one of {', '.join(QK_NORM_TYPES)}")
        require(self.qk_norm or self.qk_norm_type == "per_head",
                f"model.qk_norm_type={self.qk_norm_type!r} needs model.qk_norm=true")
        require(0 <= self.mtp_depth < self.seq_len - 1,
                f"model.mtp_depth={self.mtp_depth} must be between 0 (off) and model.seq_len - 2={self.seq_len - 2}")
        require(self.mtp_loss_weight >= 0, f"model.mtp_loss_weight must be >= 0, got {self.mtp_loss_weight}")
        require(self.rope_theta > 0 and self.norm_eps > 0 and self.init_std > 0,
                 "model.rope_theta, model.norm_eps and model.init_std must be positive")
        require(self.rotary_dim is None or (0 < self.rotary_dim <= self.head_size and self.rotary_dim % 2 == 0),
                f"model.rotary_dim={self.rotary_dim} must be a positive even number up to the head width "
                f"{self.head_size}, or null (all channels)")
        self._validate_rope_scaling()
        self._validate_sliding_window()
        if self.compressed_attention is not None:  # V4's keys and its own checks of the model's
            self.compressed_attention.validate(self)
        else:
            self._validate_latent_attention()
            validate_sparse_attention(self)
        self._validate_linear_attention()
        validate_hyper_connections(self)
        self._validate_imported_context_and_tokens()

    def _validate_imported_context_and_tokens(self) -> None:
        require(self.context_length is None or self.context_length >= self.seq_len,
                f"model.context_length={self.context_length} (the imported model's max_position_embeddings) is below "
                f"model.seq_len={self.seq_len}: set model.seq_len to at most it, or context_length to null")
        for token in [self.bos_token_id, *(self.eos_token_ids or [])]:
            require(token is None or 0 <= token < self.vocab_size,
                    f"model.bos_token_id/eos_token_ids hold {token}, outside the vocabulary [0, {self.vocab_size})")

    def _validate_mlp_layer_types(self) -> None:
        if self.mlp_layer_types is None:
            return
        self._require_one_per_layer("mlp_layer_types", FEED_FORWARD_LAYER_TYPES, "feed-forward kind")
        require((self.moe_every, self.first_moe_layer) == (1, 0),
                f"model.mlp_layer_types gives each layer's feed-forward; model.moe_every={self.moe_every} and "
                f"model.first_moe_layer={self.first_moe_layer} are its shorthand: set one or the other (leave "
                "moe_every at 1 and first_moe_layer at 0 with mlp_layer_types)")

    def _validate_sliding_window(self) -> None:
        if self.sliding_window is not None:
            require(0 < self.sliding_window <= self.seq_len,
                    f"model.sliding_window={self.sliding_window} must be between 1 and model.seq_len={self.seq_len} "
                    "(a window of the whole sequence is full attention: leave it null)")
        if self.layer_types is None:
            return
        self._require_one_per_layer("layer_types", ATTENTION_LAYER_TYPES, "layer type")
        require("sliding_attention" not in self.layer_types or self.sliding_window is not None,
                "model.layer_types has sliding_attention layers: set model.sliding_window (GPT-OSS: 128)")
        compressed = [word for word in self.layer_types if word.endswith("compressed_attention")]
        require(not compressed or self.compressed_attention is not None, f"model.layer_types has {compressed[:1]} "
                "layers, DeepSeek-V4's: set model.compressed_attention (a mapping; {} for V4-Flash's settings)")

    @property
    def linear_attention(self) -> bool:
        """Whether some layer is Gated DeltaNet linear attention (``layer_types``' "linear_attention")."""
        return self.layer_types is not None and "linear_attention" in self.layer_types

    def _validate_linear_attention(self) -> None:
        keys = ("linear_key_heads", "linear_value_heads", "linear_key_head_dim", "linear_value_head_dim")
        if not self.linear_attention:
            given = [key for key in keys if getattr(self, key) is not None]
            require(not given, f"model.{given[0] if given else ''} is a linear-attention setting: it needs "
                               "\"linear_attention\" layers in model.layer_types (or leave it null)")
            return
        for key in keys:
            value = getattr(self, key)
            require(value is not None and value > 0,
                    f"model.{key}={value}: model.layer_types has linear_attention layers, which need a positive "
                    "integer (Qwen3-Next: 16 key heads of 128, 32 value heads of 128)")
        require(self.linear_value_heads % self.linear_key_heads == 0,
                f"model.linear_value_heads={self.linear_value_heads} must be a multiple of "
                f"model.linear_key_heads={self.linear_key_heads} (each key head serves as many value heads)")
        require(self.linear_conv_kernel >= 1 and self.linear_chunk_size >= 1,
                f"model.linear_conv_kernel={self.linear_conv_kernel} and model.linear_chunk_size="
                f"{self.linear_chunk_size} must be positive (Qwen3-Next: 4 and 64)")

    def _require_one_per_layer(self, key: str, valid: tuple[str, ...], what: str) -> None:
        """A per-layer list of the pattern (``layer_types``, ``mlp_layer_types``): one word per layer, each valid."""
        words = getattr(self, key)
        require(len(words) == self.n_layers,
                f"model.{key} has {len(words)} entries; it needs one per layer (model.n_layers={self.n_layers})")
        for index, word in enumerate(words):
            require(word in valid, f"model.{key}[{index}]={word!r} is not a {what}; valid: {list(valid)}")

    def _validate_rope_scaling(self) -> None:
        yarn_keys = ("rope_original_seq_len", "yarn_mscale", "yarn_mscale_all_dim", "yarn_attention_factor")
        if self.rope_scaling == "none":
            require(self.rope_factor == 1.0, f"model.rope_factor={self.rope_factor} needs model.rope_scaling: yarn "
                                             "(the only scaling implemented); or leave it at 1.0")
            given = [key for key in yarn_keys if getattr(self, key) is not None]
            require(not given, f"model.{given[0] if given else ''} is a YaRN setting: set model.rope_scaling: yarn "
                               "or leave it null")
            require(self.yarn_truncate, "model.yarn_truncate=false is a YaRN setting: set model.rope_scaling: yarn "
                                        "or leave it true")
            return
        require(self.rope_factor > 0, f"model.rope_factor must be positive for YaRN, got {self.rope_factor}")
        require(self.rope_original_seq_len is not None and self.rope_original_seq_len > 0,
                f"model.rope_original_seq_len={self.rope_original_seq_len}: YaRN needs the pretraining context "
                "length (a positive integer; Hugging Face's original_max_position_embeddings)")
        require(self.yarn_beta_fast > 0 and self.yarn_beta_slow > 0,
                f"model.yarn_beta_fast={self.yarn_beta_fast} and model.yarn_beta_slow={self.yarn_beta_slow} "
                "must be positive")
        require(self.yarn_attention_factor is None or self.yarn_attention_factor > 0,
                f"model.yarn_attention_factor={self.yarn_attention_factor} must be positive or null")

    def _validate_latent_attention(self) -> None:
        mla_keys = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        if not self.latent_attention:
            given = [key for key in mla_keys if getattr(self, key) is not None]
            require(not given, f"model.{given[0] if given else ''} is a latent-attention setting: it needs "
                               "model.kv_lora_rank (null: grouped-query attention)")
            return
        for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, key)
            require(value is not None and value > 0,
                    f"model.{key}={value}: latent attention (model.kv_lora_rank set) needs a positive integer")
        require(self.q_lora_rank is None or self.q_lora_rank > 0,
                f"model.q_lora_rank={self.q_lora_rank} must be positive, or null for a full query projection")
        require(self.qk_rope_head_dim % 2 == 0,
                f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        for key in ("n_kv_heads", "head_dim", "rotary_dim"):
            require(getattr(self, key) is None, f"model.{key}={getattr(self, key)} does not apply to latent "
                                                "attention (every head has its keys and values): leave it null")
        require(not self.qk_norm, "model.qk_norm=true does not apply to latent attention (its latents are "
                                  "normalised instead): set it false")
        require(not self.qkv_bias, "model.qkv_bias=true does not apply to latent attention: set it false")
        for key in ("attn_output_bias", "attention_sinks", "attn_output_gate"):
            require(not getattr(self, key), f"model.{key}=true is not implemented for latent attention: set it false")
        require(self.sliding_window is None, f"model.sliding_window={self.sliding_window} is not implemented for "
                                             "latent attention: leave it null")


@dataclass
class MoEConfig:
    """Routing, capacity, balancing and expert shapes of every MoE layer."""

    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 512  # hidden size of one routed expert
    # the routed experts' activation: SwiGLU (Shazeer 2020), GELU, or GPT-OSS's clamped SwiGLU:
    # (clamp(up, -limit, limit) + 1) * g * sigmoid(swiglu_alpha * g) with g = min(gate, swiglu_limit); or
    # DeepSeek-V4's limited SwiGLU, silu(min(gate, limit)) * clamp(up, -limit, limit), its shared experts' too
    activation: Literal["swiglu", "gelu", "clamped_swiglu", "limited_swiglu"] = "swiglu"
    swiglu_alpha: float = 1.702  # clamped_swiglu only: the sigmoid's slope (GPT-OSS: 1.702, GELU's sigmoid fit)
    swiglu_limit: float = 7.0  # the clamped SwiGLUs: where the gate is capped and the up projection clipped (V4: 10)
    router_bias: bool = False  # a learned bias on the router's logits (GPT-OSS)
    expert_proj_bias: bool = False  # learned biases on every routed expert's gate, up and down projections
    score_func: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"  # sqrtsoftplus: sqrt(softplus(l)), V4
    renormalize: bool = True  # rescale the k selected weights to sum to 1
    jitter_eps: float = 0.0  # multiplicative input noise U(1-eps, 1+eps) in training (Switch Transformer)
    capacity_factor: float | None = 1.25  # None = dropless
    drop_policy: Literal["probability", "position"] = "probability"
    aux_loss_coef: float = 0.01  # Switch/GShard load-balancing loss weight (Switch: 1e-2)
    aux_loss_scope: Literal["batch", "sequence"] = "batch"  # balance per micro-batch or per sequence
    z_loss_coef: float = 0.001  # ST-MoE router z-loss weight (ST-MoE: 1e-3)
    bias_update_rate: float = 0.0  # > 0 enables aux-loss-free balancing (DeepSeek-V3: 1e-3)
    # group-limited routing (DeepSeek-V3 sec. 2.1.2, "node-limited"): the experts form n_group equal groups of
    # consecutive ids; a token picks its top_k only among the topk_group groups whose two best biased scores sum
    # highest. 1 group = plain top-k; topk_group null = every group
    n_group: int = 1
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0  # the routed experts' combine weights are multiplied by it (DeepSeek-V3: 2.5)
    num_shared_experts: int = 0  # DeepSeek-style experts that see every token
    # the shared experts' output scaled per token by sigmoid(a learned [1, D] projection of the token) (Qwen2-MoE,
    # Qwen3-Next)
    shared_expert_gate: bool = False
    shared_expert_hidden: int | None = None  # None = expert_hidden * num_shared_experts
    force_balance: bool = False  # DEBUG/BENCHMARK ONLY: round-robin assignment ignoring the router
    # how experts compute their grouped GEMMs (``moe/experts.py``): torch's grouped_mm, megablocks' grouped_gemm
    # (CUDA, bf16), or auto (megablocks only on a GPU where it was measured faster)
    backend: Literal["torch", "megablocks", "auto"] = "auto"

    @property
    def gated(self) -> bool:
        """Whether the routed experts have a gate projection besides up and down (both SwiGLUs do)."""
        return self.activation in ("swiglu", "clamped_swiglu", "limited_swiglu")

    @property
    def shared_hidden(self) -> int:
        return self.shared_expert_hidden or self.expert_hidden * self.num_shared_experts

    @property
    def groups_per_token(self) -> int:
        """The groups a token may route to: ``topk_group``, or all ``n_group``."""
        return self.topk_group or self.n_group

    @property
    def group_limited(self) -> bool:
        """Whether group limiting can exclude any expert (some groups are left out of each token's choice)."""
        return self.groups_per_token < self.n_group

    def validate(self) -> None:
        require(self.num_experts >= 1, f"moe.num_experts must be >= 1, got {self.num_experts}")
        require(
            1 <= self.top_k <= self.num_experts,
            f"moe.top_k={self.top_k} must be between 1 and moe.num_experts={self.num_experts}",
        )
        require(self.expert_hidden > 0, f"moe.expert_hidden must be positive, got {self.expert_hidden}")
        require(self.swiglu_limit > 0 and math.isfinite(self.swiglu_limit),
                f"moe.swiglu_limit={self.swiglu_limit} must be a positive finite number (GPT-OSS: 7.0): the clamped "
                "SwiGLU caps its gate at it and clips its up projection to [-limit, limit]")
        require(self.swiglu_alpha > 0 and math.isfinite(self.swiglu_alpha),
                f"moe.swiglu_alpha={self.swiglu_alpha} must be a positive finite number (GPT-OSS: 1.702)")
        require(
            self.capacity_factor is None or (self.capacity_factor > 0 and math.isfinite(self.capacity_factor)),
            f"moe.capacity_factor={self.capacity_factor} must be a positive number, or null for dropless",
        )
        require(0 <= self.jitter_eps < 1, f"moe.jitter_eps must be in [0, 1), got {self.jitter_eps}")
        for name in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
            require(getattr(self, name) >= 0, f"moe.{name} must be >= 0, got {getattr(self, name)}")
        require(self.num_shared_experts >= 0, "moe.num_shared_experts must be >= 0")
        require(not self.shared_expert_gate or self.num_shared_experts > 0,
                "moe.shared_expert_gate=true gates the shared experts: set moe.num_shared_experts (Qwen3-Next: 1)")
        require(
            self.shared_expert_hidden is None or self.shared_expert_hidden > 0,
            "moe.shared_expert_hidden must be positive or null",
        )
        divisors = [g for g in range(1, self.num_experts + 1) if self.num_experts % g == 0]
        require(self.n_group >= 1 and self.num_experts % self.n_group == 0,
                f"moe.n_group={self.n_group} must divide moe.num_experts={self.num_experts} into equal groups; "
                f"valid: {divisors}")
        require(self.topk_group is None or 1 <= self.topk_group <= self.n_group,
                f"moe.topk_group={self.topk_group} must be between 1 and moe.n_group={self.n_group}, or null "
                f"(every group)")
        reachable = self.groups_per_token * (self.num_experts // self.n_group)
        require(self.top_k <= reachable,
                f"moe.top_k={self.top_k} is more experts than moe.topk_group={self.groups_per_token} groups of "
                f"{self.num_experts // self.n_group} hold ({reachable}); valid: top_k <= {reachable}, or raise "
                f"moe.topk_group to at least {-(-self.top_k // (self.num_experts // self.n_group))}")
        require(self.routed_scaling_factor > 0,
                f"moe.routed_scaling_factor must be positive, got {self.routed_scaling_factor}")

