"""The Mixtral family (Hugging Face ``MixtralForCausalLM``) in our terms: config mapping and tensor names.

Mixtral's shape is our model exactly: pre-norm RMSNorm blocks, RoPE attention (grouped-query optional),
every layer MoE with a softmax-over-all-experts router, top-k, the k weights renormalised to sum to 1,
and SwiGLU experts. Attention and norms copy as they are (``interop/hf_family.py``); per expert HF keeps
``w1`` (gate, under silu) and ``w3`` (up) [H, D] and ``w2`` [D, H], so ``w_gate[e] = w1_e.T``,
``w_in[e] = w3_e.T``, ``w_out[e] = w2_e.T``. Our router's ``expert_bias`` (aux-loss-free balancing) has no
HF counterpart: zeros on import, and export refuses a model that uses it.
"""

from __future__ import annotations

from config.model import ModelConfig, MoEConfig
from interop.hf_family import (
    DECODER_KEYS,
    W13_EXPERTS,
    Family,
    HFShape,
    Source,
    attention_refusals,
    check_keys,
    check_requirements,
    decoder_config,
    decoder_shape,
    decoder_sources,
    expert_stacks,
    get_key,
    refuse,
    routed_moe,
    router_refusals,
)

ARCHITECTURE = "MixtralForCausalLM"


def shape_from_hf(hf: dict) -> HFShape:
    """Map a Mixtral config.json onto our ``model``/``moe`` keys; any setting we do not implement is an error."""
    check_keys(hf, DECODER_KEYS | {"intermediate_size", "num_local_experts", "num_experts_per_tok",
                                   "router_jitter_noise", "mlp_bias"}, "Mixtral")
    check_requirements(hf, {"router_jitter_noise": (0, "router_jitter_noise must be 0 (no HF-style jitter here)"),
                            "mlp_bias": (False, "mlp_bias must be false (no biases here)")})
    model = decoder_shape(hf, "Mixtral", rope_theta=1e6) | {"moe_every": 1, "first_moe_layer": 0, "qk_norm": False}
    moe = routed_moe(get_key(hf, "num_local_experts", "Mixtral"), get_key(hf, "num_experts_per_tok", "Mixtral"),
                     get_key(hf, "intermediate_size", "Mixtral"), renormalize=True)
    return HFShape(model, moe, int(get_key(hf, "max_position_embeddings", "Mixtral")), hf.get("sliding_window"))


def hf_from_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """The config.json of our model as a Mixtral; settings Mixtral cannot express are errors."""
    refuse(ARCHITECTURE, [
        (model.n_moe_layers != model.n_layers, "every layer must be MoE (model.moe_every=1, "
                                               "model.first_moe_layer=0, or model.mlp_layer_types all moe)"),
        (model.qk_norm, "model.qk_norm=true: Mixtral has no query/key norms"),
        (not moe.renormalize, "moe.renormalize=false: Mixtral renormalises the top-k weights"),
        *router_refusals(moe, "Mixtral"), *attention_refusals(model, "Mixtral")])
    return {"architectures": [ARCHITECTURE], "model_type": "mixtral", **decoder_config(model),
            "intermediate_size": moe.expert_hidden, "num_local_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "router_jitter_noise": 0.0}


def hf_sources(model: ModelConfig, moe: MoEConfig) -> dict[str, Source]:
    """Each of our state-dict names (our model's order) and its HF source."""
    def layer(i: int, ours: str, theirs: str) -> dict[str, Source]:
        return {f"{ours}moe.router.gate": Source("copy", (f"{theirs}block_sparse_moe.gate.weight",)),
                **expert_stacks(ours, f"{theirs}block_sparse_moe.experts", W13_EXPERTS, moe.num_experts)}
    return decoder_sources(model, layer)


FAMILY = Family(ARCHITECTURE, "mixtral", shape_from_hf, hf_from_config, hf_sources)
