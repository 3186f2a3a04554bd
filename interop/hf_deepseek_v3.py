"""The DeepSeek-V3 family (Hugging Face ``DeepseekV3ForCausalLM``: DeepSeek-V3/V3.1, and Kimi K2, whose config.json
names this architecture with ``model_type: kimi_k2``) in our terms: config mapping and tensor names.

DeepSeek-V3 is our model with latent attention (``model.kv_lora_rank`` ...; ``moe/attention/latent.py``), YaRN
where ``rope_scaling`` says so, its first ``first_k_dense_replace`` layers dense (``model.first_moe_layer``,
width ``intermediate_size`` = ``model.ffn_hidden``) and the rest MoE: sigmoid scores, the correction bias
``e_score_correction_bias`` (our router's ``expert_bias``), group-limited top-k (``n_group``, ``topk_group``),
renormalised (``norm_topk_prob``) and scaled (``routed_scaling_factor``) weights, and ``n_shared_experts``
shared experts fused into one SwiGLU of ``n_shared_experts · moe_intermediate_size`` (``moe.num_shared_experts``,
``moe.shared_expert_hidden`` left null).

Tensors: embedding, norms, head and experts as in ``interop/hf_family.py`` (per expert ``gate_proj``/``up_proj``
[H, D], ``down_proj`` [D, H]; the router ``mlp.gate.weight``; the shared experts ``mlp.shared_experts.*``; a
dense layer's ``mlp.*``). Attention: ``q_proj`` (or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``),
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``: ours under our names, with one
difference of layout. DeepSeek's checkpoints (``rope_interleave``, true unless config.json says otherwise)
rotate the rotary channels of a head in adjacent pairs (2i, 2i + 1); ours rotate (i, i + r/2). Attention scores
are dot products, so the same function is the same weights with the rotary rows of ``q_proj``/``q_b_proj`` (per
head) and ``kv_a_proj_with_mqa`` reordered evens first, then odds (``Source.rows``); export writes them back
interleaved, DeepSeek's layout, which every DeepSeek-V3 consumer expects.

Published checkpoints store their linear weights in fp8 with block scales: dequantised to bf16 as they are read
(``interop/fp8.py``). The multi-token-prediction layer they store after the last (``num_nextn_predict_layers``)
is read into our MTP modules when the run asks for them (``model.mtp_depth``; ``mtp_sources``): config.json's
count is not enough to go by, since ``transformers`` writes ``num_nextn_predict_layers: 1`` into folders it saves
without that layer.
"""

from __future__ import annotations

from collections.abc import Callable

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from interop.fp8 import scheme
from interop.hf_family import (
    DECODER_KEYS,
    GATED_EXPERTS,
    Family,
    HFShape,
    Source,
    check_keys,
    check_requirements,
    decoder_config,
    decoder_shape,
    decoder_sources,
    expert_stacks,
    get_key,
    refuse,
    rope_config,
)

