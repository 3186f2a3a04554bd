"""The Qwen3-Next family (Hugging Face ``Qwen3NextForCausalLM``) in our terms: config mapping and tensor names.

Qwen3-Next is our hybrid model: ``layer_types`` (or every ``full_attention_interval``-th layer full, the others
linear) picks per layer Gated DeltaNet linear attention (``moe/attention/gated_delta.py``) or grouped-query
attention with q/k norms, ``partial_rotary_factor`` of each head rotated (our ``rotary_dim``, the first
channels) and an output gate (``model.attn_output_gate``); every MoE layer has one shared expert of
``shared_expert_intermediate_size`` behind a sigmoid gate (``moe.shared_expert_gate``). MoE and dense layers
as Qwen3-MoE's (``decoder_sparse_step``, ``mlp_only_layers``: ``interop/hf_qwen3_moe.py``).

Tensors that differ from ours:
- every RMSNorm but the linear layers' gated one is zero-centred, computing x̂ · (1 + w) (its weights start
  at 0): our weight is 1 + w (``Source.offset``). A bf16 checkpoint's weights come in exactly; an fp32 weight
  may round by half an fp32 ulp of 1 in the sum (export subtracts 1 again, exactly for weights in [0.5, 2]);
- ``self_attn.q_proj`` holds, per head, its hd query rows then its hd gate rows: our ``wq`` and ``wg``;
- ``linear_attn.in_proj_qkvz`` holds, per key head, its dk query rows, dk key rows, then its r = nv / nk value
  heads' rows and their gate (z) rows: our ``wq``, ``wk``, ``wv``, ``wz``; ``in_proj_ba`` per key head its r
  beta rows, then its r decay-input rows: ``wb``, ``wa``; ``conv1d.weight`` [C, 1, kernel] the q, k and v
  channels in that order: ``conv_q``, ``conv_k``, ``conv_v``; ``dt_bias`` and ``A_log`` are ``decay_bias``
  and ``log_decay_rate``, ``norm`` the gated ``out_norm``, ``out_proj`` ``wo``.

The checkpoints' multi-token-prediction module (``mtp.*``: ``mtp_sources``) is read into our MTP module under
``model.mtp_depth=1`` and written back by export; without it the import leaves it out, saying so.
"""

from __future__ import annotations

import sys

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
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
    expert_stacks,
    get_key,
    refuse,
    routed_moe,
    router_refusals,
)
from interop.hf_qwen3_moe import moe_layout

ARCHITECTURE = "Qwen3NextForCausalLM"
FAMILY_NAME = "Qwen3-Next"
LINEAR_KEYS = {"linear_num_key_heads": "linear_key_heads", "linear_num_value_heads": "linear_value_heads",
               "linear_key_head_dim": "linear_key_head_dim", "linear_value_head_dim": "linear_value_head_dim",
               "linear_conv_kernel_dim": "linear_conv_kernel"}
HANDLED = DECODER_KEYS | set(LINEAR_KEYS) | {
    "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
    "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "layer_types",
    "full_attention_interval", "partial_rotary_factor", "use_sliding_window", "max_window_layers",
    "num_nextn_predict_layers", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"}
# M-RoPE's sections (Qwen3.5's, for image and video positions): a text position has the same index in all three,
# where M-RoPE is the 1-D RoPE of its channels, so a text model reads none of them
MROPE_KEYS = ("mrope_section", "mrope_interleaved")
MTP_PREFIX = "mtp."  # where the checkpoints keep the multi-token-prediction module, beside the decoder
_DENSE = {"ffn.w_in.weight": "up_proj.weight", "ffn.w_gate.weight": "gate_proj.weight",
          "ffn.w_out.weight": "down_proj.weight"}
_SHARED = {"moe.shared_experts.w_in.weight": "shared_expert.up_proj.weight",
           "moe.shared_experts.w_gate.weight": "shared_expert.gate_proj.weight",
           "moe.shared_experts.w_out.weight": "shared_expert.down_proj.weight",
           "moe.shared_gate.weight": "shared_expert_gate.weight"}


def layer_types(hf: dict, n_layers: int, family: str) -> list[str]:
    """Each layer's attention word: ``layer_types`` as given, or every ``full_attention_interval``-th layer (4 by
    default, transformers' rule) full and the others linear."""
    if hf.get("layer_types") is not None:
        return list(hf["layer_types"])
    interval = get_key(hf, "full_attention_interval", family, 4, required=False)
    if interval < 1:
        raise ConfigError(f"config.json full_attention_interval={interval} must be >= 1")
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n_layers)]


