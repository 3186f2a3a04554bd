"""GLM-4.5 interop against the oracle: ``transformers``' own Glm4MoeForCausalLM, built locally from tiny random
configs (no download), saved with ``save_pretrained``, imported by us, exported back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from config.errors import ConfigError
from config.run import load_config
from interop.hf import export_family, import_folder
from tests.interop.hf_models import (
    assert_each_edit_refused,
    assert_oracle_and_export_back,
    our_model,
    save_random,
)
from tests.interop.test_hf import tokens

transformers = pytest.importorskip("transformers")
SEQ = 16


def make_glm(folder: Path, seed: int = 0, shard: bool = False, **overrides) -> torch.nn.Module:
    """A random tiny GLM-4.5 saved to ``folder``: norms, q/k/v biases and correction biases randomised (transformers
    starts the last two at zero)."""
    settings = dict(vocab_size=256, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
                    first_k_dense_replace=1, routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                    max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(**settings))
    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(("e_score_correction_bias", "proj.bias")):
                tensor.normal_(0, 0.1)
    return save_random(model, folder, shard)


def as_published(folder: Path) -> None:
    """Rewrite a saved config.json as GLM-4.5's published one has it (transformers 4.5x): ``partial_rotary_factor``
    and ``rope_theta`` at the top level, ``rope_scaling: null``."""
    data = json.loads((folder / "config.json").read_text())
    rope = data.pop("rope_parameters")
    data |= {"rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"],
             "rope_scaling": None, "torch_dtype": data.pop("dtype"), "transformers_version": "4.54.0"}
    (folder / "config.json").write_text(json.dumps(data))


SHAPES = {
    "half-rotary-bias-qk-norm-groups-dense-first": {},
    "air-like-one-group-no-qk-norm-tied": dict(use_qk_norm=False, n_group=1, topk_group=1, tie_word_embeddings=True,
                                               first_k_dense_replace=0, num_hidden_layers=2),
    "full-rotary-no-bias-two-shared-sharded": dict(
        attention_bias=False, n_shared_experts=2, n_group=2, topk_group=1, norm_topk_prob=False,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 1.0}, shard=True),
    "as-published-4.x-config": dict(published=True),
}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_import_export_match_transformers(tmp_path, shape):
    settings = dict(SHAPES[shape])
    published = settings.pop("published", False)
    hf = make_glm(tmp_path / "hf", **settings)
    if published:
        as_published(tmp_path / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    factor = settings.get("rope_parameters", {}).get("partial_rotary_factor", 0.5)
    assert config.model.rotary_dim == (None if factor == 1.0 else 4)
    assert config.model.qkv_bias == settings.get("attention_bias", True)
    assert config.model.qk_norm == settings.get("use_qk_norm", True) and config.moe.score_func == "sigmoid"
    ours = our_model(tmp_path / "ours.safetensors")
    assert_oracle_and_export_back(tmp_path, hf, ours, tokens(), "Glm4MoeForCausalLM",
                                  tied=settings.get("tie_word_embeddings", False))


def test_bad_input_is_named(tmp_path):
    make_glm(tmp_path / "hf")
    out, base = tmp_path / "ours.safetensors", load_config("moe-8x")
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    cases = [
        (dict(rope_parameters=rope | {"partial_rotary_factor": 0.375}),
         "partial_rotary_factor=0.375 is not supported: it rotates 3"),
        (dict(partial_rotary_factor=0.25), r"partial_rotary_factor twice, differently: \[0.25, 0.5\]"),
        (dict(rope_parameters=rope | {"rope_type": "yarn", "factor": 2.0}), "rope_parameters=.* is not supported"),
        (dict(n_group=3), "moe.n_group=3 must divide moe.num_experts=8"),
        (dict(hidden_act="gelu"), "hidden_act must be 'silu'"),
        (dict(q_lora_rank=8), "'q_lora_rank'=8 is not supported by the GLM-4.5 import"),
        (dict(architectures=["Glm4MoeForCausalLM"], model_type="deepseek_v3"), "model_type 'deepseek_v3'"),
    ]
    assert_each_edit_refused(tmp_path / "hf", cases, out, base, SEQ)


def test_export_goes_to_glm_for_its_attention():
    """Grouped-query attention with biases, partial rotary and sigmoid group-limited routing is GLM-4.5's alone."""
    glm = ["model.qkv_bias=true", "model.rotary_dim=16", "model.qk_norm=true", "moe.score_func=sigmoid",
           "moe.num_shared_experts=1", "moe.n_group=4", "moe.topk_group=2", "moe.routed_scaling_factor=2.5"]
    config = load_config("moe-8x", glm)
    assert export_family(config.model, config.moe).architecture == "Glm4MoeForCausalLM"
    for architecture, message in [("MixtralForCausalLM", "Mixtral"), ("Qwen3MoeForCausalLM", "Qwen3-MoE"),
                                  ("DeepseekV3ForCausalLM", "latent attention")]:
        with pytest.raises(ConfigError, match=message):
            export_family(config.model, config.moe, architecture)
    # 30 / 44 in floating point times 44 is just under 30: transformers would rotate 29 channels
    config = load_config("moe-8x", [*glm, "model.head_dim=44", "model.rotary_dim=30"])
    with pytest.raises(ConfigError, match="model.rotary_dim=30: no partial_rotary_factor gives it exactly"):
        export_family(config.model, config.moe, "Glm4MoeForCausalLM")
