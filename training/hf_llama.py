"""Dense Llama (Hugging Face ``LlamaForCausalLM``) in our terms, as a source for upcycling (``training/upcycle.py``).

A Llama is our dense model (``model.moe_every: 0``) exactly: pre-norm RMSNorm blocks, RoPE attention (grouped-query
optional, the rotate-half convention ours shares with Mixtral: see ``training/hf_mixtral.py``) and a SwiGLU MLP.
Every weight copies as it is, our Linear weights being [out, in] like HF's: ``mlp.gate_proj`` (under silu) is our
``ffn.w_gate``, ``mlp.up_proj`` our ``ffn.w_in``, ``mlp.down_proj`` our ``ffn.w_out``. Attention, norms,
embedding and head are named as in Mixtral and share its names.

Qwen3's dense models add a per-head RMSNorm on queries and keys, which our model gains with the Qwen3-MoE
import; they are not mapped here yet.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from moe.config import ConfigError
from training.hf import DTYPES, HFFolder
from training.hf_family import ATTENTION_COPIES, IGNORED_KEYS, HFShape, _rope_theta

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"

# the per-layer names Llama shares with Mixtral (attention and norms), and its MLP
_LAYER_NAMES = {ours: theirs for ours, theirs in ATTENTION_COPIES.items() if "q_norm" not in ours
                and "k_norm" not in ours} | {
    "ffn.w_gate.weight": "mlp.gate_proj.weight", "ffn.w_in.weight": "mlp.up_proj.weight",
    "ffn.w_out.weight": "mlp.down_proj.weight"}

_HANDLED = {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rope_theta", "rope_parameters",
            "rope_scaling", "rms_norm_eps", "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias",
            "attention_dropout", "pretraining_tp"}
_REQUIRED = {"hidden_act": ("silu", "hidden_act must be 'silu' (a SwiGLU MLP)"),
             "attention_bias": (False, "attention_bias must be false (no biases here)"),
             "mlp_bias": (False, "mlp_bias must be false (no biases here)"),
             "attention_dropout": (0, "attention_dropout must be 0 (no attention dropout here)"),
             "pretraining_tp": (1, "pretraining_tp must be 1 (its sliced matmuls are another computation)")}


def is_llama(hf: dict) -> bool:
    architectures = hf.get("architectures") or []
    return hf.get("model_type") == MODEL_TYPE and (not architectures or list(architectures) == [ARCHITECTURE])


def shape_from_llama(hf: dict) -> HFShape:
    """Map a Llama config.json onto our dense ``model`` keys; any setting we do not implement is an error."""
    unknown = sorted(set(hf) - _HANDLED - IGNORED_KEYS)
    if unknown:
        raise ConfigError(f"config.json setting '{unknown[0]}'={hf[unknown[0]]!r} is not supported by the Llama "
                          f"mapping (it would be silently dropped); unsupported keys: {', '.join(unknown)}")
    for key, (wanted, why) in _REQUIRED.items():
        if key in hf and hf[key] != wanted:
            raise ConfigError(f"config.json {key}={hf[key]!r} is not supported: {why}")
    missing = [key for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "max_position_embeddings") if key not in hf]
    if missing:
        raise ConfigError(f"config.json has no '{missing[0]}', which a Llama config needs")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") is not None and hf["head_dim"] * heads != hidden:
        raise ConfigError(f"config.json head_dim={hf['head_dim']} is not supported: our head dim is "
                          f"hidden_size/num_attention_heads = {hidden}/{heads}")
    model = {"vocab_size": hf["vocab_size"], "d_model": hidden, "n_layers": hf["num_hidden_layers"],
             "n_heads": heads, "n_kv_heads": hf.get("num_key_value_heads", heads),
             "ffn_hidden": hf["intermediate_size"], "moe_every": 0, "first_moe_layer": 0,
             "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "rope_theta": _rope_theta(hf, 10000.0),
             "norm_eps": float(hf.get("rms_norm_eps", 1e-6))}
    return HFShape(model, {}, int(hf["max_position_embeddings"]), None)


def llama_names(n_layers: int, tie_embeddings: bool) -> dict[str, str]:
    """Each of our dense model's state-dict names and the Llama tensor it copies."""
    out = {"tok_embeddings.weight": "model.embed_tokens.weight"}
    for i in range(n_layers):
        out |= {f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in _LAYER_NAMES.items()}
    out["norm.weight"] = "model.norm.weight"
    # tied: the head is the embedding (save_pretrained may leave lm_head out of the files)
    out["output.weight"] = "model.embed_tokens.weight" if tie_embeddings else "lm_head.weight"
    return out


def llama_tensors(folder: HFFolder, n_layers: int, tie_embeddings: bool
                  ) -> tuple[dict[str, tuple[torch.Size, torch.dtype]], Callable[[str], torch.Tensor], dict]:
    """(each of our dense tensors' shape and dtype, a reader of one whole tensor under our name, our name -> the
    HF name) of an open Llama folder; a missing tensor is named before any is read."""
    names = llama_names(n_layers, tie_embeddings)
    entries = {}
    for ours, theirs in names.items():
        source = folder.slice(theirs)
        dtype = DTYPES.get(source.get_dtype())
        if dtype is None:
            raise ConfigError(f"{folder.folder}: tensor '{theirs}' has dtype {source.get_dtype()}, not supported")
        entries[ours] = (torch.Size(source.get_shape()), dtype)
    return entries, lambda ours: folder.slice(names[ours])[:], names


def open_llama(path: Path) -> tuple[HFFolder, HFShape]:
    """An HF folder and its Llama shape, or an error naming the folder's architecture and the supported ones."""
    folder = HFFolder(path)
    if not is_llama(folder.config):
        folder.__exit__(None, None, None)
        what = ", ".join(folder.config.get("architectures") or []) or f"model_type {folder.config.get('model_type')!r}"
        raise ConfigError(f"{path}: unsupported architecture {what}: a dense source is {ARCHITECTURE} (model_type "
                          f"'{MODEL_TYPE}') or a checkpoint or safetensors file of this toolkit's dense model "
                          "(Qwen3ForCausalLM needs query/key norms, not mapped yet)")
    return folder, shape_from_llama(folder.config)