def rotary_dim(hf: dict, head_dim: int) -> int | None:
    """Our ``rotary_dim`` from ``partial_rotary_factor`` (in ``rope_parameters``, transformers 5, or at the top,
    4.x; 0.25 by default, as transformers assumes): the first channels of each head, None for all."""
    factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    rotated = int(head_dim * factor)
    if rotated <= 0 or rotated % 2:
        raise ConfigError(f"config.json partial_rotary_factor={factor} rotates {rotated} of the {head_dim} channels "
                          "of a head: it must be a positive even number")
    return None if rotated == head_dim else rotated


def text_shape(hf: dict, family: str, renormalize: bool | None = None) -> HFShape:
    """Our ``model``/``moe`` keys from a Qwen3-Next-like text config (Qwen3-Next's, or Qwen3.5-MoE's
    ``text_config``); ``renormalize``: the family's fixed choice, or None to read ``norm_topk_prob``."""
    check_keys(hf, HANDLED, family)
    if hf.get("rope_parameters"):
        hf = hf | {"rope_parameters": {k: v for k, v in hf["rope_parameters"].items() if k not in MROPE_KEYS}}
    check_requirements(hf, {"use_sliding_window": (False, "use_sliding_window must be false (we attend fully)")})
    model = decoder_shape(hf, family, rope_theta=10000.0, partial_rotary=True)
    head_dim = model["head_dim"] or model["d_model"] // model["n_heads"]
    every, first = moe_layout(hf, model["n_layers"])
    model |= {"moe_every": every, "first_moe_layer": first, "qk_norm": True, "attn_output_gate": True,
              "rotary_dim": rotary_dim(hf, head_dim), "layer_types": layer_types(hf, model["n_layers"], family),
              **{ours: get_key(hf, key, family) for key, ours in LINEAR_KEYS.items()}}
    if "intermediate_size" in hf or every != 1 or first > 0:  # the dense layers' width, if any
        model["ffn_hidden"] = get_key(hf, "intermediate_size", family)
    if "linear_attention" not in model["layer_types"]:
        model |= {key: None for key in ("linear_key_heads", "linear_value_heads", "linear_key_head_dim",
                                        "linear_value_head_dim")}
    shared = get_key(hf, "shared_expert_intermediate_size", family)
    moe = routed_moe(get_key(hf, "num_experts", family), get_key(hf, "num_experts_per_tok", family),
                     get_key(hf, "moe_intermediate_size", family),
                     renormalize=bool(get_key(hf, "norm_topk_prob", family, False, False)) if renormalize is None
                     else renormalize)
    if shared:
        moe |= {"num_shared_experts": 1, "shared_expert_hidden": shared, "shared_expert_gate": True}
    if hf.get("num_nextn_predict_layers") or hf.get("mtp_num_hidden_layers"):
        print(f"note: the {family} checkpoint's multi-token prediction module (mtp.*) is imported under "
              "model.mtp_depth=1 (--set model.mtp_depth=1) and left out otherwise", file=sys.stderr)
    return HFShape(model, moe, int(get_key(hf, "max_position_embeddings", family)), None)


def shape_from_hf(hf: dict) -> HFShape:
    """Map a Qwen3-Next config.json onto our ``model``/``moe`` keys; any setting we do not implement is an error."""
    return text_shape(hf, FAMILY_NAME)


def hybrid_refusals(model: ModelConfig, moe: MoEConfig, family: str) -> list[tuple[bool, str]]:
    """What a Qwen3-Next-like family cannot express."""
    return [(not model.qk_norm, f"model.qk_norm=false: {family} normalises every query and key head"),
            (not model.attn_output_gate, f"model.attn_output_gate=false: {family}'s attention is gated"),
            (model.latent_attention, f"model.kv_lora_rank={model.kv_lora_rank}: {family} has no latent attention"),
            (model.qkv_bias or model.attn_output_bias or model.attention_sinks,
             f"attention biases or sinks: {family} has none"),
            mtp_refusal(model, family),
            (model.sliding_window is not None, f"model.sliding_window={model.sliding_window}: {family} attends "
                                               "fully or linearly"),
            (model.rope_scaling != "none", f"model.rope_scaling={model.rope_scaling!r}: plain RoPE only"),
            (model.mlp_layer_types is not None, "model.mlp_layer_types: write the MoE layers as moe_every / "
                                                "first_moe_layer"),
            (moe.num_shared_experts > 1, f"moe.num_shared_experts={moe.num_shared_experts}: {family} has one"),
            (moe.num_shared_experts == 1 and not moe.shared_expert_gate,
             f"moe.shared_expert_gate=false: {family}'s shared expert is gated"),
            *router_refusals(moe, family, shared_experts=True)]


def mtp_refusal(model: ModelConfig, family: str) -> tuple[bool, str]:
    return (model.mtp_depth > 1, f"model.mtp_depth={model.mtp_depth}: {family} stores one multi-token-prediction "
                                 "layer (its fc and norms would serve any more): use model.mtp_depth=1 or 0")


