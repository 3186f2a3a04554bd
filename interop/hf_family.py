"""What every Hugging Face family shares: the family record, the config keys all decoders map alike, and the
Llama-style tensor names of embedding, attention and norms.

A family (``interop/hf_mixtral.py``, ``interop/hf_qwen3_moe.py``) is a ``Family``: its ``config.json``
mapping onto our ``model``/``moe`` keys (every setting we do not implement an error naming it), the way back,
and where each of our tensors comes from. ``interop/hf.py`` looks families up by the architecture that
``config.json`` names (its ``FAMILIES``) and does the reading, writing and streaming for all of them.

Both families, like Llama, keep attention and norms under the same names and layouts as ours: Linear weights
[out, in], q/k heads as contiguous blocks of hd rows, RoPE rotating the pairs (i, i + hd/2) of each head
(``moe.rope.apply_rope``, HF's ``rotate_half``). Routed experts differ: ours are stacked and
input-major (``w_gate``/``w_in`` [E, D, H], ``w_out`` [E, H, D]), HF keeps one [out, in] matrix per expert,
so a stack is its E HF matrices transposed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig

# config.json keys that do not change the model's function (token ids, generation, bookkeeping) or are
# training-only settings of HF's own trainer: read, and deliberately not mapped
IGNORED_KEYS = {
    "architectures", "model_type", "transformers_version", "torch_dtype", "dtype", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache", "initializer_range", "output_router_logits", "router_aux_loss_coef",
    "_name_or_path", "output_hidden_states", "output_attentions", "return_dict", "id2label", "label2id",
    "problem_type", "chunk_size_feed_forward", "is_encoder_decoder", "tokenizer_class",
}
# config.json keys every family here maps alike (``decoder_shape``)
DECODER_KEYS = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "max_position_embeddings", "rope_theta", "rope_parameters", "rope_scaling",
                "rms_norm_eps", "tie_word_embeddings", "sliding_window", "attention_dropout", "hidden_act",
                "attention_bias"}


# the JSON type each number or switch of config.json must have, and whether null is allowed (it then means what the
# key's absence means: num_key_value_heads null is multi-head attention, q_lora_rank null a full-rank query, ...);
# checked for every family before its own code reads them (``check_value_types``), so a wrong one is named by its
# key rather than failing in arithmetic or under our key's name. Keys of the rope dicts are checked inside them.
_INTEGER, _NUMBER, _BOOLEAN = "an integer", "a number", "true or false"
VALUE_TYPES: dict[str, tuple[str, bool]] = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings", "intermediate_size", "moe_intermediate_size", "num_local_experts",
                     "num_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                     "experts_per_token", "first_k_dense_replace", "decoder_sparse_step", "moe_layer_freq",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "initial_context_length",
                     "max_window_layers"), (_INTEGER, False)),
    **dict.fromkeys(("num_key_value_heads", "head_dim", "sliding_window", "q_lora_rank", "n_group", "topk_group",
                     "num_nextn_predict_layers", "original_max_position_embeddings"), (_INTEGER, True)),
    **dict.fromkeys(("rope_theta", "rms_norm_eps", "attention_dropout", "routed_scaling_factor", "swiglu_limit",
                     "swiglu_alpha", "router_jitter_noise", "partial_rotary_factor"), (_NUMBER, False)),
    **dict.fromkeys(("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"),
                    (_NUMBER, True)),
    **dict.fromkeys(("tie_word_embeddings", "attention_bias", "use_qk_norm", "norm_topk_prob", "use_sliding_window",
                     "rope_interleave", "mlp_bias", "truncate"), (_BOOLEAN, False)),
}
ROPE_DICTS = ("rope_parameters", "rope_scaling")


_JSON_TYPES = {bool: "boolean", int: "integer", float: "float", str: "string", list: "list", dict: "mapping"}


def _type_error(value: object, kind: str, nullable: bool) -> str | None:
    """The JSON type of ``value`` when it cannot be a config.json value of ``kind``, or None when it can."""
    if value is None:
        return None if nullable else "null"
    if kind == _BOOLEAN:
        accepted = isinstance(value, bool)
    else:
        accepted = not isinstance(value, bool) and isinstance(value, int if kind == _INTEGER else int | float)
    return None if accepted else _JSON_TYPES.get(type(value), type(value).__name__)


def check_value_types(hf: dict) -> None:
    """Refuse, by its key, a config.json number or switch of another JSON type (a string, list, null or object,
    or a float where a count belongs), before any family reads it (``VALUE_TYPES``); the rope dicts' own keys too."""
    for where, values in [("", hf)] + [(f"{key}.", hf[key]) for key in ROPE_DICTS if isinstance(hf.get(key), dict)]:
        for key, value in values.items():
            if key not in VALUE_TYPES:
                continue
            kind, nullable = VALUE_TYPES[key]
            found = _type_error(value, kind, nullable)
            if found is not None:
                raise ConfigError(f"config.json {where}{key}={value!r} is a {found}: it must be {kind}"
                                  + (" (or null)" if nullable else ""))
    for key in ROPE_DICTS:
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise ConfigError(f"config.json {key}={hf[key]!r} must be a mapping of rope settings (or null)")


