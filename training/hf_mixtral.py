"""The Mixtral family (Hugging Face ``MixtralForCausalLM``) in our terms: config mapping and tensor layout.

Mixtral's shape is our model exactly: pre-norm RMSNorm blocks, RoPE attention (grouped-query optional),
every layer MoE with a softmax-over-all-experts router, top-k, the k weights renormalised to sum to 1,
and SwiGLU experts. What differs is naming and layout:

- our Linear weights are [out, in] like HF's, so attention, norms, router, embedding and head copy as
  they are; RoPE is the same convention: ``moe.transformer.apply_rope`` rotates the pairs (i, i + hd/2)
  of each head, as HF's ``rotate_half`` does, and q/k heads are contiguous blocks of hd rows in both;
- our routed experts are stacked and input-major: ``w_gate``/``w_in`` [E, D, H], ``w_out`` [E, H, D];
  HF keeps one module per expert, ``w1`` (gate, under silu) and ``w3`` (up) [H, D] and ``w2`` [D, H].
  So ``w_gate[e] = w1_e.T``, ``w_in[e] = w3_e.T``, ``w_out[e] = w2_e.T``;
- our router's ``expert_bias`` (aux-loss-free balancing) has no HF counterpart: zeros on import, and
  export refuses a model that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe.config import ConfigError, ModelConfig, MoEConfig

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"
SUPPORTED_ARCHITECTURES = (ARCHITECTURE,)

# config.json keys that do not change the model's function (token ids, generation, bookkeeping) or are
# training-only settings of HF's own trainer: read, and deliberately not mapped
IGNORED_KEYS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "initializer_range", "output_router_logits", "router_aux_loss_coef",
    "_name_or_path", "output_hidden_states", "output_attentions", "return_dict", "id2label", "label2id",
    "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "tokenizer_class",
}


@dataclass(frozen=True)
class HFShape:
    """What a Mixtral config.json fixes of our config: ``model``/``moe`` keys, and the longest context."""

    model: dict
    moe: dict
    max_positions: int
    sliding_window: int | None


def _get(hf: dict, key: str, default=None, required: bool = True):
    if key not in hf:
        if required:
            raise ConfigError(f"config.json has no '{key}', which a Mixtral config needs")
        return default
    return hf[key]


def check_architecture(hf: dict) -> None:
    """A Mixtral config.json, or an error naming what it is and what is supported."""
    architectures = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if model_type == MODEL_TYPE and (not architectures or list(architectures) == [ARCHITECTURE]):
        return
    what = ", ".join(architectures) or f"model_type {model_type!r}"
    raise ConfigError(f"unsupported architecture {what}: supported are {', '.join(SUPPORTED_ARCHITECTURES)} "
                      f"(model_type '{MODEL_TYPE}')")


def _rope_theta(hf: dict) -> float:
    """rope_theta, from ``rope_parameters`` (transformers 5) or the top-level key (4.x); default RoPE only."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        raise ConfigError(f"config.json rope_scaling={scaling!r} is not supported (plain RoPE only)")
    if params is not None:
        if params.get("rope_type", "default") != "default" or set(params) - {"rope_type", "rope_theta"}:
            raise ConfigError(f"config.json rope_parameters={params!r} is not supported: only rope_type 'default' "
                              "with rope_theta")
        return float(params["rope_theta"])
    return float(_get(hf, "rope_theta", 1e6, required=False))


def shape_from_hf(hf: dict) -> HFShape:
    """Map a Mixtral config.json onto our ``model``/``moe`` keys; any setting we do not implement is an error."""
    check_architecture(hf)
    handled = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "rope_parameters",
               "rope_scaling", "rms_norm_eps", "tie_word_embeddings", "num_local_experts", "num_experts_per_tok",
               "sliding_window", "router_jitter_noise", "attention_dropout", "hidden_act", "attention_bias",
               "mlp_bias"}
    unknown = sorted(set(hf) - handled - IGNORED_KEYS)
    if unknown:
        raise ConfigError(f"config.json setting '{unknown[0]}'={hf[unknown[0]]!r} is not supported by the Mixtral "
                          f"import (it would be silently dropped); unsupported keys: {', '.join(unknown)}")
    requirements = {"hidden_act": ("silu", "hidden_act must be 'silu' (SwiGLU experts)"),
                    "router_jitter_noise": (0, "router_jitter_noise must be 0 (no HF-style jitter here)"),
                    "attention_dropout": (0, "attention_dropout must be 0 (no attention dropout here)"),
                    "attention_bias": (False, "attention_bias must be false (no biases here)"),
                    "mlp_bias": (False, "mlp_bias must be false (no biases here)")}
    for key, (wanted, why) in requirements.items():
        if key in hf and hf[key] != wanted:
            raise ConfigError(f"config.json {key}={hf[key]!r} is not supported: {why}")
    hidden, heads = _get(hf, "hidden_size"), _get(hf, "num_attention_heads")
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim * heads != hidden:
        raise ConfigError(f"config.json head_dim={head_dim} is not supported: our head dim is "
                          f"hidden_size/num_attention_heads = {hidden}/{heads}")
    model = {"vocab_size": _get(hf, "vocab_size"), "d_model": hidden, "n_layers": _get(hf, "num_hidden_layers"),
             "n_heads": heads, "n_kv_heads": _get(hf, "num_key_value_heads", heads, required=False),
             "moe_every": 1, "first_moe_layer": 0,
             "tie_embeddings": bool(_get(hf, "tie_word_embeddings", False, required=False)),
             "rope_theta": _rope_theta(hf), "norm_eps": float(_get(hf, "rms_norm_eps", 1e-5, required=False))}
    moe = {"num_experts": _get(hf, "num_local_experts"), "top_k": _get(hf, "num_experts_per_tok"),
           "expert_hidden": _get(hf, "intermediate_size"), "activation": "swiglu", "score_func": "softmax",
           "renormalize": True, "jitter_eps": 0.0, "capacity_factor": None, "bias_update_rate": 0.0,
           "num_shared_experts": 0, "shared_expert_hidden": None, "force_balance": False}
    return HFShape(model, moe, int(_get(hf, "max_position_embeddings")), hf.get("sliding_window"))