def text_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """The config.json keys of a Qwen3-Next-like text model."""
    dense = [i for i in range(model.n_layers) if not model.is_moe_layer(i)]
    linear = {key: getattr(model, ours) for key, ours in LINEAR_KEYS.items()}
    if not model.linear_attention:  # transformers needs the keys whether or not a layer is linear
        linear = {key: value if value is not None else 1 for key, value in linear.items()}
    out = {**decoder_config(model), "use_sliding_window": False, "intermediate_size": model.ffn_hidden,
           "moe_intermediate_size": moe.expert_hidden, "num_experts": moe.num_experts,
           "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.renormalize, "decoder_sparse_step": 1,
           "mlp_only_layers": dense,
           "shared_expert_intermediate_size": moe.shared_hidden if moe.num_shared_experts else 0,
           "layer_types": model.layer_types or ["full_attention"] * model.n_layers, **linear}
    if model.mtp_depth:  # the published configs' keys for their one MTP layer (mtp.*, ``mtp_sources``)
        out |= {"mtp_num_hidden_layers": model.mtp_depth, "mtp_use_dedicated_embeddings": False}
    out["rope_parameters"] = {"rope_type": "default", "rope_theta": model.rope_theta,
                              "partial_rotary_factor": model.rope_dim / model.head_size}
    del out["rope_theta"]
    return out


def hf_from_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """The config.json of our model as a Qwen3-Next; settings Qwen3-Next cannot express are errors."""
    refuse(ARCHITECTURE, hybrid_refusals(model, moe, FAMILY_NAME))
    return {"architectures": [ARCHITECTURE], "model_type": "qwen3_next", **text_config(model, moe)}


def _interleaved(widths: dict[str, int], groups: int) -> dict[str, tuple[int, ...]]:
    """For a tensor holding, per group, rows of each name in turn (``widths``: rows per group), each name's rows
    in the tensor, ours being the groups' blocks in order."""
    block = sum(widths.values())
    out, offset = {}, 0
    for name, width in widths.items():
        out[name] = tuple(g * block + offset + j for g in range(groups) for j in range(width))
        offset += width
    return out


def attention_sources(model: ModelConfig, ours: str, theirs: str) -> dict[str, Source]:
    """A full-attention layer's tensors: the gated ``q_proj`` split per head, the zero-centred q/k norms."""
    hd, heads = model.head_size, model.n_heads
    rows = _interleaved({"wq": hd, "wg": hd}, heads)
    q_proj = f"{theirs}self_attn.q_proj.weight"
    return {f"{ours}attn.wq.weight": Source("copy", (q_proj,), rows["wq"]),
            f"{ours}attn.wk.weight": Source("copy", (f"{theirs}self_attn.k_proj.weight",)),
            f"{ours}attn.wv.weight": Source("copy", (f"{theirs}self_attn.v_proj.weight",)),
            f"{ours}attn.wo.weight": Source("copy", (f"{theirs}self_attn.o_proj.weight",)),
            f"{ours}attn.wg.weight": Source("copy", (q_proj,), rows["wg"]),
            f"{ours}attn.q_norm.weight": Source("copy", (f"{theirs}self_attn.q_norm.weight",), offset=1.0),
            f"{ours}attn.k_norm.weight": Source("copy", (f"{theirs}self_attn.k_norm.weight",), offset=1.0)}


def fused_linear_sources(model: ModelConfig, ours: str, theirs: str) -> dict[str, Source]:
    """A linear layer's projections as Qwen3-Next fuses them, per key head (see the module's docstring)."""
    dk, dv, key_heads = model.linear_key_head_dim, model.linear_value_head_dim, model.linear_key_heads
    r = model.linear_value_heads // key_heads
    qkvz = _interleaved({"wq": dk, "wk": dk, "wv": r * dv, "wz": r * dv}, key_heads)
    ba = _interleaved({"wb": r, "wa": r}, key_heads)
    return {**{f"{ours}attn.{name}.weight": Source("copy", (f"{theirs}in_proj_qkvz.weight",), rows)
               for name, rows in qkvz.items()},
            **{f"{ours}attn.{name}.weight": Source("copy", (f"{theirs}in_proj_ba.weight",), rows)
               for name, rows in ba.items()}}