@dataclass(frozen=True)
class HFShape:
    """What a config.json fixes of our config: ``model``/``moe`` keys, and the longest context."""

    model: dict
    moe: dict
    max_positions: int
    sliding_window: int | None


@dataclass(frozen=True)
class Source:
    """Where our tensor comes from: one HF tensor as it is (``kind`` "copy"; "index" for an integer table read as
    stored, DeepSeek-V4's hash routing's ``tid2eid``), E stacked and transposed ("stack_t": names[e] is expert e),
    or nothing (the router's zero balancing bias, "zeros").

    ``rows`` (copies only): our row i is the HF tensor's row ``rows[i]``, for a family that lays out the rotary
    channels of a head in another order than ours (DeepSeek's interleaved pairs); None: rows as they are.
    ``rows`` may also pick a subset: several of our tensors are then the rows of one HF tensor (Qwen3-Next's
    fused projections), which an export puts back together.
    ``columns`` (copies only): (part, parts): our last-dim column j is the HF tensor's column part + parts · j, for
    a family that interleaves several of our tensors in one (GPT-OSS's gate and up); None: columns as they are.
    ``offset`` (copies only): ours is the HF tensor plus it, in fp32 (Qwen3-Next's zero-centred norms, whose
    weights say 1 + w: ours is that 1 + w); an export subtracts it.
    """

    kind: str
    names: tuple[str, ...]
    rows: tuple[int, ...] | None = None
    columns: tuple[int, int] | None = None
    offset: float = 0.0


@dataclass(frozen=True)
class Family:
    """One HF architecture: its config mapping both ways and its tensor names (the functions below, per family).

    ``shape_from_hf(config.json) -> HFShape`` refuses what we do not implement; ``hf_from_config(model, moe)``
    is our model's config.json, refusing what the architecture cannot express; ``hf_sources(model, moe)``
    maps each of our state-dict names (our order) to its ``Source``.
    """

    architecture: str
    model_type: str
    shape_from_hf: Callable[[dict], HFShape]
    hf_from_config: Callable[[ModelConfig, MoEConfig], dict]
    hf_sources: Callable[[ModelConfig, MoEConfig], dict[str, Source]]
    # other model types that name this architecture (Kimi K2's kimi_k2 is DeepSeek-V3's); export writes model_type
    other_model_types: tuple[str, ...] = ()
    # the dtype an export writes unless told otherwise (None: the checkpoint's), and why
    export_dtype: tuple[str, str] | None = None
    # tensor-name prefixes the import leaves out on purpose, saying so (Qwen3.5-MoE's vision tower): the rest of the
    # folder is the model we train, and no other unread tensor is accepted
    left_out: tuple[str, ...] = ()
    # where the family keeps its multi-token-prediction module apart from the decoder's layers (Qwen3-Next's
    # ``mtp.``), left out, saying so, unless the run asks for it (``model.mtp_depth``)
    mtp_prefix: str | None = None
    # a folder's tensor name -> the name ``hf_sources`` uses, for a family whose published folders name their
    # tensors otherwise than ``transformers`` saves them (DeepSeek-V4's); None: as they are
    stored_names: Callable[[str], str] | None = None

    def left_out_for(self, model: ModelConfig) -> tuple[str, ...]:
        """The prefixes an import of ``model`` leaves out: ``left_out``, and ``mtp_prefix`` without MTP modules."""
        return self.left_out + ((self.mtp_prefix,) if self.mtp_prefix and not model.mtp_depth else ())

    def has_model_type(self, model_type: str | None) -> bool:
        return model_type in (self.model_type, *self.other_model_types)


