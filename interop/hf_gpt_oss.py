"""The GPT-OSS family (Hugging Face ``GptOssForCausalLM``) in our terms: config mapping and tensor names.

GPT-OSS is our model with its options on (``config/model.py``): grouped-query attention with biases on q/k/v and
o (``attention_bias``: ``model.qkv_bias`` and ``model.attn_output_bias``), one learned sink logit per head
(``self_attn.sinks`` [heads]: ``model.attention_sinks``), layers of ``layer_types`` attending within a
``sliding_window`` or fully (``model.sliding_window``/``layer_types``; transformers' default when absent: sliding
from the first layer on, alternating), YaRN without truncation (``model.yarn_truncate``), every layer MoE with a
biased router (``mlp.router.weight``/``bias``: ``moe.router_bias``) whose top-k logits are softmaxed (softmax and
renormalise, equal) and biased experts under the clamped SwiGLU (``swiglu_alpha``, ``swiglu_limit``).

Experts are stored stacked and input-major like ours: ``gate_up_proj`` [E, D, 2H] holds gate and up interleaved
in its columns (gate in the even ones, up in the odd: transformers' ``gate_up[..., ::2]``/``[..., 1::2]``),
``gate_up_proj_bias`` [E, 2H] likewise, ``down_proj`` [E, H, D] and ``down_proj_bias`` [E, D] are ours as they
are. The published checkpoints store ``gate_up_proj`` and ``down_proj`` in MXFP4 (``*_blocks``/``*_scales``),
dequantised to bf16 as they are read (``interop/mxfp4.py``). Export writes bf16, unquantised.
"""

from __future__ import annotations

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from interop import mxfp4
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
    routed_moe,
    router_refusals,
)

ARCHITECTURE = "GptOssForCausalLM"
FAMILY_NAME = "GPT-OSS"
# the published config.json's own keys: experts_per_token repeats num_experts_per_tok (checked equal);
# initial_context_length repeats YaRN's original_max_position_embeddings (read there)
_KEYS = {"intermediate_size", "num_local_experts", "num_experts_per_tok", "experts_per_token", "swiglu_alpha",
         "swiglu_limit", "layer_types", "quantization_config", "initial_context_length"}
_LAYER_TYPES = ("sliding_attention", "full_attention")


def _top_k(hf: dict) -> int:
    """``num_experts_per_tok`` (transformers) or ``experts_per_token`` (OpenAI's keys, in the published config)."""
    values = {hf[key] for key in ("num_experts_per_tok", "experts_per_token") if key in hf}
    if len(values) > 1:
        raise ConfigError(f"config.json num_experts_per_tok={hf['num_experts_per_tok']!r} and experts_per_token="
                          f"{hf['experts_per_token']!r} disagree")
    if not values:
        raise ConfigError(f"config.json has no 'num_experts_per_tok', which a {FAMILY_NAME} config needs")
    return values.pop()


def _attention(hf: dict, n_layers: int) -> dict:
    """Our window keys: transformers' default ``layer_types`` (sliding on even layers) when absent."""
    window = get_key(hf, "sliding_window", FAMILY_NAME, None, required=False)
    kinds = hf.get("layer_types") or [_LAYER_TYPES[i % 2] for i in range(n_layers)]
    unknown = [(i, kind) for i, kind in enumerate(kinds) if kind not in _LAYER_TYPES]
    if unknown or len(kinds) != n_layers:
        which = f"; layer_types[{unknown[0][0]}]={unknown[0][1]!r}" if unknown else ""
        raise ConfigError(f"config.json layer_types={kinds!r} must give each of the {n_layers} layers one of "
                          f"{list(_LAYER_TYPES)}{which}")
    if "sliding_attention" not in kinds:
        window = None  # nothing slides: the window, if given, is unused
    elif window is None or window < 1:
        raise ConfigError(f"config.json sliding_window={window!r}: its layer_types have sliding_attention layers, "
                          "which need a positive window")
    return {"sliding_window": window, "layer_types": None if window is None else list(kinds),
            "attention_sinks": True, "attn_output_bias": bool(hf.get("attention_bias", True))}


def shape_from_hf(hf: dict) -> HFShape:
    """Map a GPT-OSS config.json onto our ``model``/``moe`` keys; any setting we do not implement is an error."""
    check_keys(hf, DECODER_KEYS | _KEYS, FAMILY_NAME)
    if "quantization_config" in hf and not mxfp4.declared(hf):
        raise ConfigError(f"config.json quantization_config={hf['quantization_config']!r} is not supported: "
                          f"{FAMILY_NAME} folders are read unquantised or with MXFP4 experts (quant_method 'mxfp4')")
    model = decoder_shape(hf | {"attention_bias": hf.get("attention_bias", True)}, FAMILY_NAME, rope_theta=150000.0,
                          yarn=True, qkv_bias=True)
    model |= {"moe_every": 1, "first_moe_layer": 0, "qk_norm": False,
              "ffn_hidden": get_key(hf, "intermediate_size", FAMILY_NAME), **_attention(hf, model["n_layers"])}
    moe = routed_moe(get_key(hf, "num_local_experts", FAMILY_NAME), _top_k(hf),
                     get_key(hf, "intermediate_size", FAMILY_NAME), renormalize=True)
    moe |= {"activation": "clamped_swiglu", "router_bias": True, "expert_proj_bias": True,
            "swiglu_alpha": float(get_key(hf, "swiglu_alpha", FAMILY_NAME, 1.702, required=False)),
            "swiglu_limit": float(get_key(hf, "swiglu_limit", FAMILY_NAME, 7.0, required=False))}
    return HFShape(model, moe, int(get_key(hf, "max_position_embeddings", FAMILY_NAME)), None)


