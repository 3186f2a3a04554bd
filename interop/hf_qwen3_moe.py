"""The Qwen3-MoE family (Hugging Face ``Qwen3MoeForCausalLM``) in our terms: config mapping and tensor names.

Qwen3-MoE is our model with ``model.qk_norm`` (an RMSNorm over each query and key head before RoPE, weights
``self_attn.q_norm``/``k_norm`` [hd]), usually a ``model.head_dim`` of its own (Qwen3-30B-A3B: 128 with
d_model 2048 and 32 heads), and a softmax router whose top-k weights are renormalised only with
``norm_topk_prob`` (``moe.renormalize``). Its MoE layers are those i with (i + 1) % ``decoder_sparse_step``
== 0 and not in ``mlp_only_layers``; the others are dense SwiGLU FFNs of ``intermediate_size``
(``model.ffn_hidden``), the routed experts have ``moe_intermediate_size`` (``moe.expert_hidden``). Ours are
every ``moe_every``-th layer from ``first_moe_layer``: a layout that rule cannot give is refused, naming it.

Tensors: attention and norms as in ``interop/hf_family.py``; the router ``mlp.gate.weight``; per expert
``gate_proj`` (under silu) and ``up_proj`` [H, D] and ``down_proj`` [D, H], so ``w_gate[e] = gate_proj_e.T``,
``w_in[e] = up_proj_e.T``, ``w_out[e] = down_proj_e.T``; a dense layer's ``mlp.gate_proj``/``up_proj``/
``down_proj`` are our ``ffn.w_gate``/``w_in``/``w_out``, as they are.
"""

from __future__ import annotations

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from interop.hf_family import (
    DECODER_KEYS,
    GATED_EXPERTS,
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

ARCHITECTURE = "Qwen3MoeForCausalLM"
FAMILY_NAME = "Qwen3-MoE"
_DENSE = {"ffn.w_in.weight": "up_proj.weight", "ffn.w_gate.weight": "gate_proj.weight",
          "ffn.w_out.weight": "down_proj.weight"}


def _num_experts(hf: dict) -> int:
    """``num_experts`` (transformers 4.x writes it) or ``num_local_experts`` (5.x); both must agree."""
    values = {hf[key] for key in ("num_experts", "num_local_experts") if key in hf}
    if len(values) > 1:
        raise ConfigError(f"config.json num_experts={hf['num_experts']!r} and num_local_experts="
                          f"{hf['num_local_experts']!r} disagree")
    if not values:
        raise ConfigError(f"config.json has no 'num_experts', which a {FAMILY_NAME} config needs")
    experts = values.pop()
    if experts < 1:
        raise ConfigError(f"config.json num_experts={experts} is not supported: a model without routed experts "
                          f"is not a {FAMILY_NAME} model")
    return experts


def moe_layout(hf: dict, n_layers: int) -> tuple[int, int]:
    """Our (``moe_every``, ``first_moe_layer``) for the MoE layers ``decoder_sparse_step`` and ``mlp_only_layers``
    pick; an error naming them if no such pair gives exactly those layers."""
    step = get_key(hf, "decoder_sparse_step", FAMILY_NAME, 1, required=False)
    mlp_only = set(get_key(hf, "mlp_only_layers", FAMILY_NAME, [], required=False) or [])
    if step < 1:
        raise ConfigError(f"config.json decoder_sparse_step={step} must be >= 1")
    wanted = [i for i in range(n_layers) if i not in mlp_only and (i + 1) % step == 0]
    if not wanted:
        return 0, 0
    first = wanted[0]
    every = wanted[1] - first if len(wanted) > 1 else n_layers - first
    ours = [i for i in range(first, n_layers, every)]
    if ours != wanted:
        raise ConfigError(f"config.json decoder_sparse_step={step} with mlp_only_layers={sorted(mlp_only)} makes "
                          f"layers {wanted} MoE; ours are every model.moe_every-th layer from "
                          "model.first_moe_layer, which cannot give these")
    return every, first


def shape_from_hf(hf: dict) -> HFShape:
    """Map a Qwen3-MoE config.json onto our ``model``/``moe`` keys; any setting we do not implement is an error."""
    check_keys(hf, DECODER_KEYS | {"intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts",
                                   "num_experts_per_tok", "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers",
                                   "use_sliding_window", "max_window_layers"}, FAMILY_NAME)
    # max_window_layers only says which layers a sliding window would apply to
    check_requirements(hf, {"use_sliding_window": (False, "use_sliding_window must be false (we attend fully)")})
    model = decoder_shape(hf, FAMILY_NAME, rope_theta=10000.0)
    every, first = moe_layout(hf, model["n_layers"])
    model |= {"moe_every": every, "first_moe_layer": first, "qk_norm": True,
              "ffn_hidden": get_key(hf, "intermediate_size", FAMILY_NAME)}
    moe = routed_moe(_num_experts(hf), get_key(hf, "num_experts_per_tok", FAMILY_NAME),
                     get_key(hf, "moe_intermediate_size", FAMILY_NAME),
                     renormalize=bool(get_key(hf, "norm_topk_prob", FAMILY_NAME, False, False)))
    # transformers drops sliding_window unless use_sliding_window (refused above) is set
    return HFShape(model, moe, int(get_key(hf, "max_position_embeddings", FAMILY_NAME)), None)


def hf_from_config(model: ModelConfig, moe: MoEConfig) -> dict:
    """The config.json of our model as a Qwen3-MoE; settings Qwen3-MoE cannot express are errors.

    Our dense layers are written as ``mlp_only_layers`` (with ``decoder_sparse_step`` 1), which names any layout.
    """
    refuse(ARCHITECTURE, [(not model.qk_norm, "model.qk_norm=false: Qwen3-MoE normalises every query and key head"),
                          *router_refusals(moe, FAMILY_NAME), *attention_refusals(model, FAMILY_NAME)])
    dense = [i for i in range(model.n_layers) if not model.is_moe_layer(i)]
    return {"architectures": [ARCHITECTURE], "model_type": "qwen3_moe", **decoder_config(model),
            "use_sliding_window": False, "intermediate_size": model.ffn_hidden,
            "moe_intermediate_size": moe.expert_hidden, "num_experts": moe.num_experts,
            "num_experts_per_tok": moe.top_k, "norm_topk_prob": moe.renormalize, "decoder_sparse_step": 1,
            "mlp_only_layers": dense}


def hf_sources(model: ModelConfig, moe: MoEConfig) -> dict[str, Source]:
    """Each of our state-dict names (our model's order) and its HF source."""
    def layer(i: int, ours: str, theirs: str) -> dict[str, Source]:
        if not model.is_moe_layer(i):
            return {ours + name: Source("copy", (f"{theirs}mlp.{hf_name}",)) for name, hf_name in _DENSE.items()}
        return {f"{ours}moe.router.gate": Source("copy", (f"{theirs}mlp.gate.weight",)),
                **expert_stacks(ours, f"{theirs}mlp.experts", GATED_EXPERTS, moe.num_experts)}
    return decoder_sources(model, layer)


FAMILY = Family(ARCHITECTURE, "qwen3_moe", shape_from_hf, hf_from_config, hf_sources)
