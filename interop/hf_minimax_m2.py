"""The MiniMax-M2 family (Hugging Face ``MiniMaxM2ForCausalLM``) in our terms: config mapping and tensor names.

MiniMax-M2 is a plain full-attention MoE: grouped-query attention with RoPE on the first ``rotary_dim`` channels
of each head (our ``model.rotary_dim``; transformers 5 also writes it as ``partial_rotary_factor``), and one
RMSNorm over all heads' queries and one over all heads' keys before the heads are split (``qk_norm_type``
"per_layer": our ``model.qk_norm_type=per_layer``, weights [nh·hd] and [nkv·hd]); every layer MoE, routed as
DeepSeek-V3 routes within one group: sigmoid scores, the top-k of scores plus ``e_score_correction_bias`` (our
router's ``expert_bias``), weights the unbiased scores renormalised, unscaled; no shared expert. The experts are
Mixtral's, under ``block_sparse_moe`` (``w1`` gate, ``w3`` up, ``w2`` down, per expert), and ``intermediate_size``
is an expert's width.

Read and refused by name: MiniMax-01's lightning-attention layers (``attn_type_list`` entries other than 1), a
shared expert (``shared_intermediate_size``), scores other than sigmoid, no routing bias, per-head or no q/k
norms. The published config.json's multi-token-prediction keys (``use_mtp``, ``num_mtp_modules``,
``mtp_transformer_layers``) are read and not used: no MTP module is built for this family, and a tensor of one in
the folder is refused as unread. Its ``quantization_config`` (the release's block-scaled fp8) is not taken:
import a bf16 copy of the weights.
"""