def get_key(hf: dict, key: str, family: str, default=None, required: bool = True):
    """``hf[key]``; absent, an error naming the key if ``required``, else ``default``."""
    if key not in hf:
        if required:
            raise ConfigError(f"config.json has no '{key}', which a {family} config needs")
        return default
    return hf[key]


def check_keys(hf: dict, handled: set[str], family: str) -> None:
    """Every config.json key is mapped or ignored on purpose: an unknown one would be silently dropped."""
    unknown = sorted(set(hf) - handled - IGNORED_KEYS)
    if unknown:
        raise ConfigError(f"config.json setting '{unknown[0]}'={hf[unknown[0]]!r} is not supported by the {family} "
                          f"import (it would be silently dropped); unsupported keys: {', '.join(unknown)}")


def check_requirements(hf: dict, requirements: dict[str, tuple[object, str]]) -> None:
    """Each present key of ``requirements`` has its one supported value: key -> (value, why)."""
    for key, (wanted, why) in requirements.items():
        if key in hf and hf[key] != wanted:
            raise ConfigError(f"config.json {key}={hf[key]!r} is not supported: {why}")


def _yarn_keys(params: dict, hf: dict) -> dict:
    """Our YaRN keys (``model.rope_scaling: yarn``) from a yarn rope dict, either transformers 5's
    ``rope_parameters`` or 4.x's ``rope_scaling``; a key we do not implement, by name."""
    known = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigError(f"config.json rope setting '{unknown[0]}'={params[unknown[0]]!r} is not supported by our "
                          f"YaRN (it takes {', '.join(sorted(known))})")
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError("config.json's yarn rope settings have no 'original_max_position_embeddings', which "
                          "YaRN needs")
    factor = params.get("factor")
    if factor is None:  # transformers' rule: the ratio of the extended to the original context
        factor = get_key(hf, "max_position_embeddings", "YaRN") / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    attention_factor = params.get("attention_factor")
    return {"rope_scaling": "yarn", "rope_factor": float(factor), "rope_original_seq_len": int(original),
            "yarn_beta_fast": float(params.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(params.get("beta_slow") or 1.0),
            "yarn_mscale": None if mscale is None else float(mscale),
            "yarn_mscale_all_dim": None if mscale_all_dim is None else float(mscale_all_dim),
            "yarn_attention_factor": None if attention_factor is None else float(attention_factor),
            "yarn_truncate": params.get("truncate", True)}


def rope_keys(hf: dict, default_theta: float, yarn: bool = False, partial: bool = False) -> dict:
    """Our rope keys: ``rope_theta`` from ``rope_parameters`` (transformers 5) or the top-level key (4.x; absent,
    the family's ``default_theta``); plain RoPE, or YaRN (``rope_type``/``type`` yarn) where the family's
    ``yarn`` allows it; ``partial_rotary_factor`` is left in place for a family that reads it (``partial``)."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    theta = float(hf.get("rope_theta", default_theta))
    if params is not None:
        theta = float(params.get("rope_theta", theta))
    rope = scaling if scaling is not None else params
    kind = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if kind == "yarn" and yarn:
        return {"rope_theta": theta} | _yarn_keys(rope, hf)
    plain_rope = {"rope_theta": theta, "rope_scaling": "none", "rope_factor": 1.0, "rope_original_seq_len": None,
                  "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "yarn_mscale": None, "yarn_mscale_all_dim": None,
                  "yarn_attention_factor": None, "yarn_truncate": True}
    plain = {"rope_type", "type", "rope_theta"} | ({"partial_rotary_factor"} if partial else set())
    if scaling is not None and (kind != "default" or set(scaling) - plain):
        raise ConfigError(f"config.json rope_scaling={scaling!r} is not supported "
                          f"({'plain RoPE or YaRN' if yarn else 'plain RoPE only'})")
    if params is not None and (kind != "default" or set(params) - plain):
        raise ConfigError(f"config.json rope_parameters={params!r} is not supported: only rope_type 'default' "
                          f"with rope_theta{' or yarn' if yarn else ''}")
    return plain_rope


def rope_config(model: ModelConfig) -> dict:
    """The config.json rope keys of our model (transformers 5's ``rope_parameters``), YaRN's included."""
    params: dict = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling == "yarn":
        params |= {"rope_type": "yarn", "factor": model.rope_factor,
                   "original_max_position_embeddings": model.rope_original_seq_len,
                   "beta_fast": model.yarn_beta_fast, "beta_slow": model.yarn_beta_slow}
        params |= {key: value for key, value in (("mscale", model.yarn_mscale),
                                                 ("mscale_all_dim", model.yarn_mscale_all_dim),
                                                 ("attention_factor", model.yarn_attention_factor))
                   if value is not None}
        if not model.yarn_truncate:
            params["truncate"] = False
    return {"rope_parameters": params}


def decoder_shape(hf: dict, family: str, rope_theta: float, yarn: bool = False, qkv_bias: bool = False,
                  partial_rotary: bool = False) -> dict:
    """Our ``model`` keys from the config.json keys every family here shares (``DECODER_KEYS``), after
    refusing their settings we do not implement (activation, dropout, biases unless the family has q/k/v biases:
    ``qkv_bias``, RoPE scaling but YaRN where the family allows it: ``yarn``, and a ``partial_rotary_factor`` in
    ``rope_parameters`` unless ``partial_rotary``, the family then reading it); ``rope_theta`` is the family's
    default."""
    requirements = {"hidden_act": ("silu", "hidden_act must be 'silu' (SwiGLU)"),
                    "attention_dropout": (0, "attention_dropout must be 0 (no attention dropout here)")}
    if not qkv_bias:
        requirements["attention_bias"] = (False, "attention_bias must be false (no biases here)")
    check_requirements(hf, requirements)
    hidden, heads = get_key(hf, "hidden_size", family), get_key(hf, "num_attention_heads", family)
    head_dim = hf.get("head_dim")
    return {"vocab_size": get_key(hf, "vocab_size", family), "d_model": hidden,
            "n_layers": get_key(hf, "num_hidden_layers", family), "n_heads": heads,
            "n_kv_heads": get_key(hf, "num_key_value_heads", family, heads, required=False),
            "head_dim": None if head_dim is None or head_dim * heads == hidden else head_dim,
            "tie_embeddings": bool(get_key(hf, "tie_word_embeddings", family, False, required=False)),
            **rope_keys(hf, rope_theta, yarn, partial_rotary), "rotary_dim": None, "qk_norm_type": "per_head",
            "qkv_bias": bool(hf.get("attention_bias", False)) if qkv_bias else False,
            # grouped-query attention unless the family says otherwise (the base config's latent keys would stay)
            "q_lora_rank": None, "kv_lora_rank": None, "qk_nope_head_dim": None, "qk_rope_head_dim": None,
            "v_head_dim": None, "index_topk": None, "index_n_heads": None, "index_head_dim": None,
            # GPT-OSS's attention options, off unless the family sets them (a base config's would stay)
            "attn_output_bias": False, "attention_sinks": False, "sliding_window": None, "layer_types": None,
            "mlp_layer_types": None,  # the family's MoE layers come as the moe_every shorthand
            "norm_eps": float(get_key(hf, "rms_norm_eps", family, 1e-5, required=False))}


def decoder_config(model: ModelConfig) -> dict:
    """The config.json keys of ``decoder_shape``, for our model (no sliding window: we attend fully); the context is
    the imported model's (``model.context_length``), not the shorter ``seq_len`` a fine-tune ran at."""
    return {"vocab_size": model.vocab_size, "hidden_size": model.d_model, "num_hidden_layers": model.n_layers,
            "num_attention_heads": model.n_heads, "num_key_value_heads": model.kv_heads, "head_dim": model.head_size,
            "max_position_embeddings": max(model.context_length or 0, model.seq_len), "rope_theta": model.rope_theta,
            "rms_norm_eps": model.norm_eps,
            "tie_word_embeddings": model.tie_embeddings, "sliding_window": None, "attention_dropout": 0.0,
            "attention_bias": False, "hidden_act": "silu"}


def refuse(architecture: str, refusals: list[tuple[bool, str]]) -> None:
    """The first true refusal as an error: our model has a setting ``architecture`` cannot express."""
    for refused, why in refusals:
        if refused:
            raise ConfigError(f"cannot export as {architecture}: {why}")


def routed_moe(num_experts: int, top_k: int, expert_hidden: int, renormalize: bool) -> dict:
    """Our ``moe`` keys for an HF softmax top-k router over SwiGLU experts: dropless, no jitter, no balancing bias,
    no shared experts (what ``router_refusals`` refuses on the way back)."""
    return {"num_experts": num_experts, "top_k": top_k, "expert_hidden": expert_hidden, "activation": "swiglu",
            "score_func": "softmax", "renormalize": renormalize, "jitter_eps": 0.0, "capacity_factor": None,
            "bias_update_rate": 0.0, "num_shared_experts": 0, "shared_expert_hidden": None, "force_balance": False,
            "n_group": 1, "topk_group": None, "routed_scaling_factor": 1.0, "router_bias": False,
            "expert_proj_bias": False}


def router_refusals(moe: MoEConfig, family: str, activation: str = "swiglu",
                    shared_experts: bool = False) -> list[tuple[bool, str]]:
    """What no HF softmax top-k router here expresses: experts other than ``activation``, other scores, balancing
    bias, debug routing; shared experts unless the family has them (``shared_experts``: Qwen3-Next's)."""
    return [
        (moe.activation != activation, f"moe.activation={moe.activation!r}: {family} experts are {activation}"),
        (moe.score_func != "softmax", f"moe.score_func={moe.score_func!r}: {family}'s router is a softmax"),
        (moe.num_shared_experts != 0 and not shared_experts,
         f"moe.num_shared_experts={moe.num_shared_experts}: {family} has none"),
        (moe.bias_update_rate != 0, f"moe.bias_update_rate={moe.bias_update_rate}: {family} has no balancing bias"),
        (moe.force_balance, f"moe.force_balance=true: a debug routing {family} does not have"),
        (moe.jitter_eps != 0, f"moe.jitter_eps={moe.jitter_eps}: {family} has no such noise"),
        (moe.group_limited, f"moe.topk_group={moe.topk_group} of moe.n_group={moe.n_group}: {family} routes over "
                            "every expert"),
        (moe.routed_scaling_factor != 1, f"moe.routed_scaling_factor={moe.routed_scaling_factor}: {family} does "
                                         "not scale the routed weights"),
    ]


def attention_refusals(model: ModelConfig, family: str) -> list[tuple[bool, str]]:
    """What a plain-RoPE grouped-query attention family cannot express: latent attention, biases, partial rotary,
    sliding windows, YaRN, multi-token prediction."""
    return [(model.latent_attention, f"model.kv_lora_rank={model.kv_lora_rank}: {family} has no latent attention"),
            (model.qkv_bias, f"model.qkv_bias=true: {family} has no attention biases"),
            (model.mtp_depth > 0, f"model.mtp_depth={model.mtp_depth}: {family} has no multi-token prediction"),
            (model.rotary_dim is not None, f"model.rotary_dim={model.rotary_dim}: {family} rotates whole heads"),
            (model.sliding_window is not None, f"model.sliding_window={model.sliding_window}: {family} attends fully"),
            (model.rope_scaling != "none", f"model.rope_scaling={model.rope_scaling!r}: {family}'s import here "
                                           "takes plain RoPE only")]


def check_context(shape: HFShape, seq_len: int) -> None:
    """Our context must fit the model's positions, a sliding window we do not implement must not cut it (we attend
    fully), and one we do (GPT-OSS's windowed layers) must fit in it."""
    if seq_len > shape.max_positions:
        raise ConfigError(f"model.seq_len={seq_len} exceeds the folder's max_position_embeddings="
                          f"{shape.max_positions}")
    window = shape.model.get("sliding_window")
    if window is not None and window > seq_len:
        raise ConfigError(f"config.json sliding_window={window} is longer than model.seq_len={seq_len}: the windowed "
                          f"layers need model.seq_len >= {window} (--set model.seq_len={window} or more)")
    if shape.sliding_window is not None and shape.sliding_window < seq_len:
        raise ConfigError(f"config.json sliding_window={shape.sliding_window} is below model.seq_len={seq_len}: "
                          "sliding-window attention is not supported; use a seq_len within the window")


# our per-layer names -> HF's, for the attention and norm tensors that copy as they are
# our stacked experts' weights -> each HF expert's gated-MLP projection (DeepSeek-V3, GLM-4.5, Qwen3-MoE name them so)
GATED_EXPERTS = {"moe.experts.w_in": "up_proj.weight", "moe.experts.w_gate": "gate_proj.weight",
                 "moe.experts.w_out": "down_proj.weight"}
# ... or as Mixtral's w1 (gate), w3 (up), w2 (down) (Mixtral, MiniMax-M2, DeepSeek-V4)
W13_EXPERTS = {"moe.experts.w_in": "w3.weight", "moe.experts.w_gate": "w1.weight", "moe.experts.w_out": "w2.weight"}
ATTENTION_COPIES = {"attn_norm.weight": "input_layernorm.weight", "attn.wq.weight": "self_attn.q_proj.weight",
                    "attn.wk.weight": "self_attn.k_proj.weight", "attn.wv.weight": "self_attn.v_proj.weight",
                    "attn.wo.weight": "self_attn.o_proj.weight", "attn.q_norm.weight": "self_attn.q_norm.weight",
                    "attn.k_norm.weight": "self_attn.k_norm.weight",
                    "ffn_norm.weight": "post_attention_layernorm.weight"}


def llama_attention(model: ModelConfig, ours: str, theirs: str) -> dict[str, Source]:
    """A layer's attention and norm tensors under Llama's names (q/k norms with ``model.qk_norm``, q/k/v biases
    with ``model.qkv_bias``)."""
    out = {ours + name: Source("copy", (theirs + hf_name,)) for name, hf_name in ATTENTION_COPIES.items()
           if model.qk_norm or name not in ("attn.q_norm.weight", "attn.k_norm.weight")}
    if model.qkv_bias:
        out |= {f"{ours}attn.w{x}.bias": Source("copy", (f"{theirs}self_attn.{x}_proj.bias",)) for x in "qkv"}
    return out


def decoder_sources(model: ModelConfig, layer_sources: Callable[[int, str, str], dict[str, Source]],
                    attention: Callable[[ModelConfig, str, str], dict[str, Source]] = llama_attention
                    ) -> dict[str, Source]:
    """Each of our state-dict names (our model's order) and its HF source: embedding, then per layer the
    attention and norms (``attention(model, ours, theirs)``, Llama's by default) and ``layer_sources(i, ours,
    theirs)``'s feed-forward tensors (prefixes ``layers.i.`` and ``model.layers.i.``), then the final norm and
    the head."""
    out = {"tok_embeddings.weight": Source("copy", ("model.embed_tokens.weight",))}
    for i in range(model.n_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        out.update(attention(model, ours, theirs))
        out.update(layer_sources(i, ours, theirs))
    out["norm.weight"] = Source("copy", ("model.norm.weight",))
    # tied: the head is the embedding (HF's save_pretrained may leave lm_head out of the files)
    out["output.weight"] = Source("copy", ("model.embed_tokens.weight" if model.tie_embeddings else "lm_head.weight",))
    return out


def expert_stacks(ours: str, experts: str, names: dict[str, str], num_experts: int) -> dict[str, Source]:
    """Our stacked expert weights (``names``: ours -> HF's per-expert name) at ``ours``, each from the E HF
    matrices ``{experts}.{e}.{name}``, transposed; and the router's balancing bias, zeros."""
    out = {f"{ours}moe.router.expert_bias": Source("zeros", ())}
    for name, per_expert in names.items():
        out[ours + name] = Source("stack_t", tuple(f"{experts}.{e}.{per_expert}" for e in range(num_experts)))
    return out


@dataclass(frozen=True)
class Target:
    """Where an exported HF tensor comes from: our tensor ``ours[0]`` (expert ``expert`` of a stack, transposed), or
    with ``rows`` the rows of all of ``ours`` one after another, HF row j being row ``rows[j]`` of them, or without
    the last-dim interleaving of all of ``ours`` (HF column i is column i // n of ``ours[i % n]``); ``offset``
    subtracted (``Source.offset``)."""

    ours: tuple[str, ...]
    expert: int | None = None
    rows: tuple[int, ...] | None = None
    offset: float = 0.0


def hf_targets(sources: dict[str, Source]) -> dict[str, Target]:
    """Each HF tensor of an exported folder and its ``Target``, in our tensors' order."""
    out: dict[str, Target] = {}
    for ours, source in sources.items():
        if source.kind == "copy" and source.columns is not None:
            parts = out.get(source.names[0], Target(()))
            out[source.names[0]] = Target(tuple(sorted((*parts.ours, ours), key=lambda name: sources[name].columns)))
        elif source.kind == "copy" and source.rows is not None:  # one of the tensors whose rows make the HF one
            parts = out.get(source.names[0], Target(())).ours + (ours,)
            hf_rows = [row for part in parts for row in sources[part].rows]  # the import's order, inverted
            out[source.names[0]] = Target(parts, None, tuple(sorted(range(len(hf_rows)), key=hf_rows.__getitem__)))
        elif source.kind in ("copy", "index") and source.names[0] not in out:  # tied: the head is the embedding
            out[source.names[0]] = Target((ours,), offset=source.offset)
        elif source.kind == "stack_t":
            out.update({name: Target((ours,), e) for e, name in enumerate(source.names)})
    return out
