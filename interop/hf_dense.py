"""Dense Hugging Face decoders (``LlamaForCausalLM``, ``Qwen3ForCausalLM``) in our terms, as sources for upcycling
(``interop/upcycle.py``).

Both are our dense model (``model.moe_every: 0``) exactly: pre-norm RMSNorm blocks, RoPE attention (grouped-query
optional) and a SwiGLU MLP; Qwen3 adds an RMSNorm over each query and key head (``model.qk_norm``) and usually a
head width of its own (``model.head_dim``). Attention, norms, embedding and head are named and laid out as in the
MoE families (``interop/hf_family.py``); the MLP's ``gate_proj`` (under silu), ``up_proj`` and ``down_proj`` are
our ``ffn.w_gate``, ``ffn.w_in`` and ``ffn.w_out``, all [out, in] as ours, so every tensor copies as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from config.errors import ConfigError
from config.model import ModelConfig
from interop.hf import HFFolder, HFWeights
from interop.hf_family import (
    DECODER_KEYS,
    HFShape,
    Source,
    check_keys,
    check_requirements,
    decoder_shape,
    decoder_sources,
    get_key,
)

_MLP = {"ffn.w_in.weight": "up_proj.weight", "ffn.w_gate.weight": "gate_proj.weight",
        "ffn.w_out.weight": "down_proj.weight"}


@dataclass(frozen=True)
class DenseFamily:
    """One dense architecture: its name, ``model_type``, whether it norms q/k heads, the config.json keys it has
    beyond ``DECODER_KEYS`` and ``intermediate_size``, and of those the one value each may have (key -> (value,
    why))."""

    name: str
    model_type: str
    qk_norm: bool
    keys: frozenset[str]
    requirements: dict[str, tuple[object, str]]


DENSE_FAMILIES = {
    "LlamaForCausalLM": DenseFamily("Llama", "llama", False, frozenset({"mlp_bias", "pretraining_tp"}), {
        "mlp_bias": (False, "mlp_bias must be false (no biases here)"),
        "pretraining_tp": (1, "pretraining_tp must be 1 (its sliced matmuls are another computation)")}),
    # max_window_layers and layer_types say where a sliding window would apply: checked below
    "Qwen3ForCausalLM": DenseFamily("Qwen3", "qwen3", True, frozenset({"use_sliding_window", "max_window_layers",
                                                                        "layer_types"}), {
        "use_sliding_window": (False, "use_sliding_window must be false (we attend fully)")}),
}


def dense_family(hf: dict) -> tuple[str, DenseFamily]:
    """The architecture a config.json names and its family, or an error naming it and the supported ones."""
    architectures = list(hf.get("architectures") or [])
    model_type = hf.get("model_type")
    for architecture, family in DENSE_FAMILIES.items():
        if model_type == family.model_type and architectures in ([], [architecture]):
            return architecture, family
    what = ", ".join(architectures) or f"model_type {model_type!r}"
    raise ConfigError(f"unsupported architecture {what}: a dense source is one of {', '.join(DENSE_FAMILIES)}, or a "
                      "checkpoint or safetensors file of this toolkit's dense model")


def shape_from_dense(hf: dict) -> HFShape:
    """Map a dense config.json onto our ``model`` keys; any setting we do not implement is an error."""
    _, family = dense_family(hf)
    check_keys(hf, DECODER_KEYS | {"intermediate_size"} | family.keys, family.name)
    check_requirements(hf, family.requirements)
    layer_types = set(hf.get("layer_types") or [])
    if layer_types - {"full_attention"}:
        raise ConfigError(f"config.json layer_types={hf['layer_types']!r} is not supported: every layer must be "
                          "'full_attention' (we attend fully)")
    model = decoder_shape(hf, family.name, rope_theta=10000.0) | {
        "ffn_hidden": get_key(hf, "intermediate_size", family.name), "moe_every": 0, "first_moe_layer": 0,
        "qk_norm": family.qk_norm}
    # Qwen3's sliding_window applies only with use_sliding_window, refused above
    window = hf.get("sliding_window") if family.model_type == "llama" else None
    return HFShape(model, {}, int(get_key(hf, "max_position_embeddings", family.name)), window)


def dense_sources(model: ModelConfig) -> dict[str, Source]:
    """Each of our dense model's state-dict names (our order) and the HF tensor it copies."""
    return decoder_sources(model, lambda i, ours, theirs: {
        ours + name: Source("copy", (f"{theirs}mlp.{hf_name}",)) for name, hf_name in _MLP.items()})


def dense_tensors(folder: HFFolder, model: ModelConfig
                  ) -> tuple[dict[str, tuple[torch.Size, torch.dtype]], Callable[[str], torch.Tensor], dict[str, str]]:
    """(each of our dense tensors' shape and dtype, a reader of one whole tensor under our name, our name -> the
    HF name) of an open folder, read through ``HFWeights``; a missing tensor is named before any is read."""
    weights = HFWeights(folder, dense_sources(model), 0, dense_family(folder.config)[0])
    weights.check_all_read(model)  # a tensor config.json does not describe is refused, not dropped
    entries = {ours: (torch.Size(weights.shape(ours)), weights.dtype(ours)) for ours in weights.sources}
    names = {ours: source.names[0] for ours, source in weights.sources.items()}
    return entries, lambda ours: weights.read(ours, ()), names


def open_dense_folder(path: Path) -> tuple[HFFolder, HFShape]:
    """An HF folder and its dense shape, or an error naming the folder's architecture and the supported ones."""
    folder = HFFolder(path)
    try:
        return folder, shape_from_dense(folder.config)
    except ConfigError as exc:
        folder.__exit__(None, None, None)
        raise ConfigError(f"{path}: {exc}") from exc
