"""The GLM-5 family (Hugging Face ``GlmMoeDsaForCausalLM``, model_type ``glm_moe_dsa``) in our terms: DeepSeek-V3.2's
mapping (``interop/hf_deepseek_v32.py``) with two differences the family defines.

Its indexer rotates its first r channels in adjacent pairs (2i, 2i + 1), DeepSeek's interleaved layout, where
DeepSeek-V3.2's (and ours) pairs (i, i + r/2): the indexer's query rows (per head) and key rows are reordered evens
first, then odds, as DeepSeek-V3's main attention's are (``hf_deepseek_v3.interleaved_rows``), and the key's
LayerNorm weight and bias with them (a LayerNorm is the same function of permuted channels). ``indexer_types``
gives each layer ``full`` (its own indexer) or ``shared`` (no indexer tensors: it attends to the keys the last full
layer before it selected, GLM-5's cross-layer sharing), our ``model.indexer_types`` under the same words
(``moe/attention/sparse_latent.py``'s ``SharedSelectionAttention``). The published config.json says
``indexer_rope_interleave: true``, which is what the import reads (false is refused).
"""

from __future__ import annotations

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from interop.hf_deepseek_v32 import indexed_attention, sources_with, sparse_config, sparse_shape
from interop.hf_family import Family, HFShape

ARCHITECTURE = "GlmMoeDsaForCausalLM"
FAMILY_NAME = "GLM-5"


def shape_from_hf(hf: dict) -> HFShape:
    """Map a GLM-5 config.json onto our ``model``/``moe`` keys; any setting we do not implement is an error."""
    shape = sparse_shape(hf, FAMILY_NAME, frozenset({"indexer_types", "indexer_rope_interleave", "index_topk_pattern",
                                                     "index_topk_freq", "index_skip_topk_offset"}))
    if hf.get("indexer_rope_interleave", True) is not True:
        raise ConfigError(f"config.json indexer_rope_interleave={hf['indexer_rope_interleave']!r} is not supported: "
                          "GLM-5's indexer rotates interleaved pairs (the import reorders them)")
    types = hf.get("indexer_types") or indexer_types(hf, shape.model["n_layers"])
    if len(types) != shape.model["n_layers"] or not set(types) <= {"full", "shared"} or types[0] != "full":
        raise ConfigError(f"config.json indexer_types={types!r} is not supported: one 'full' or 'shared' per layer, "
                          "the first 'full' (a shared layer reuses the selection of the full layer before it)")
    shape.model["indexer_types"] = list(types) if "shared" in types else None
    return shape


def indexer_types(hf: dict, n_layers: int) -> list[str]:
    """Each layer's indexer type where config.json states none outright, as ``transformers``' GlmMoeDsaConfig
    derives it: from ``index_topk_pattern`` ("F"/"S" per layer), else every ``index_topk_freq``-th layer full
    counting from ``index_skip_topk_offset`` - 1 (the layers before it full too; defaults 1 and 2: all full)."""
    pattern = hf.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern]
    freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]


def hf_from_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """The config.json of our model as a GLM-5; settings it cannot express are errors."""
    return sparse_config(model, moe, ARCHITECTURE, "glm_moe_dsa") | {
        "indexer_types": model.indexer_types or ["full"] * model.n_layers}


def index_rows(model: ModelConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Our indexer's query rows (per head) and key rows in GLM-5's interleaved order: the rotary r rows first,
    our row j < r/2 their 2j, row r/2 + j their 2j + 1, the rest as they are."""
    rope, width = model.qk_rope_head_dim, model.index_head_dim
    head = [2 * j for j in range(rope // 2)] + [2 * j + 1 for j in range(rope // 2)] + list(range(rope, width))
    return tuple(h * width + row for h in range(model.index_n_heads) for row in head), tuple(head)


FAMILY = Family(ARCHITECTURE, "glm_moe_dsa", shape_from_hf, hf_from_config, sources_with(indexed_attention(index_rows)))