from __future__ import annotations

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from interop.hf_family import (
    DECODER_KEYS,
    W13_EXPERTS,
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

ARCHITECTURE = "MiniMaxM2ForCausalLM"
FAMILY_NAME = "MiniMax-M2"
_KEYS = {"intermediate_size", "num_local_experts", "num_experts_per_tok", "router_jitter_noise", "use_qk_norm",
         "qk_norm_type", "rotary_dim", "partial_rotary_factor", "scoring_func", "use_routing_bias",
         "shared_intermediate_size", "attn_type_list", "use_mtp", "num_mtp_modules", "mtp_transformer_layers",
         "auto_map"}


def _rotary_dim(hf: dict, head_dim: int) -> int | None:
    """Our ``model.rotary_dim``: config.json's ``rotary_dim``, or head_dim · ``partial_rotary_factor`` (top level or
    in ``rope_parameters``); the two must agree where both are given."""
    factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    rotary = hf.get("rotary_dim")
    if rotary is None:
        rotary = head_dim if factor is None else int(head_dim * factor)
    elif factor is not None and int(head_dim * factor) != rotary:
        raise ConfigError(f"config.json rotary_dim={rotary} and partial_rotary_factor={factor} disagree (head_dim "
                          f"{head_dim})")
    if not 0 < rotary <= head_dim or rotary % 2:
        raise ConfigError(f"config.json rotary_dim={rotary} is not supported: an even number from 2 to the head's "
                          f"{head_dim} channels is needed")
    return None if rotary == head_dim else rotary


def shape_from_hf(hf: dict) -> HFShape:
    """Map a MiniMax-M2 config.json onto our ``model``/``moe`` keys; any setting we do not implement is an error."""
    check_keys(hf, DECODER_KEYS | _KEYS, FAMILY_NAME)
    check_requirements(hf, {
        "router_jitter_noise": (0, "router_jitter_noise must be 0 (no HF-style jitter here)"),
        "use_qk_norm": (True, "use_qk_norm must be true (MiniMax-M2 normalises queries and keys)"),
        "qk_norm_type": ("per_layer", "qk_norm_type must be 'per_layer' (one norm over all heads' channels)"),
        "scoring_func": ("sigmoid", "scoring_func must be 'sigmoid' (MiniMax-M2's router)"),
        "use_routing_bias": (True, "use_routing_bias must be true (the correction bias picks the experts)"),
        "shared_intermediate_size": (0, "shared_intermediate_size must be 0 (no shared expert here)")})
    kinds = hf.get("attn_type_list")
    if kinds is not None and any(kind != 1 for kind in kinds):
        raise ConfigError(f"config.json attn_type_list={kinds} is not supported: every layer must be full attention "
                          "(1); MiniMax-01's lightning-attention layers (0) are not built here")
    model = decoder_shape(hf, FAMILY_NAME, rope_theta=5000000.0, partial_rotary=True)
    head_dim = model["head_dim"] or model["d_model"] // model["n_heads"]
    model |= {"moe_every": 1, "first_moe_layer": 0, "qk_norm": True, "qk_norm_type": "per_layer",
              "rotary_dim": _rotary_dim(hf, head_dim), "mtp_depth": 0}
    moe = {"num_experts": get_key(hf, "num_local_experts", FAMILY_NAME),
           "top_k": get_key(hf, "num_experts_per_tok", FAMILY_NAME),
           "expert_hidden": get_key(hf, "intermediate_size", FAMILY_NAME), "activation": "swiglu",
           "score_func": "sigmoid", "renormalize": True, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
           "jitter_eps": 0.0, "capacity_factor": None, "num_shared_experts": 0, "shared_expert_hidden": None,
           "force_balance": False}
    return HFShape(model, moe, int(get_key(hf, "max_position_embeddings", FAMILY_NAME)), None)


def hf_from_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """The config.json of our model as a MiniMax-M2; settings MiniMax-M2 cannot express are errors."""
    refuse(ARCHITECTURE, [
        (model.latent_attention, f"model.kv_lora_rank={model.kv_lora_rank}: {FAMILY_NAME} has no latent attention"),
        (not model.qk_norm or model.qk_norm_type != "per_layer",
         f"model.qk_norm_type={model.qk_norm_type!r} (qk_norm={model.qk_norm}): {FAMILY_NAME} normalises all heads' "
         "queries and keys at once (model.qk_norm=true, model.qk_norm_type=per_layer)"),
        (model.qkv_bias or model.attn_output_bias or model.attention_sinks or model.attn_output_gate,
         f"attention biases, sinks or an output gate: {FAMILY_NAME} has none"),
        (model.sliding_window is not None or model.layer_types is not None,
         f"sliding windows or other attention kinds: {FAMILY_NAME} attends fully in every layer"),
        (model.rope_scaling != "none", f"model.rope_scaling={model.rope_scaling!r}: plain RoPE only"),
        (model.mtp_depth > 0, f"model.mtp_depth={model.mtp_depth}: the {FAMILY_NAME} export writes no MTP module"),
        (model.n_moe_layers != model.n_layers, f"dense layers: every {FAMILY_NAME} layer is MoE"),
        (moe.activation != "swiglu", f"moe.activation={moe.activation!r}: {FAMILY_NAME} experts are SwiGLU"),
        (moe.score_func != "sigmoid", f"moe.score_func={moe.score_func!r}: {FAMILY_NAME}'s router scores by sigmoid"),
        (not moe.renormalize, f"moe.renormalize=false: {FAMILY_NAME} renormalises the top-k weights"),
        (moe.num_shared_experts != 0, f"moe.num_shared_experts={moe.num_shared_experts}: {FAMILY_NAME} has none"),
        (moe.group_limited, f"moe.topk_group={moe.topk_group} of moe.n_group={moe.n_group}: {FAMILY_NAME} routes "
                            "over every expert"),
        (moe.routed_scaling_factor != 1, f"moe.routed_scaling_factor={moe.routed_scaling_factor}: {FAMILY_NAME} "
                                         "does not scale the routed weights"),
        (moe.force_balance or moe.jitter_eps != 0, f"debug routing or jitter: {FAMILY_NAME} has neither")])
    decoder = decoder_config(model)
    del decoder["rope_theta"]  # in rope_parameters
    rope = rope_config(model)
    rope["rope_parameters"]["partial_rotary_factor"] = model.rope_dim / model.head_size
    return {"architectures": [ARCHITECTURE], "model_type": "minimax_m2", **decoder, **rope,
            "rotary_dim": model.rope_dim, "intermediate_size": moe.expert_hidden,
            "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k, "router_jitter_noise": 0.0,
            "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
            "shared_intermediate_size": 0, "attn_type_list": [1] * model.n_layers}


def hf_sources(model: ModelConfig, moe: MoEConfig) -> dict[str, Source]:
    """Each of our state-dict names (our model's order) and its HF source."""
    def layer(i: int, ours: str, theirs: str) -> dict[str, Source]:
        out = {f"{ours}moe.router.gate": Source("copy", (f"{theirs}block_sparse_moe.gate.weight",)),
               **expert_stacks(ours, f"{theirs}block_sparse_moe.experts", W13_EXPERTS, moe.num_experts)}
        out[f"{ours}moe.router.expert_bias"] = Source("copy", (f"{theirs}block_sparse_moe.e_score_correction_bias",))
        return out
    return decoder_sources(model, layer)


FAMILY = Family(ARCHITECTURE, "minimax_m2", shape_from_hf, hf_from_config, hf_sources)
