"""The DeepSeek-V4 family (Hugging Face ``DeepseekV4ForCausalLM``, model_type ``deepseek_v4``) in our terms.

DeepSeek-V4 is our model with every V4 option on: its attention kinds (``model.compressed_attention``;
``moe/attention/shared_kv.py``, ``compressed.py``: one layer type per ``layer_types`` word), hyper-connections
(``model.hc_mult``, ``hc_sinkhorn_iters``, ``hc_eps``; ``moe/hyper_connections.py``), every layer MoE, the first
ones hash-routed (``mlp_layer_types``' ``hash_moe``: the table ``tid2eid``) and the rest by ``scoring_func`` (V4:
sqrt-softplus) on the correction-biased scores, the chosen weights renormalised and scaled by
``routed_scaling_factor``, one shared expert as wide as a routed one (``moe_intermediate_size``), and the limited
SwiGLU (``swiglu_limit``) in both.

Tensor names are those ``transformers``' ``save_pretrained`` writes for it (DeepSeek's own short names below a
``model.`` prefix: ``attn.wq_a``, ``ffn.experts.{e}.w1``/``w3``/``w2`` (gate, up, down), ``hc_attn_fn``, ...,
which its conversion mapping renames when it loads them; ``head.weight``, ``model.hc_head.hc_fn``), or those of
DeepSeek's published folders (``stored_name``: no ``model.`` prefix, ``embed``, ``hc_head_fn``). Attention
tensors keep ``transformers``' layouts, so they are copied as they are (``attention_file_name``); the expert
matrices are stacked and transposed as for every family.

DeepSeek's published folders (DeepSeek-V4-Flash, -Pro) store their weights in low precision, dequantised to bf16
as they are read, box by box: ``quantization_config`` ``{quant_method: fp8, fmt: e4m3, scale_fmt: ue8m0,
weight_block_size: [128, 128], activation_scheme: dynamic}`` with ``expert_dtype: fp4`` at config.json's top level
(V4.1 and ``transformers`` keep it inside ``quantization_config``; both read). The linear weights are ``F8_E4M3``
with one ``F8_E8M0`` scale per 128 × 128 block, stored as ``X.scale`` (``stored_name`` calls it
``X.weight_scale_inv``, as ``transformers``' fp8 quantizer does; ``interop/fp8.py``); the routed experts are MXFP4,
``I8`` [out, in / 2] with ``F8_E8M0`` scales [out, in / 32] (``interop/mxfp4.py``, which names its sources); what
the published folders keep in bf16 is read as stored (``transformers``' ``modeling_deepseek_v4`` names the
compressors' projections and the indexer's ``weights_proj``; a published tensor list gives norms, router, embedding
and head no scales). Any other scale format, expert format or packing is refused by name (dequantise the folder to
bf16 first). The multi-token-prediction layers (``mtp.{k}.*``, ``mtp_sources``) are read into our hyper-connected
MTP modules under ``model.mtp_depth`` and written back by export; without it an import leaves them out.
``transformers`` builds no MTP layer, ignores any ``mtp.`` tensor it loads and so saves none: the names are
DeepSeek's, the layer's own tensors spelled as the folder spells its layers' (the attention's ``norm``, published
``kv_norm``: ``stored_name``).
"""

from __future__ import annotations

import torch

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from interop.fp8 import SCALE_SUFFIX, scheme
from interop.hf_family import (
    W13_EXPERTS,
    Family,
    HFShape,
    Source,
    check_keys,
    check_requirements,
    decoder_config,
    decoder_shape,
    expert_stacks,
    get_key,
    refuse,
)
from moe.attention import build_attention

ARCHITECTURE = "DeepseekV4ForCausalLM"
FAMILY_NAME = "DeepSeek-V4"
_KEYS = {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
         "max_position_embeddings", "rope_theta", "rope_parameters", "rms_norm_eps", "tie_word_embeddings",
         "attention_dropout", "hidden_act", "attention_bias", "mlp_bias", "q_lora_rank", "partial_rotary_factor",
         "qk_rope_head_dim", "layer_types", "mlp_layer_types", "compress_rates", "compress_rope_theta", "hc_mult",
         "hc_sinkhorn_iters", "hc_eps", "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank",
         "index_n_heads", "index_head_dim", "index_topk", "num_nextn_predict_layers", "moe_intermediate_size",
         "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "scoring_func", "norm_topk_prob",
         "routed_scaling_factor", "router_jitter_noise", "quantization_config", "expert_dtype"}