def linear_sources(model: ModelConfig, ours: str, theirs: str,
                   projections=fused_linear_sources) -> dict[str, Source]:
    """A Gated DeltaNet layer's tensors under ``theirs``linear_attn. (``projections``: how the family stores q,
    k, v, z, beta and a)."""
    keys = model.linear_key_heads * model.linear_key_head_dim
    values = model.linear_value_heads * model.linear_value_head_dim
    conv = f"{theirs}conv1d.weight"
    channels = {"conv_q": range(keys), "conv_k": range(keys, 2 * keys), "conv_v": range(2 * keys, 2 * keys + values)}
    out = {f"{ours}attn.{name}": Source("copy", (conv,), tuple(rows)) for name, rows in channels.items()}
    out |= {f"{ours}attn.decay_bias": Source("copy", (f"{theirs}dt_bias",)),
            f"{ours}attn.log_decay_rate": Source("copy", (f"{theirs}A_log",))}
    out |= projections(model, ours, theirs)
    out |= {f"{ours}attn.out_norm.weight": Source("copy", (f"{theirs}norm.weight",)),
            f"{ours}attn.wo.weight": Source("copy", (f"{theirs}out_proj.weight",))}
    return out


def hybrid_sources(model: ModelConfig, moe: MoEConfig, prefix: str = "model.",
                   projections=fused_linear_sources) -> dict[str, Source]:
    """Each of our state-dict names (our model's order) and its HF source, the decoder under ``prefix``, the
    multi-token-prediction module (``mtp_sources``) last."""
    out = {"tok_embeddings.weight": Source("copy", (f"{prefix}embed_tokens.weight",))}
    for i in range(model.n_layers):
        out |= layer_sources(model, moe, i, f"layers.{i}.", f"{prefix}layers.{i}.", projections)
    out["norm.weight"] = Source("copy", (f"{prefix}norm.weight",), offset=1.0)
    out["output.weight"] = Source("copy", (f"{prefix}embed_tokens.weight" if model.tie_embeddings
                                           else "lm_head.weight",))
    return out | mtp_sources(model, moe)


def layer_sources(model: ModelConfig, moe: MoEConfig, i: int, ours: str, theirs: str,
                  projections=fused_linear_sources) -> dict[str, Source]:
    """Decoder layer i's tensors (i >= n_layers: a multi-token-prediction module's block, full attention)."""
    out = {f"{ours}attn_norm.weight": Source("copy", (f"{theirs}input_layernorm.weight",), offset=1.0)}
    if model.layer(i).attention == "gated_delta":
        out |= linear_sources(model, ours, f"{theirs}linear_attn.", projections)
    else:
        out |= attention_sources(model, ours, theirs)
    out[f"{ours}ffn_norm.weight"] = Source("copy", (f"{theirs}post_attention_layernorm.weight",), offset=1.0)
    if not model.is_moe_layer(i):
        return out | {ours + name: Source("copy", (f"{theirs}mlp.{hf}",)) for name, hf in _DENSE.items()}
    out[f"{ours}moe.router.gate"] = Source("copy", (f"{theirs}mlp.gate.weight",))
    out |= expert_stacks(ours, f"{theirs}mlp.experts", GATED_EXPERTS, moe.num_experts)
    if moe.num_shared_experts:
        out |= {ours + name: Source("copy", (f"{theirs}mlp.{hf}",)) for name, hf in _SHARED.items()}
    return out


def mtp_sources(model: ModelConfig, moe: MoEConfig) -> dict[str, Source]:
    """The multi-token-prediction module (``model.mtp_depth`` 1; ``moe/mtp.py``) as the Qwen3-Next and Qwen3.5
    checkpoints store it beside the decoder, under ``mtp.`` (``MTP_PREFIX``; the layout vLLM's and SGLang's
    Qwen3-Next MTP loaders read): ``pre_fc_norm_embedding`` and ``pre_fc_norm_hidden`` (zero-centred, as every
    norm of the family), ``fc`` (its input the normalised embedding, then the normalised hidden state: ours),
    one full-attention decoder layer ``layers.0`` with its MoE, and the final ``norm``; the embedding and head are
    the main model's."""
    if not model.mtp_depth:
        return {}
    refused, why = mtp_refusal(model, "the checkpoint")
    if refused:
        raise ConfigError(why)
    ours, index = "mtp.0.", model.n_layers
    out = {f"{ours}embed_norm.weight": Source("copy", (f"{MTP_PREFIX}pre_fc_norm_embedding.weight",), offset=1.0),
           f"{ours}hidden_norm.weight": Source("copy", (f"{MTP_PREFIX}pre_fc_norm_hidden.weight",), offset=1.0),
           f"{ours}proj.weight": Source("copy", (f"{MTP_PREFIX}fc.weight",))}
    out |= layer_sources(model, moe, index, f"{ours}block.", f"{MTP_PREFIX}layers.0.")
    out[f"{ours}norm.weight"] = Source("copy", (f"{MTP_PREFIX}norm.weight",), offset=1.0)
    return out


def hf_sources(model: ModelConfig, moe: MoEConfig) -> dict[str, Source]:
    return hybrid_sources(model, moe)


FAMILY = Family(ARCHITECTURE, "qwen3_next", shape_from_hf, hf_from_config, hf_sources, mtp_prefix=MTP_PREFIX)
