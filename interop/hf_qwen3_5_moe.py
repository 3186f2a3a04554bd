"""The Qwen3.5-MoE family's text model (Hugging Face ``Qwen3_5MoeForConditionalGeneration`` and its text-only
``Qwen3_5MoeForCausalLM``) in our terms: Qwen3-Next's hybrid (``interop/hf_qwen3_next.py``) with its own tensors.

What differs from Qwen3-Next: the config of the multimodal model nests the text model's keys in ``text_config``
(beside a ``vision_config``), its tensors live under ``model.language_model.`` and the vision tower's under
``model.visual.``, which the import leaves out, saying so (we train the text model); the router always
renormalises its top-k weights (no ``norm_topk_prob``); every layer is MoE; RoPE's ``mrope_section`` only
matters for image and video positions (text positions are 1-D RoPE, ``MROPE_KEYS``). In a linear layer
``in_proj_qkv`` holds q, k and v one after another (the convolution's channel order), and z, beta and the
decay input have projections of their own (``in_proj_z``, ``in_proj_b``, ``in_proj_a``).

Export writes the text-only ``Qwen3_5MoeForCausalLM`` (model_type ``qwen3_5_moe_text``, tensors under
``model.``): a folder with no vision tower to fill.
"""

from __future__ import annotations

import sys

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from interop.hf_family import IGNORED_KEYS, Family, HFShape, Source, refuse
from interop.hf_qwen3_next import MTP_PREFIX, hybrid_refusals, hybrid_sources, text_config, text_shape

ARCHITECTURE = "Qwen3_5MoeForConditionalGeneration"
TEXT_ARCHITECTURE = "Qwen3_5MoeForCausalLM"
FAMILY_NAME = "Qwen3.5-MoE"
# the multimodal config's own keys: the vision tower's and its special tokens' (left out with it)
OUTER_KEYS = {"text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
              "vision_end_token_id", "tie_word_embeddings"}


def shape_from_hf(hf: dict) -> HFShape:
    """Our keys from a Qwen3.5-MoE config.json (its ``text_config``); the vision tower named and left out."""
    unknown = sorted(set(hf) - OUTER_KEYS - IGNORED_KEYS)
    if unknown:
        raise ConfigError(f"config.json setting '{unknown[0]}'={hf[unknown[0]]!r} is not supported by the "
                          f"{FAMILY_NAME} import (it would be silently dropped)")
    if "text_config" not in hf:
        raise ConfigError(f"config.json has no 'text_config', which a {FAMILY_NAME} config needs")
    if "vision_config" in hf:
        print(f"note: {FAMILY_NAME}: the vision tower (config.json's vision_config, tensors model.visual.*) is left "
              "out; the text model alone is imported", file=sys.stderr)
    text = dict(hf["text_config"])
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", False))
    return text_shape(text, FAMILY_NAME, renormalize=True)


def text_shape_from_hf(hf: dict) -> HFShape:
    """Our keys from the text-only model's config.json."""
    return text_shape(hf, FAMILY_NAME, renormalize=True)


def hf_from_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """The config.json of our model as Qwen3.5-MoE's text model; what it cannot express is an error."""
    refuse(TEXT_ARCHITECTURE, [*hybrid_refusals(model, moe, FAMILY_NAME),
                               (not moe.renormalize, f"moe.renormalize=false: {FAMILY_NAME}'s router renormalises"),
                               (model.n_moe_layers != model.n_layers, f"dense layers: every {FAMILY_NAME} layer "
                                                                      "is MoE")])
    out = text_config(model, moe)
    for key in ("intermediate_size", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "use_sliding_window",
                "sliding_window"):
        del out[key]
    return {"architectures": [TEXT_ARCHITECTURE], "model_type": "qwen3_5_moe_text", **out}


def separate_projections(model: ModelConfig, ours: str, theirs: str) -> dict[str, Source]:
    """A linear layer's projections as Qwen3.5 stores them: q, k, v in one tensor, z, beta and a alone."""
    keys = model.linear_key_heads * model.linear_key_head_dim
    values = model.linear_value_heads * model.linear_value_head_dim
    qkv = f"{theirs}in_proj_qkv.weight"
    return {f"{ours}attn.wq.weight": Source("copy", (qkv,), tuple(range(keys))),
            f"{ours}attn.wk.weight": Source("copy", (qkv,), tuple(range(keys, 2 * keys))),
            f"{ours}attn.wv.weight": Source("copy", (qkv,), tuple(range(2 * keys, 2 * keys + values))),
            **{f"{ours}attn.{name}.weight": Source("copy", (f"{theirs}in_proj_{x}.weight",))
               for name, x in (("wz", "z"), ("wb", "b"), ("wa", "a"))}}


def hf_sources(model: ModelConfig, moe: MoEConfig) -> dict[str, Source]:
    return hybrid_sources(model, moe, "model.language_model.", separate_projections)


def text_hf_sources(model: ModelConfig, moe: MoEConfig) -> dict[str, Source]:
    return hybrid_sources(model, moe, "model.", separate_projections)


def multimodal_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """No export as the multimodal model (we have no vision tower to write)."""
    refuse(ARCHITECTURE, [(True, f"we export the text model alone: use --architecture {TEXT_ARCHITECTURE}")])
    return {}


FAMILY = Family(ARCHITECTURE, "qwen3_5_moe", shape_from_hf, multimodal_config, hf_sources, left_out=("model.visual.",),
                mtp_prefix=MTP_PREFIX)
TEXT_FAMILY = Family(TEXT_ARCHITECTURE, "qwen3_5_moe_text", text_shape_from_hf, hf_from_config, text_hf_sources,
                     mtp_prefix=MTP_PREFIX)
