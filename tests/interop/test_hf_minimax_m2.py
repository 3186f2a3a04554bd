"""MiniMax-M2 interop against the oracle: ``transformers``' own MiniMaxM2ForCausalLM, built locally from tiny random
configs (no download), saved with ``save_pretrained``, imported by us, exported back, and generating greedily."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from config.errors import ConfigError
from config.run import load_config
from inference.generate import generate
from interop.hf import export_family, import_folder
from tests.interop.hf_models import assert_each_edit_refused, assert_oracle_and_export_back, our_model, save_random
from tests.interop.test_hf import tokens

transformers = pytest.importorskip("transformers")
SEQ = 16


def make_minimax_m2(folder: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random tiny MiniMax-M2 saved to ``folder``: norms randomised, and the routing bias too (zeros would leave
    the biased choice untested)."""
    settings = dict(vocab_size=256, hidden_size=32, intermediate_size=12, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=64, rotary_dim=4, bos_token_id=1, eos_token_id=2)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = save_random(transformers.MiniMaxM2ForCausalLM(transformers.MiniMaxM2Config(**settings)), folder)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.e_score_correction_bias.copy_(torch.randn(settings["num_local_experts"]) * 0.5)
    model.save_pretrained(folder)
    return model


SHAPES = {
    "rotary-half": {},
    # 3 query heads over 1 key/value head, heads wider than d_model / heads, RoPE on 2 of 12 channels, top-3 of 5
    "odd-heads": dict(num_attention_heads=3, num_key_value_heads=1, head_dim=12, rotary_dim=2, num_local_experts=5,
                      num_experts_per_tok=3),
}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_import_export_match_transformers(tmp_path, shape):
    hf = make_minimax_m2(tmp_path / "hf", **SHAPES[shape])
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    assert (config.model.qk_norm, config.model.qk_norm_type, config.moe.score_func) == (True, "per_layer", "sigmoid")
    ours = our_model(tmp_path / "ours.safetensors")
    assert_oracle_and_export_back(tmp_path, hf, ours, tokens(), "MiniMaxM2ForCausalLM", tied=False)


def test_greedy_generation_matches_transformers(tmp_path):
    hf = make_minimax_m2(tmp_path / "hf")
    import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=32)
    ours = our_model(tmp_path / "ours.safetensors")
    prompt = [5, 17, 200, 3, 99, 41, 8]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    assert generate(ours, prompt, 20, temperature=0) == theirs


def test_the_published_config_maps_and_bad_input_is_refused(tmp_path):
    """The published config.json's keys (transformers 4.x form: rotary_dim and rope_theta at the top, the MTP,
    routing and norm switches) map; what we do not build is refused by name; export refuses what the family cannot
    express."""
    make_minimax_m2(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    del data["rope_parameters"]
    data |= {"rope_theta": 5000000, "attn_type_list": [1, 1], "use_qk_norm": True, "qk_norm_type": "per_layer",
             "scoring_func": "sigmoid", "use_routing_bias": True, "shared_intermediate_size": 0, "use_mtp": True,
             "num_mtp_modules": 3, "mtp_transformer_layers": 1}
    path.write_text(json.dumps(data))
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    assert (config.model.rotary_dim, config.model.rope_theta, config.moe.top_k) == (4, 5000000.0, 2)
    cases = [(dict(attn_type_list=[0, 1]), "lightning-attention"), (dict(qk_norm_type="per_head"), "qk_norm_type"),
             (dict(scoring_func="softmax"), "scoring_func"), (dict(shared_intermediate_size=8), "shared_intermediate"),
             (dict(rotary_dim=3), "rotary_dim=3"), (dict(some_new_setting=1), "some_new_setting")]
    assert_each_edit_refused(tmp_path / "hf", cases, tmp_path / "out.safetensors", load_config("moe-8x"), SEQ)
    assert export_family(config.model, config.moe).architecture == "MiniMaxM2ForCausalLM"
    config.model.qk_norm_type = "per_head"
    with pytest.raises(ConfigError, match="MiniMax-M2 normalises all heads' queries and keys at once"):
        export_family(config.model, config.moe, "MiniMaxM2ForCausalLM")


def test_per_layer_qk_norm_is_refused_where_it_is_not_served():
    """The per-layer q/k norms need model.qk_norm; tensor parallelism would split their span over ranks."""
    from config.model import ModelConfig
    from config.run import RunConfig
    from parallel.resolve import resolve_layout

    with pytest.raises(ConfigError, match="qk_norm_type='per_layer' needs model.qk_norm=true"):
        ModelConfig(qk_norm_type="per_layer").validate()
    with pytest.raises(ConfigError, match="qk_norm_type='per_row' must be one of per_head, per_layer"):
        ModelConfig(qk_norm=True, qk_norm_type="per_row").validate()
    run = RunConfig(model=ModelConfig(qk_norm=True, qk_norm_type="per_layer"))
    run.parallel.tp = 2
    with pytest.raises(ConfigError, match="parallel.tp=2 with model.qk_norm_type=per_layer"):
        resolve_layout(run, 2)