ARCHITECTURE = "DeepseekV3ForCausalLM"
FAMILY_NAME = "DeepSeek-V3"
MLP = {"w_in.weight": "up_proj.weight", "w_gate.weight": "gate_proj.weight", "w_out.weight": "down_proj.weight"}
# config.json keys of the sigmoid group-limited MoE that DeepSeek-V3 and GLM-4.5 share (``sigmoid_moe_shape``)
SIGMOID_MOE_KEYS = {"intermediate_size", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
                    "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                    "first_k_dense_replace", "num_nextn_predict_layers"}
# read and not mapped: training-only balancing settings of DeepSeek's own trainer, inference placement, and the
# remote-code pointer of the published folders
_IGNORED = {"aux_loss_alpha", "seq_aux", "ep_size", "auto_map", "pretraining_tp", "qk_head_dim"}
_LATENT = {"q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"}


def sigmoid_moe_shape(hf: dict, family: str, n_layers: int) -> tuple[dict, dict]:
    """Our ``model`` (dense first layers) and ``moe`` keys of the sigmoid, group-limited, shared-expert MoE.

    ``num_nextn_predict_layers`` is read and not used: the MTP layer's tensors are not read (no MTP here yet).
    """
    dense = get_key(hf, "first_k_dense_replace", family, 0, required=False)
    if dense < 0:
        raise ConfigError(f"config.json first_k_dense_replace={dense} must be >= 0")
    shared = get_key(hf, "n_shared_experts", family)
    if not shared or shared < 1:
        raise ConfigError(f"config.json n_shared_experts={shared!r} is not supported: {family}'s MoE layers have "
                          "shared experts (a width of n_shared_experts * moe_intermediate_size)")
    experts = get_key(hf, "n_routed_experts", family)
    groups = get_key(hf, "n_group", family, 1, required=False) or 1
    model = {"moe_every": 1 if dense < n_layers else 0, "first_moe_layer": dense if dense < n_layers else 0,
             "ffn_hidden": get_key(hf, "intermediate_size", family)}
    moe = {"num_experts": experts, "top_k": get_key(hf, "num_experts_per_tok", family),
           "expert_hidden": get_key(hf, "moe_intermediate_size", family), "activation": "swiglu",
           "score_func": "sigmoid", "renormalize": bool(get_key(hf, "norm_topk_prob", family, True, False)),
           "n_group": groups, "topk_group": get_key(hf, "topk_group", family, groups, required=False) or groups,
           "routed_scaling_factor": float(get_key(hf, "routed_scaling_factor", family, 1.0, required=False)),
           "jitter_eps": 0.0, "capacity_factor": None, "num_shared_experts": shared, "shared_expert_hidden": None,
           "force_balance": False}
    return model, moe


def sigmoid_moe_refusals(model: ModelConfig, moe: MoEConfig, family: str) -> list[tuple[bool, str]]:
    """What the HF sigmoid group-limited MoE cannot express of ours."""
    return [
        (not _dense_then_moe(model), f"{_pattern_keys(model)}: {family}'s layers are MoE from first_k_dense_replace "
                                     "on (model.moe_every=1 from model.first_moe_layer)"),
        (moe.activation != "swiglu", f"moe.activation={moe.activation!r}: {family} experts are SwiGLU"),
        (moe.score_func != "sigmoid", f"moe.score_func={moe.score_func!r}: {family}'s router scores by sigmoid"),
        (moe.num_shared_experts == 0 or moe.shared_hidden % moe.expert_hidden != 0,
         f"shared experts of width {moe.shared_hidden if moe.num_shared_experts else 0}: {family} has shared "
         f"experts of a multiple of moe.expert_hidden={moe.expert_hidden} (n_shared_experts of them)"),
        (moe.num_experts // moe.n_group < 2, f"moe.n_group={moe.n_group} makes groups of one expert: {family}'s "
                                             "gate ranks groups by their two best experts (transformers fails on "
                                             "fewer)"),
        (moe.force_balance, f"moe.force_balance=true: a debug routing {family} does not have"),
        (moe.jitter_eps != 0, f"moe.jitter_eps={moe.jitter_eps}: {family} has no such noise"),
    ]


def sigmoid_moe_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """The config.json keys of ``sigmoid_moe_shape``, for our model (refused first by ``sigmoid_moe_refusals``)."""
    return {"intermediate_size": model.ffn_hidden, "moe_intermediate_size": moe.expert_hidden,
            "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "n_shared_experts": moe.shared_hidden // moe.expert_hidden, "n_group": moe.n_group,
            "topk_group": moe.groups_per_token, "routed_scaling_factor": moe.routed_scaling_factor,
            "norm_topk_prob": moe.renormalize, "num_nextn_predict_layers": model.mtp_depth,
            "first_k_dense_replace": model.n_layers - model.n_moe_layers}


def _pattern_keys(model: ModelConfig) -> str:
    """The keys that gave the model its MoE layers, as the user wrote them."""
    if model.mlp_layer_types is not None:
        return f"model.mlp_layer_types={model.mlp_layer_types}"
    return f"model.moe_every={model.moe_every} (model.first_moe_layer={model.first_moe_layer})"


def _dense_then_moe(model: ModelConfig) -> bool:
    """Whether the layer pattern is dense layers first, then MoE layers to the last (or no MoE layer at all)."""
    return all(model.is_moe_layer(i) == (i >= model.n_layers - model.n_moe_layers) for i in range(model.n_layers))


def sigmoid_moe_sources(model: ModelConfig, moe: MoEConfig, i: int, ours: str, theirs: str) -> dict[str, Source]:
    """Layer i's feed-forward tensors: a dense SwiGLU, or router, correction bias, experts and shared experts."""
    if not model.is_moe_layer(i):
        return {f"{ours}ffn.{name}": Source("copy", (f"{theirs}mlp.{hf_name}",)) for name, hf_name in MLP.items()}
    out = {f"{ours}moe.router.gate": Source("copy", (f"{theirs}mlp.gate.weight",)),
           **expert_stacks(ours, f"{theirs}mlp.experts", GATED_EXPERTS, moe.num_experts)}
    out[f"{ours}moe.router.expert_bias"] = Source("copy", (f"{theirs}mlp.gate.e_score_correction_bias",))
    out.update({f"{ours}moe.shared_experts.{name}": Source("copy", (f"{theirs}mlp.shared_experts.{hf_name}",))
                for name, hf_name in MLP.items()})
    return out


def mtp_sources(model: ModelConfig, moe: MoEConfig,
                attention: Callable[[ModelConfig, str, str], dict[str, Source]]) -> dict[str, Source]:
    """The multi-token-prediction modules' tensors (``model.mtp_depth``; ``moe/mtp.py``): module k is the layer
    after the last plus k, as DeepSeek-V3 and GLM-4.5 store it: ``enorm``, ``hnorm``, ``eh_proj`` (its input the
    normalised embedding, then the normalised states: ours), ``shared_head.norm``, and a decoder layer's own
    tensors. The copies of the embedding and head stored beside them are not read (ours are shared) nor written."""
    out = {}
    for k in range(model.mtp_depth):
        index = model.n_layers + k
        ours, theirs = f"mtp.{k}.", f"model.layers.{index}."
        out |= {ours + name: Source("copy", (theirs + hf_name,)) for name, hf_name in (
            ("embed_norm.weight", "enorm.weight"), ("hidden_norm.weight", "hnorm.weight"),
            ("proj.weight", "eh_proj.weight"), ("norm.weight", "shared_head.norm.weight"))}
        out |= attention(model, ours + "block.", theirs)
        out |= sigmoid_moe_sources(model, moe, index, ours + "block.", theirs)
    return out


def shape_from_hf(hf: dict) -> HFShape:
    """Map a DeepSeek-V3 config.json onto our ``model``/``moe`` keys; any setting we do not implement is an error."""
    return latent_moe_shape(hf, FAMILY_NAME)


def latent_moe_shape(hf: dict, family: str, keys: frozenset[str] = frozenset()) -> HFShape:
    """DeepSeek-V3's config.json mapping, for it and the families built on it (``interop/hf_deepseek_v32.py``),
    whose own ``keys`` they map themselves."""
    check_keys(hf, DECODER_KEYS | SIGMOID_MOE_KEYS | _LATENT | _IGNORED | keys
               | {"scoring_func", "topk_method", "moe_layer_freq", "rope_interleave", "quantization_config"},
               family)
    scheme(hf)  # fp8 with block scales is dequantised as it is read (``interop/fp8.py``); others refused
    check_requirements(hf, {
        "scoring_func": ("sigmoid", "scoring_func must be 'sigmoid' (DeepSeek-V3's router)"),
        "topk_method": ("noaux_tc", "topk_method must be 'noaux_tc' (group-limited top-k on the biased scores)"),
        "moe_layer_freq": (1, "moe_layer_freq must be 1 (every layer from first_k_dense_replace on is MoE)"),
        "rope_interleave": (True, "rope_interleave must be true (DeepSeek's layout; the import reorders it)"),
        "pretraining_tp": (1, "pretraining_tp must be 1"),
    })
    model = decoder_shape(hf, family, rope_theta=10000.0, yarn=True)
    heads, rope_dim = model["n_heads"], get_key(hf, "qk_rope_head_dim", family)
    if model["n_kv_heads"] != heads:
        raise ConfigError(f"config.json num_key_value_heads={model['n_kv_heads']} is not supported: latent "
                          f"attention has keys and values for every head (num_attention_heads={heads})")
    for key, value in (("head_dim", rope_dim),
                       ("qk_head_dim", get_key(hf, "qk_nope_head_dim", family) + rope_dim)):
        if key in hf and hf[key] != value:
            raise ConfigError(f"config.json {key}={hf[key]} is not supported: latent attention's is {value}")
    model |= {"n_kv_heads": None, "head_dim": None, "qk_norm": False,
              **{key: get_key(hf, key, family, required=key != "q_lora_rank") for key in _LATENT}}
    dense, moe = sigmoid_moe_shape(hf, family, model["n_layers"])
    return HFShape(model | dense, moe, int(get_key(hf, "max_position_embeddings", family)), None)


def hf_from_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """The config.json of our model as a DeepSeek-V3; settings DeepSeek-V3 cannot express are errors."""
    refuse(ARCHITECTURE, [(not model.latent_attention,
                           "model.kv_lora_rank=null: DeepSeek-V3 attends with latent attention"),
                          (model.sparse_attention, f"model.index_topk={model.index_topk}: DeepSeek-V3 attends "
                                                   "densely (sparse attention is DeepSeek-V3.2's)"),
                          *sigmoid_moe_refusals(model, moe, FAMILY_NAME)])
    decoder = decoder_config(model)
    del decoder["rope_theta"]  # in rope_parameters
    return {"architectures": [ARCHITECTURE], "model_type": "deepseek_v3", **decoder, **rope_config(model),
            "num_key_value_heads": model.n_heads, "head_dim": model.qk_rope_head_dim,
            **{key: getattr(model, key) for key in sorted(_LATENT)}, "rope_interleave": True,
            **sigmoid_moe_config(model, moe)}


def interleaved_rows(width: int, rope_dim: int, blocks: int) -> tuple[int, ...]:
    """Our row order of a projection whose ``blocks`` blocks of ``width`` rows end in ``rope_dim`` rotary rows in
    DeepSeek's interleaved order: our rotary row j < r/2 is their 2j, row r/2 + j their 2j + 1."""
    rotary = [2 * j for j in range(rope_dim // 2)] + [2 * j + 1 for j in range(rope_dim // 2)]
    plain = width - rope_dim
    return tuple(b * width + row for b in range(blocks) for row in [*range(plain), *(plain + r for r in rotary)])


def latent_attention(model: ModelConfig, ours: str, theirs: str) -> dict[str, Source]:
    """A layer's latent-attention and norm tensors, the rotary rows put in our order."""
    attn = f"{theirs}self_attn."
    qk = model.qk_nope_head_dim + model.qk_rope_head_dim
    query_rows = interleaved_rows(qk, model.qk_rope_head_dim, model.n_heads)
    out = {f"{ours}attn_norm.weight": Source("copy", (f"{theirs}input_layernorm.weight",))}
    if model.q_lora_rank is None:
        out[f"{ours}attn.wq.weight"] = Source("copy", (f"{attn}q_proj.weight",), query_rows)
    else:
        out |= {f"{ours}attn.wq_a.weight": Source("copy", (f"{attn}q_a_proj.weight",)),
                f"{ours}attn.q_latent_norm.weight": Source("copy", (f"{attn}q_a_layernorm.weight",)),
                f"{ours}attn.wq_b.weight": Source("copy", (f"{attn}q_b_proj.weight",), query_rows)}
    latent_rows = interleaved_rows(model.kv_lora_rank + model.qk_rope_head_dim, model.qk_rope_head_dim, 1)
    out |= {f"{ours}attn.wkv_a.weight": Source("copy", (f"{attn}kv_a_proj_with_mqa.weight",), latent_rows),
            f"{ours}attn.kv_latent_norm.weight": Source("copy", (f"{attn}kv_a_layernorm.weight",)),
            f"{ours}attn.wkv_b.weight": Source("copy", (f"{attn}kv_b_proj.weight",)),
            f"{ours}attn.wo.weight": Source("copy", (f"{attn}o_proj.weight",)),
            f"{ours}ffn_norm.weight": Source("copy", (f"{theirs}post_attention_layernorm.weight",))}
    return out


def hf_sources(model: ModelConfig, moe: MoEConfig) -> dict[str, Source]:
    """Each of our state-dict names (our model's order) and its HF source."""
    return decoder_sources(model, lambda i, ours, theirs: sigmoid_moe_sources(model, moe, i, ours, theirs),
                           latent_attention) | mtp_sources(model, moe, latent_attention)


# Kimi K2's config.json names this architecture with model_type kimi_k2 (and its own remote code): the same model
FAMILY = Family(ARCHITECTURE, "deepseek_v3", shape_from_hf, hf_from_config, hf_sources, ("kimi_k2",))
