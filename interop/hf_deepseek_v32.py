"""The DeepSeek-V3.2 family (Hugging Face ``DeepseekV32ForCausalLM``, model_type ``deepseek_v32``) in our terms:
DeepSeek-V3 (``interop/hf_deepseek_v3.py``: its config mapping, latent attention, routing and FP8 dequantisation
as read, reused as they are) with DeepSeek Sparse Attention in every layer (``moe/attention/sparse_latent.py``).

config.json adds ``index_topk``, ``index_n_heads``, ``index_head_dim`` (ours under the same names), and the per-layer
lists ``layer_types`` (every layer ``indexed_attention``) and ``mlp_layer_types`` (``dense`` for the first
``first_k_dense_replace`` layers, then ``sparse``: MoE), which must say what the other keys say. Each layer's
indexer tensors are ``self_attn.indexer.wq_b`` (our ``attn.indexer.wq``), ``wk``, ``k_norm`` (weight and bias)
and ``weights_proj`` (our ``head_weights``). DeepSeek-V3.2's indexer rotates its first r channels in (i, i + r/2)
pairs, as ours: copied as they are. GLM-5 (``interop/hf_glm_moe_dsa.py``) interleaves them, and reorders.
"""

from __future__ import annotations

from collections.abc import Callable

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from interop import hf_deepseek_v3 as v3
from interop.hf_family import Family, HFShape, Source, decoder_sources, get_key, refuse

ARCHITECTURE = "DeepseekV32ForCausalLM"
FAMILY_NAME = "DeepSeek-V3.2"
INDEX_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
SPARSE_KEYS = frozenset({*INDEX_KEYS, "layer_types", "mlp_layer_types", "mlp_bias"})


def sparse_shape(hf: dict, family: str, keys: frozenset[str] = frozenset()) -> HFShape:
    """DeepSeek-V3's mapping and the indexer's keys; the per-layer lists checked against the rest."""
    shape = v3.latent_moe_shape(hf, family, SPARSE_KEYS | keys)
    model = shape.model
    n_layers, dense = model["n_layers"], model["first_moe_layer"] if model["moe_every"] else model["n_layers"]
    expected = {"layer_types": ["indexed_attention"] * n_layers,
                "mlp_layer_types": ["dense"] * dense + ["sparse"] * (n_layers - dense), "mlp_bias": False}
    for key, value in expected.items():
        if key in hf and hf[key] != value:
            raise ConfigError(f"config.json {key}={hf[key]!r} is not supported: {family} here has {value!r} "
                              f"(every layer sparse attention; first_k_dense_replace={dense} dense layers, then MoE)")
    model |= {key: get_key(hf, key, family) for key in INDEX_KEYS}
    if model["q_lora_rank"] is None:
        raise ConfigError(f"config.json q_lora_rank=null is not supported: {family}'s indexer reads the query latent")
    return shape


def shape_from_hf(hf: dict) -> HFShape:
    """Map a DeepSeek-V3.2 config.json onto our ``model``/``moe`` keys; any setting we do not implement is an
    error."""
    return sparse_shape(hf, FAMILY_NAME)


def sparse_config(model: ModelConfig, moe: MoEConfig, architecture: str, model_type: str) -> dict:
    """DeepSeek-V3's config.json of our model under ``architecture``, with the indexer's keys and the per-layer
    lists (no ``rope_interleave``: these families always interleave their main attention)."""
    refuse(architecture, [(not model.sparse_attention, f"model.index_topk=null: {architecture} attends to the "
                                                       "keys its indexer selects (sparse attention)")])
    config = v3.hf_from_config(replace_sparse(model), moe)
    del config["rope_interleave"]
    dense = config["first_k_dense_replace"]
    return config | {"architectures": [architecture], "model_type": model_type,
                     **{key: getattr(model, key) for key in INDEX_KEYS},
                     "layer_types": ["indexed_attention"] * model.n_layers,
                     "mlp_layer_types": ["dense"] * dense + ["sparse"] * (model.n_layers - dense)}


def replace_sparse(model: ModelConfig) -> ModelConfig:
    """``model`` without its sparse attention: what DeepSeek-V3's export checks and writes the rest from."""
    from dataclasses import replace

    return replace(model, index_topk=None, index_n_heads=None, index_head_dim=None, indexer_types=None)


def hf_from_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """The config.json of our model as a DeepSeek-V3.2; settings it cannot express are errors."""
    refuse(ARCHITECTURE, [("shared" in (model.indexer_types or ()),
                           f"model.indexer_types={model.indexer_types!r}: every {ARCHITECTURE} layer runs its own "
                           "indexer (GLM-5's shared layers: GlmMoeDsaForCausalLM)")])
    return sparse_config(model, moe, ARCHITECTURE, "deepseek_v32")


def indexed_attention(index_rows: Callable[[ModelConfig], tuple[tuple[int, ...] | None, tuple[int, ...] | None]]
                      ) -> Callable[[ModelConfig, str, str], dict[str, Source]]:
    """A layer's attention tensors: latent attention's (``hf_deepseek_v3.latent_attention``), then the indexer's,
    their rows reordered by ``index_rows(model)`` (the query's rows, the key's; None: as they are); a layer
    sharing its selection (GLM-5's ``shared``: layer index read from ``theirs``) has no indexer tensors."""

    def attention(model: ModelConfig, ours: str, theirs: str) -> dict[str, Source]:
        out = v3.latent_attention(model, ours, theirs)
        if model.layer(int(theirs.split(".")[2])).attention == "shared_selection":
            return out
        ffn_norm = out.pop(f"{ours}ffn_norm.weight")  # our order: the indexer's tensors before the second norm
        query_rows, key_rows = index_rows(model)
        index = f"{theirs}self_attn.indexer."
        out |= {f"{ours}attn.indexer.wq.weight": Source("copy", (f"{index}wq_b.weight",), query_rows),
                f"{ours}attn.indexer.wk.weight": Source("copy", (f"{index}wk.weight",), key_rows),
                f"{ours}attn.indexer.k_norm.weight": Source("copy", (f"{index}k_norm.weight",), key_rows),
                f"{ours}attn.indexer.k_norm.bias": Source("copy", (f"{index}k_norm.bias",), key_rows),
                f"{ours}attn.indexer.head_weights.weight": Source("copy", (f"{index}weights_proj.weight",))}
        out[f"{ours}ffn_norm.weight"] = ffn_norm
        return out

    return attention


def sources_with(attention: Callable[[ModelConfig, str, str], dict[str, Source]]
                 ) -> Callable[[ModelConfig, MoEConfig], dict[str, Source]]:
    """Each of our state-dict names and its HF source, with this family's ``attention`` in every layer and
    multi-token-prediction module."""

    def sources(model: ModelConfig, moe: MoEConfig) -> dict[str, Source]:
        return decoder_sources(model, lambda i, ours, theirs: v3.sigmoid_moe_sources(model, moe, i, ours, theirs),
                               attention) | v3.mtp_sources(model, moe, attention)

    return sources


FAMILY = Family(ARCHITECTURE, "deepseek_v32", shape_from_hf, hf_from_config,
                sources_with(indexed_attention(lambda model: (None, None))))