def hf_from_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """The config.json of our model as a GPT-OSS; settings GPT-OSS cannot express are errors."""
    refuse(ARCHITECTURE, [
        (not model.attention_sinks, "model.attention_sinks=false: GPT-OSS has a sink logit on every head"),
        (model.qkv_bias != model.attn_output_bias, f"model.qkv_bias={model.qkv_bias} with model.attn_output_bias="
                                                   f"{model.attn_output_bias}: GPT-OSS's attention_bias sets both"),
        (model.n_moe_layers != model.n_layers, "every layer must be MoE (model.moe_every=1, "
                                               "model.first_moe_layer=0, or model.mlp_layer_types all moe)"),
        (model.latent_attention, f"model.kv_lora_rank={model.kv_lora_rank}: GPT-OSS has no latent attention"),
        (model.qk_norm, "model.qk_norm=true: GPT-OSS has no query/key norms"),
        (model.rotary_dim is not None, f"model.rotary_dim={model.rotary_dim}: GPT-OSS rotates whole heads"),
        (model.mtp_depth > 0, f"model.mtp_depth={model.mtp_depth}: GPT-OSS has no multi-token prediction"),
        (not (moe.router_bias and moe.expert_proj_bias), "moe.router_bias and moe.expert_proj_bias must be true: "
                                                         "GPT-OSS's router and experts have biases"),
        (not moe.renormalize, "moe.renormalize=false: GPT-OSS softmaxes the top-k logits (weights summing to 1)"),
        *router_refusals(moe, FAMILY_NAME, activation="clamped_swiglu")])
    kinds = [("sliding_attention" if model.attention_window(i) else "full_attention") for i in range(model.n_layers)]
    decoder = decoder_config(model)
    del decoder["rope_theta"]  # in rope_parameters
    return {"architectures": [ARCHITECTURE], "model_type": "gpt_oss", **decoder, **rope_config(model),
            "attention_bias": model.qkv_bias, "sliding_window": model.sliding_window, "layer_types": kinds,
            "intermediate_size": moe.expert_hidden, "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "swiglu_alpha": moe.swiglu_alpha, "swiglu_limit": moe.swiglu_limit}


def attention(model: ModelConfig, ours: str, theirs: str) -> dict[str, Source]:
    """Llama's attention tensors, o's bias and the sinks."""
    out = llama_attention(model, ours, theirs) | {f"{ours}attn.sinks": Source("copy", (f"{theirs}self_attn.sinks",))}
    if model.attn_output_bias:
        out[f"{ours}attn.wo.bias"] = Source("copy", (f"{theirs}self_attn.o_proj.bias",))
    return out


def hf_sources(model: ModelConfig, moe: MoEConfig) -> dict[str, Source]:
    """Each of our state-dict names (our model's order) and its HF source."""
    def layer(i: int, ours: str, theirs: str) -> dict[str, Source]:
        mlp, experts = f"{theirs}mlp.", f"{ours}moe.experts."
        gate_up, gate_up_bias = (f"{mlp}experts.gate_up_proj",), (f"{mlp}experts.gate_up_proj_bias",)
        return {f"{ours}moe.router.gate": Source("copy", (f"{mlp}router.weight",)),
                f"{ours}moe.router.gate_bias": Source("copy", (f"{mlp}router.bias",)),
                f"{ours}moe.router.expert_bias": Source("zeros", ()),
                f"{experts}w_in": Source("copy", gate_up, columns=(1, 2)),
                f"{experts}w_gate": Source("copy", gate_up, columns=(0, 2)),
                f"{experts}w_out": Source("copy", (f"{mlp}experts.down_proj",)),
                f"{experts}in_bias": Source("copy", gate_up_bias, columns=(1, 2)),
                f"{experts}gate_bias": Source("copy", gate_up_bias, columns=(0, 2)),
                f"{experts}out_bias": Source("copy", (f"{mlp}experts.down_proj_bias",))}
    return decoder_sources(model, layer, attention)


FAMILY = Family(ARCHITECTURE, "gpt_oss", shape_from_hf, hf_from_config, hf_sources,
                export_dtype=("bf16", "its experts unquantised, not re-packed as MXFP4"))
