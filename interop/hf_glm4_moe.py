"""The GLM-4.5 family (Hugging Face ``Glm4MoeForCausalLM``: GLM-4.5, GLM-4.5-Air) in our terms: config mapping
and tensor names.

GLM-4.5 routes as DeepSeek-V3 does (``interop/hf_deepseek_v3.py``'s sigmoid, group-limited, shared-expert MoE
behind ``first_k_dense_replace`` dense layers: the same keys and tensor names) and attends with grouped-query
attention: q/k/v biases (``attention_bias``: ``model.qkv_bias``; ``o_proj`` has none), RMSNorm of each query and
key head before RoPE with ``use_qk_norm`` (``model.qk_norm``), and RoPE on the first ``partial_rotary_factor``
of each head's channels (``model.rotary_dim`` = head_dim · factor; GLM-4.5: half), rotate-half pairs as ours.
Its ``partial_rotary_factor`` sits at the top level in the published config.json (transformers 4.x) and in
``rope_parameters`` in 5.x; both are read.

Its multi-token-prediction layer is read into our MTP modules when the run asks for them (``model.mtp_depth``),
as for DeepSeek-V3.
"""

from __future__ import annotations

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from interop.hf_deepseek_v3 import (
    SIGMOID_MOE_KEYS,
    mtp_sources,
    sigmoid_moe_config,
    sigmoid_moe_refusals,
    sigmoid_moe_shape,
    sigmoid_moe_sources,
)
from interop.hf_family import (
    DECODER_KEYS,
    Family,
    HFShape,
    Source,
    check_keys,
    decoder_config,
    decoder_shape,
    decoder_sources,
    get_key,
    llama_attention,
    refuse,
    rope_config,
)

ARCHITECTURE = "Glm4MoeForCausalLM"
FAMILY_NAME = "GLM-4.5"


def _rotary_dim(hf: dict, head_dim: int) -> int | None:
    """Our ``model.rotary_dim`` from ``partial_rotary_factor`` (top level or in ``rope_parameters``, one value)."""
    values = {hf[key]["partial_rotary_factor"] if key == "rope_parameters" else hf[key]
              for key in ("partial_rotary_factor", "rope_parameters")
              if key in hf and (key != "rope_parameters" or "partial_rotary_factor" in (hf[key] or {}))}
    if len(values) > 1:
        raise ConfigError(f"config.json gives partial_rotary_factor twice, differently: {sorted(values)}")
    factor = values.pop() if values else 1.0
    rotary = int(head_dim * factor)
    if not 0 < rotary <= head_dim or rotary % 2:
        raise ConfigError(f"config.json partial_rotary_factor={factor} is not supported: it rotates {rotary} of "
                          f"the {head_dim} channels of a head; an even number from 2 to {head_dim} is needed")
    return None if rotary == head_dim else rotary


def shape_from_hf(hf: dict) -> HFShape:
    """Map a GLM-4.5 config.json onto our ``model``/``moe`` keys; any setting we do not implement is an error."""
    check_keys(hf, DECODER_KEYS | SIGMOID_MOE_KEYS | {"use_qk_norm", "partial_rotary_factor"}, FAMILY_NAME)
    model = decoder_shape(hf, FAMILY_NAME, rope_theta=10000.0, qkv_bias=True, partial_rotary=True)
    head_dim = model["head_dim"] or model["d_model"] // model["n_heads"]
    model |= {"qk_norm": bool(get_key(hf, "use_qk_norm", FAMILY_NAME, False, required=False)),
              "rotary_dim": _rotary_dim(hf, head_dim)}
    dense, moe = sigmoid_moe_shape(hf, FAMILY_NAME, model["n_layers"])
    return HFShape(model | dense, moe, int(get_key(hf, "max_position_embeddings", FAMILY_NAME)), None)


def hf_from_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """The config.json of our model as a GLM-4.5; settings GLM-4.5 cannot express are errors."""
    factor = model.rope_dim / model.head_size
    refuse(ARCHITECTURE, [
        (model.latent_attention, f"model.kv_lora_rank={model.kv_lora_rank}: GLM-4.5 has no latent attention"),
        (model.sliding_window is not None, f"model.sliding_window={model.sliding_window}: GLM-4.5 attends fully"),
        (model.rope_scaling != "none", f"model.rope_scaling={model.rope_scaling!r}: GLM-4.5's import here takes "
                                       "plain RoPE only"),
        (int(model.head_size * factor) != model.rope_dim, f"model.rotary_dim={model.rotary_dim}: no "
                                                          "partial_rotary_factor gives it exactly"),
        *sigmoid_moe_refusals(model, moe, FAMILY_NAME)])
    decoder = decoder_config(model)
    del decoder["rope_theta"]  # in rope_parameters
    rope = rope_config(model)
    rope["rope_parameters"]["partial_rotary_factor"] = factor
    return {"architectures": [ARCHITECTURE], "model_type": "glm4_moe", **decoder, **rope,
            "attention_bias": model.qkv_bias, "use_qk_norm": model.qk_norm, **sigmoid_moe_config(model, moe)}


def hf_sources(model: ModelConfig, moe: MoEConfig) -> dict[str, Source]:
    """Each of our state-dict names (our model's order) and its HF source."""
    return decoder_sources(model, lambda i, ours, theirs: sigmoid_moe_sources(model, moe, i, ours, theirs)) \
        | mtp_sources(model, moe, llama_attention)


FAMILY = Family(ARCHITECTURE, "glm4_moe", shape_from_hf, hf_from_config, hf_sources)