# DeepSeek's published config.json (DeepSeek-V4-Flash, -Pro) names four settings the way its inference code does;
# transformers' DeepseekV4Config folds them into the keys above in its __post_init__, and ``_fold_published`` alike
_PUBLISHED_KEYS = {"compress_ratios", "num_hash_layers", "rope_scaling", "topk_method"}
_RATIO_LAYER_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
_YARN_KEYS = {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"}
_SCORES = ("sqrtsoftplus", "sigmoid", "softmax")
# our V4 attention kinds' module names -> DeepSeek's short names that its checkpoints store (any other part of a
# name, ``compressor``, ``indexer``, ``weight``, is the same in both)
_ATTENTION_STORED = {"sinks": "attn_sink", "q_a_proj": "wq_a", "q_a_norm": "q_norm", "q_b_proj": "wq_b",
                     "kv_proj": "wkv", "kv_norm": "norm", "o_a_proj": "wo_a", "o_b_proj": "wo_b",
                     "position_bias": "ape", "gate_proj": "wgate", "wq": "wq_b", "head_weights": "weights_proj"}
_MLP = {"w_gate": "w1", "w_in": "w3", "w_out": "w2"}  # gate, up, down
_HYPER = {"weight": "fn", "bias": "base", "scale": "scale"}


def _rope(hf: dict) -> tuple[dict, dict]:
    """The sliding layers' and the compressed layers' RoPE (``rope_parameters``' ``main`` and ``compress``): our
    ``model`` rope keys and ``compressed_attention``'s."""
    params = hf.get("rope_parameters") or {}
    main, compress = params.get("main", {}), params.get("compress", {})
    if main.get("rope_type", "default") != "default":
        raise ConfigError(f"config.json rope_parameters.main={main!r}: {FAMILY_NAME}'s sliding layers turn by plain "
                          "RoPE (rope_type 'default')")
    section = {"rope_theta": float(compress.get("rope_theta", hf.get("compress_rope_theta", 160000.0))),
               "rope_scaling": "none", "rope_factor": 1.0, "rope_original_seq_len": None}
    if compress.get("rope_type", "default") == "yarn":
        if compress.get("attention_factor", 1.0) != 1.0:
            raise ConfigError(f"config.json rope_parameters.compress attention_factor={compress['attention_factor']}"
                              f": {FAMILY_NAME}'s compressed RoPE is unscaled (attention factor 1)")
        section |= {"rope_scaling": "yarn", "rope_factor": float(compress["factor"]),
                    "rope_original_seq_len": int(compress["original_max_position_embeddings"]),
                    "yarn_beta_fast": float(compress.get("beta_fast") or 32.0),
                    "yarn_beta_slow": float(compress.get("beta_slow") or 1.0)}
    elif compress.get("rope_type", "default") != "default":
        raise ConfigError(f"config.json rope_parameters.compress={compress!r}: plain RoPE or YaRN only")
    return {"rope_theta": float(main.get("rope_theta", hf.get("rope_theta", 10000.0)))}, section


def _fold_published(hf: dict) -> dict:
    """config.json with the published folders' names folded as ``transformers``' ``DeepseekV4Config`` folds them:
    ``compress_ratios`` (one per layer, 0/4/128; entries past the last layer are the MTP layers') into
    ``layer_types``, ``num_hash_layers`` into ``mlp_layer_types`` (the first ones hash-routed), ``rope_scaling`` into
    ``rope_parameters`` (the sliding layers plain at ``rope_theta``, the compressed ones its YaRN at
    ``compress_rope_theta``, attention factor 1), ``qk_rope_head_dim`` into ``partial_rotary_factor``;
    ``topk_method`` must be ``noaux_tc`` (the correction-biased top-k every V4 router takes). Both a name and its
    fold in one file is refused: one of them would be dropped."""
    hf = dict(hf)
    for published, folded in (("compress_ratios", "layer_types"), ("num_hash_layers", "mlp_layer_types"),
                              ("rope_scaling", "rope_parameters")):
        if published in hf and folded in hf:
            raise ConfigError(f"config.json has both {published} and {folded}: say it once ({folded})")
    layers = get_key(hf, "num_hidden_layers", FAMILY_NAME)
    ratios = hf.pop("compress_ratios", None)
    if ratios is not None:
        if not isinstance(ratios, list) or len(ratios) < layers or set(ratios[:layers]) - set(_RATIO_LAYER_TYPES):
            raise ConfigError(f"config.json compress_ratios={ratios!r}: one of {sorted(_RATIO_LAYER_TYPES)} per layer "
                              f"(num_hidden_layers={layers})")
        hf["layer_types"] = [_RATIO_LAYER_TYPES[ratio] for ratio in ratios[:layers]]
    if "num_hash_layers" in hf:
        hashed = min(layers, hf.pop("num_hash_layers"))
        hf["mlp_layer_types"] = ["hash_moe"] * hashed + ["moe"] * (layers - hashed)
    scaling = hf.pop("rope_scaling", None)
    if scaling is not None:
        unknown = sorted(set(scaling) - _YARN_KEYS)
        if unknown:
            raise ConfigError(f"config.json rope_scaling setting '{unknown[0]}' is not supported for {FAMILY_NAME} "
                              f"(it takes {', '.join(sorted(_YARN_KEYS))})")
        compress = {key: value for key, value in scaling.items() if key != "type"}
        compress |= {"rope_type": scaling.get("rope_type", scaling.get("type", "default")), "attention_factor": 1.0}
        hf["rope_parameters"] = {"main": {"rope_type": "default"}, "compress": compress}
    method = hf.pop("topk_method", "noaux_tc")
    if method != "noaux_tc":
        raise ConfigError(f"config.json topk_method={method!r}: {FAMILY_NAME} routes by noaux_tc (the "
                          "correction-biased top-k)")
    if "qk_rope_head_dim" in hf and "partial_rotary_factor" not in hf:
        hf["partial_rotary_factor"] = hf["qk_rope_head_dim"] / get_key(hf, "head_dim", FAMILY_NAME)
    return hf


def shape_from_hf(hf: dict) -> HFShape:
    """Map a DeepSeek-V4 config.json onto our ``model``/``moe`` keys; any setting we do not implement is an error."""
    check_keys(hf, _KEYS | _PUBLISHED_KEYS, FAMILY_NAME)
    hf = _fold_published(hf)
    scheme(hf)  # block-scaled fp8 (and V4's fp4 experts) dequantised as read; any other quantization refused
    check_requirements(hf, {
        "num_key_value_heads": (1, "num_key_value_heads must be 1 (one key/value head shared by every query head)"),
        "norm_topk_prob": (True, "norm_topk_prob must be true (transformers' V4 routers always renormalise)"),
        "n_shared_experts": (1, "n_shared_experts must be 1 (one shared expert of moe_intermediate_size)"),
        "mlp_bias": (False, "mlp_bias must be false (no biases here)"),
        "router_jitter_noise": (0.0, "router_jitter_noise must be 0")})
    family = FAMILY_NAME
    plain = {key: value for key, value in hf.items() if key not in ("rope_parameters", "num_key_value_heads")}
    main_rope, section_rope = _rope(hf)
    model = decoder_shape(plain, family, rope_theta=main_rope["rope_theta"]) | main_rope
    head_dim = get_key(hf, "head_dim", family)
    rotary = round(head_dim * float(get_key(hf, "partial_rotary_factor", family, 64 / 512, required=False)))
    if "qk_rope_head_dim" in hf and hf["qk_rope_head_dim"] != rotary:
        raise ConfigError(f"config.json qk_rope_head_dim={hf['qk_rope_head_dim']} disagrees with "
                          f"partial_rotary_factor · head_dim = {rotary}")
    rates = get_key(hf, "compress_rates", family, {}, required=False) or {}
    n_layers, scores = model["n_layers"], get_key(hf, "scoring_func", family)
    if scores not in _SCORES:
        raise ConfigError(f"config.json scoring_func={scores!r}: one of {list(_SCORES)}")
    mlp = get_key(hf, "mlp_layer_types", family)
    if set(mlp) - {"hash_moe", "moe"}:
        raise ConfigError(f"config.json mlp_layer_types={mlp!r}: {family}'s layers are hash_moe or moe")
    model |= {"n_kv_heads": None, "head_dim": head_dim, "rotary_dim": rotary,
              "q_lora_rank": get_key(hf, "q_lora_rank", family),
              "layer_types": list(get_key(hf, "layer_types", family)),
              "mlp_layer_types": list(mlp), "sliding_window": get_key(hf, "sliding_window", family),
              **{key: get_key(hf, key, family) for key in ("index_topk", "index_n_heads", "index_head_dim")},
              "hc_mult": get_key(hf, "hc_mult", family), "hc_sinkhorn_iters": get_key(hf, "hc_sinkhorn_iters", family),
              "hc_eps": float(get_key(hf, "hc_eps", family)), "moe_every": 1, "first_moe_layer": 0,
              "compressed_attention": {"csa_rate": rates.get("compressed_sparse_attention", 4),
                                       "hca_rate": rates.get("heavily_compressed_attention", 128),
                                       "o_groups": get_key(hf, "o_groups", family),
                                       "o_lora_rank": get_key(hf, "o_lora_rank", family), **section_rope}}
    if len(model["layer_types"]) != n_layers or len(mlp) != n_layers:
        raise ConfigError(f"config.json layer_types and mlp_layer_types need one entry per layer "
                          f"(num_hidden_layers={n_layers})")
    hidden = get_key(hf, "moe_intermediate_size", family)
    moe = {"num_experts": get_key(hf, "n_routed_experts", family), "top_k": get_key(hf, "num_experts_per_tok", family),
           "expert_hidden": hidden, "activation": "limited_swiglu",
           "swiglu_limit": float(get_key(hf, "swiglu_limit", family)), "score_func": scores, "renormalize": True,
           "routed_scaling_factor": float(get_key(hf, "routed_scaling_factor", family)), "jitter_eps": 0.0,
           "capacity_factor": None, "num_shared_experts": 1, "shared_expert_hidden": hidden,
           "shared_expert_gate": False, "force_balance": False, "n_group": 1, "topk_group": None,
           "router_bias": False, "expert_proj_bias": False}
    return HFShape(model, moe, int(get_key(hf, "max_position_embeddings", family)), None)


def hf_from_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """The config.json of our model as a DeepSeek-V4; settings it cannot express are errors."""
    section = model.compressed_attention
    refuse(ARCHITECTURE, [
        (section is None, "model.compressed_attention=null: DeepSeek-V4 attends with its own attention kinds"),
        (model.hc_mult == 1, "model.hc_mult=1: DeepSeek-V4's residual is hyper-connected (hc_mult > 1)"),
        (model.n_moe_layers != model.n_layers, "dense layers: every DeepSeek-V4 layer is MoE (moe or hash_moe)"),
        (moe.activation != "limited_swiglu", f"moe.activation={moe.activation!r}: DeepSeek-V4's is limited_swiglu"),
        (moe.num_shared_experts != 1 or moe.shared_hidden != moe.expert_hidden,
         "DeepSeek-V4 has one shared expert as wide as a routed one (moe.num_shared_experts=1, "
         "moe.shared_expert_hidden null or moe.expert_hidden)"),
        (not moe.renormalize, "moe.renormalize=false: DeepSeek-V4's routers renormalise"),
        (moe.group_limited, "moe.topk_group: DeepSeek-V4 routes over every expert"),
        (moe.router_bias or moe.expert_proj_bias or moe.shared_expert_gate,
         "router, expert or shared-gate biases: DeepSeek-V4 has none"),
        (moe.force_balance or moe.jitter_eps != 0, "debug routing or jitter: DeepSeek-V4 has neither"),
        (model.tie_embeddings, "model.tie_embeddings=true: DeepSeek-V4's head is its own")])
    decoder, rotary_factor = decoder_config(model), model.rotary_dim / model.head_dim
    compress = {"rope_type": "default", "rope_theta": section.rope_theta, "partial_rotary_factor": rotary_factor}
    if section.rope_scaling == "yarn":
        compress |= {"rope_type": "yarn", "factor": section.rope_factor, "attention_factor": 1.0,
                     "original_max_position_embeddings": section.rope_original_seq_len,
                     "beta_fast": section.yarn_beta_fast, "beta_slow": section.yarn_beta_slow}
    return {"architectures": [ARCHITECTURE], "model_type": "deepseek_v4", **decoder, "num_key_value_heads": 1,
            "sliding_window": model.sliding_window, "q_lora_rank": model.q_lora_rank,
            "partial_rotary_factor": rotary_factor,
            "rope_parameters": {"main": {"rope_type": "default", "rope_theta": model.rope_theta,
                                         "partial_rotary_factor": rotary_factor},
                                "compress": compress},
            "compress_rope_theta": section.rope_theta, "layer_types": list(model.layer_types),
            "mlp_layer_types": [model.layer(i).feed_forward for i in range(model.n_layers)],
            "compress_rates": {"compressed_sparse_attention": section.csa_rate,
                               "heavily_compressed_attention": section.hca_rate},
            "o_groups": section.o_groups, "o_lora_rank": section.o_lora_rank,
            **{key: getattr(model, key) for key in ("index_topk", "index_n_heads", "index_head_dim", "hc_mult",
                                                    "hc_sinkhorn_iters", "hc_eps")},
            "moe_intermediate_size": moe.expert_hidden, "n_routed_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "n_shared_experts": 1, "scoring_func": moe.score_func,
            "norm_topk_prob": True, "routed_scaling_factor": moe.routed_scaling_factor,
            "swiglu_limit": moe.swiglu_limit, "num_nextn_predict_layers": model.mtp_depth, "mlp_bias": False}


def attention_file_name(name: str) -> str:
    """The stored name (below a layer's ``attn.``) of our V4 attention parameter ``name``."""
    return ".".join(_ATTENTION_STORED.get(part, part) for part in name.split("."))


def hf_sources(model: ModelConfig, moe: MoEConfig) -> dict[str, Source]:
    """Each of our state-dict names (our model's order) and its stored source; a layer's attention tensors are
    those its kind has (built on the meta device for their names)."""
    out = {"tok_embeddings.weight": Source("copy", ("model.embed_tokens.weight",))}
    names_by_kind: dict[str, list[str]] = {}
    for i in range(model.n_layers):
        out |= _block_sources(model, moe, i, f"layers.{i}.", f"model.layers.{i}.", names_by_kind)
    out |= {f"hc_head.{name}": Source("copy", (f"model.hc_head.hc_{stored}",)) for name, stored in _HYPER.items()}
    out["norm.weight"] = Source("copy", ("model.norm.weight",))
    out["output.weight"] = Source("copy", ("head.weight",))
    for k in range(model.mtp_depth):
        out |= mtp_sources(model, moe, k, names_by_kind)
    return out


def _block_sources(model: ModelConfig, moe: MoEConfig, i: int, ours: str, theirs: str,
                   names_by_kind: dict[str, list[str]]) -> dict[str, Source]:
    """Block i's tensors (i >= n_layers: a multi-token-prediction module's) under ``ours`` and ``theirs``."""
    layer = model.layer(i)
    if layer.attention not in names_by_kind:
        with torch.device("meta"):
            names_by_kind[layer.attention] = list(build_attention(model, layer).state_dict())
    out = {f"{ours}attn_norm.weight": Source("copy", (f"{theirs}attn_norm.weight",))}
    out |= {f"{ours}attn.{name}": Source("copy", (f"{theirs}attn.{attention_file_name(name)}",))
            for name in names_by_kind[layer.attention]}
    out[f"{ours}ffn_norm.weight"] = Source("copy", (f"{theirs}ffn_norm.weight",))
    out[f"{ours}moe.router.gate"] = Source("copy", (f"{theirs}ffn.gate.weight",))
    out |= expert_stacks(ours, f"{theirs}ffn.experts", W13_EXPERTS, moe.num_experts)
    if layer.feed_forward == "hash_moe":  # the table; the balancing bias stays zero (expert_stacks')
        out[f"{ours}moe.router.tid2eid"] = Source("index", (f"{theirs}ffn.gate.tid2eid",))
    else:
        out[f"{ours}moe.router.expert_bias"] = Source("copy", (f"{theirs}ffn.gate.bias",))
    shared = f"{theirs}ffn.shared_experts."
    out |= {f"{ours}moe.shared_experts.{name}.weight": Source("copy", (f"{shared}{stored}.weight",))
            for name, stored in _MLP.items()}
    for branch in ("attn", "ffn"):
        out |= {f"{ours}{branch}_hc.{name}": Source("copy", (f"{theirs}hc_{branch}_{stored}",))
                for name, stored in _HYPER.items()}
    return out


def mtp_sources(model: ModelConfig, moe: MoEConfig, k: int, names_by_kind: dict[str, list[str]]) -> dict[str, Source]:
    """Multi-token-prediction module k (``moe/mtp.py``'s ``HyperPredictionModule``) as DeepSeek's published folders
    store it under ``mtp.{k}.`` (the names of ``MTPBlock`` in DeepSeek's ``inference/model.py``, which vLLM's
    ``deepseek_v4_mtp.py`` loader reads): ``enorm``, ``hnorm``, ``e_proj``, ``h_proj``, the block's tensors under
    a layer's names (a sliding layer with a learned router), its ``hc_head_fn``/``_base``/``_scale`` and ``norm``;
    the embedding and head are the main model's."""
    ours, theirs = f"mtp.{k}.", f"mtp.{k}."
    out = {f"{ours}embed_norm.weight": Source("copy", (f"{theirs}enorm.weight",)),
           f"{ours}hidden_norm.weight": Source("copy", (f"{theirs}hnorm.weight",)),
           f"{ours}embed_proj.weight": Source("copy", (f"{theirs}e_proj.weight",)),
           f"{ours}hidden_proj.weight": Source("copy", (f"{theirs}h_proj.weight",))}
    out |= _block_sources(model, moe, model.n_layers + k, f"{ours}block.", theirs, names_by_kind)
    out |= {f"{ours}hc_head.{name}": Source("copy", (f"{theirs}hc_head_{stored}",)) for name, stored in _HYPER.items()}
    out[f"{ours}norm.weight"] = Source("copy", (f"{theirs}norm.weight",))
    return out


def stored_name(name: str) -> str:
    """A tensor name of a DeepSeek-V4 folder as ``hf_sources`` reads it: DeepSeek's published folders keep their
    names without ``transformers``' ``model.`` prefix and call the embedding ``embed``, the head's collapse
    ``hc_head_fn``/``_base``/``_scale`` and the attention's key/value norm ``attn.kv_norm`` (the renames of
    ``transformers``' conversion mapping for ``deepseek_v4``, which saves that norm as ``attn.norm``); the names
    ``transformers`` saves are left as they are. A weight's block scales ``X.scale`` are read as
    ``X.weight_scale_inv`` (no V4 tensor of its own ends in ``.scale``: the hyper-connections' are ``hc_*_scale``)."""
    if name.endswith(".scale"):
        name = name.removesuffix(".scale") + ".weight" + SCALE_SUFFIX
    if name == "embed.weight":
        return "model.embed_tokens.weight"
    if name.startswith("hc_head_"):
        return "model.hc_head.hc_" + name.removeprefix("hc_head_")
    if name.endswith(".attn.kv_norm.weight"):  # published: ``kv_norm``; transformers saves its rename's inverse
        name = name.removesuffix("kv_norm.weight") + "norm.weight"
    if name == "norm.weight" or name.startswith("layers."):
        return "model." + name
    return name


# the multi-token-prediction layers under ``mtp.``: read under model.mtp_depth, left out otherwise
FAMILY = Family(ARCHITECTURE, "deepseek_v4", shape_from_hf, hf_from_config, hf_sources, mtp_prefix="mtp.",
                stored_names=stored_name)