def check_context(shape: HFShape, seq_len: int) -> None:
    """Our context must fit the model's positions, and a sliding window must not cut it (we attend fully)."""
    if seq_len > shape.max_positions:
        raise ConfigError(f"model.seq_len={seq_len} exceeds the folder's max_position_embeddings="
                          f"{shape.max_positions}")
    if shape.sliding_window is not None and shape.sliding_window < seq_len:
        raise ConfigError(f"config.json sliding_window={shape.sliding_window} is below model.seq_len={seq_len}: "
                          "sliding-window attention is not supported; use a seq_len within the window")


def hf_from_config(model: ModelConfig, moe: MoEConfig, dtype: str) -> dict:
    """The config.json of our model as a Mixtral; settings Mixtral cannot express are errors."""
    refusals = [
        (model.moe_every != 1 or model.first_moe_layer != 0, "every layer must be MoE (model.moe_every=1, "
                                                             "model.first_moe_layer=0)"),
        (moe.activation != "swiglu", f"moe.activation={moe.activation!r}: Mixtral experts are SwiGLU"),
        (moe.score_func != "softmax", f"moe.score_func={moe.score_func!r}: Mixtral's router is a softmax"),
        (not moe.renormalize, "moe.renormalize=false: Mixtral renormalises the top-k weights"),
        (moe.num_shared_experts != 0, f"moe.num_shared_experts={moe.num_shared_experts}: Mixtral has none"),
        (moe.bias_update_rate != 0, f"moe.bias_update_rate={moe.bias_update_rate}: Mixtral has no balancing bias"),
        (moe.force_balance, "moe.force_balance=true: a debug routing Mixtral does not have"),
        (moe.jitter_eps != 0, f"moe.jitter_eps={moe.jitter_eps}: Mixtral's jitter is another noise"),
    ]
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"cannot export as {ARCHITECTURE}: {why}")
    return {
        "architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, "vocab_size": model.vocab_size,
        "hidden_size": model.d_model, "intermediate_size": moe.expert_hidden, "num_hidden_layers": model.n_layers,
        "num_attention_heads": model.n_heads, "num_key_value_heads": model.kv_heads, "head_dim": model.head_dim,
        "max_position_embeddings": model.seq_len, "rope_theta": model.rope_theta, "rms_norm_eps": model.norm_eps,
        "tie_word_embeddings": model.tie_embeddings, "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.top_k, "sliding_window": None, "router_jitter_noise": 0.0,
        "attention_dropout": 0.0, "hidden_act": "silu", "torch_dtype": dtype,
    }


# --- tensor names and layouts ---------------------------------------------------------------------------

# our per-layer names -> HF's, for tensors that copy as they are
_LAYER_COPIES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                 "attn.wq.weight": "self_attn.q_proj.weight", "attn.wk.weight": "self_attn.k_proj.weight",
                 "attn.wv.weight": "self_attn.v_proj.weight", "attn.wo.weight": "self_attn.o_proj.weight",
                 "moe.router.gate": "block_sparse_moe.gate.weight"}
# our stacked expert weights -> HF's per-expert name (each stored transposed)
_EXPERT_STACKS = {"moe.experts.w_gate": "w1.weight", "moe.experts.w_in": "w3.weight", "moe.experts.w_out": "w2.weight"}


@dataclass(frozen=True)
class Source:
    """Where our tensor comes from: one HF tensor as it is (``kind`` "copy"), E stacked and transposed
    ("stack_t": names[e] is expert e), or nothing (the router's zero balancing bias, "zeros")."""

    kind: str
    names: tuple[str, ...]


def hf_sources(model: ModelConfig, moe: MoEConfig) -> dict[str, Source]:
    """Each of our state-dict names (our model's order) and its HF source."""
    out = {"tok_embeddings.weight": Source("copy", ("model.embed_tokens.weight",))}
    for i in range(model.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        for name in ("attn_norm.weight", "attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "attn.wo.weight",
                     "ffn_norm.weight", "moe.router.gate"):
            out[ours + name] = Source("copy", (theirs + _LAYER_COPIES[name],))
        out[ours + "moe.router.expert_bias"] = Source("zeros", ())
        for name, per_expert in _EXPERT_STACKS.items():
            out[ours + name] = Source("stack_t", tuple(f"{theirs}block_sparse_moe.experts.{e}.{per_expert}"
                                                       for e in range(moe.num_experts)))
    out["norm.weight"] = Source("copy", ("model.norm.weight",))
    # tied: the head is the embedding (HF's save_pretrained may leave lm_head out of the files)
    out["output.weight"] = Source("copy", ("model.embed_tokens.weight" if model.tie_embeddings else "lm_head.weight",))
    return out


def hf_targets(model: ModelConfig, moe: MoEConfig) -> dict[str, tuple[str, int | None]]:
    """Each HF tensor of an exported folder: (our name, expert index for a stacked weight, else None)."""
    out: dict[str, tuple[str, int | None]] = {}
    for ours, source in hf_sources(model, moe).items():
        if source.kind == "copy" and source.names[0] not in out:  # tied: the head is the embedding, once
            out[source.names[0]] = (ours, None)
        elif source.kind == "stack_t":
            out.update({name: (ours, e) for e, name in enumerate(source.names)})
    return out
