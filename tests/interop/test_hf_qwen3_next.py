"""Qwen3-Next interop against the oracle: ``transformers``' own Qwen3NextForCausalLM, built locally from tiny random
configs (no download), saved with ``save_pretrained``, imported by us, exported back, and generating greedily."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from config.errors import ConfigError
from config.run import load_config
from inference.generate import generate
from inference.load import load_model
from interop.hf import export_family, export_folder, hf_run_config, import_folder, load_hf_weights, main
from moe.transformer import MoETransformer
from tests.interop.hf_models import (
    assert_each_edit_refused,
    assert_oracle_and_export_back,
    hf_tensors,
    our_model,
    save_random,
)
from tests.interop.test_hf import tokens

transformers = pytest.importorskip("transformers")
SEQ = 16


def make_qwen3_next(folder: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random tiny Qwen3-Next saved to ``folder``, norms randomised; every weight rounded to a bf16 value (as
    the published checkpoints' are), so that the zero-centred norms' 1 + w is exact in fp32 and an export gives
    back every tensor bit for bit."""
    settings = dict(vocab_size=256, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=6, linear_value_head_dim=5, num_experts=4, num_experts_per_tok=2,
                    moe_intermediate_size=12, shared_expert_intermediate_size=16, max_position_embeddings=64,
                    layer_types=["linear_attention", "full_attention"])
    settings.update(overrides)
    torch.manual_seed(seed)
    model = save_random(transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**settings)), folder)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    model.save_pretrained(folder)
    return model


SHAPES = {
    # 3 query heads over 1 key/value head, 3 linear key heads of 3 value heads: nothing divides evenly by 2
    "odd-heads": dict(num_attention_heads=3, num_key_value_heads=1, linear_num_key_heads=3, linear_num_value_heads=3,
                      hidden_size=24),
    "more-value-heads-than-key-heads": dict(linear_num_key_heads=1, linear_num_value_heads=3, linear_conv_kernel_dim=3),
    # full, linear, linear: not 3:1; a dense first layer, tied embeddings, half of each head rotated
    "full-first-dense-first-tied": dict(num_hidden_layers=3, layer_types=["full_attention", "linear_attention",
                                                                          "linear_attention"],
                                        mlp_only_layers=[0], tie_word_embeddings=True,
                                        rope_parameters={"rope_type": "default", "rope_theta": 5000.0,
                                                         "partial_rotary_factor": 0.5}),
}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_import_export_match_transformers(tmp_path, shape):
    settings = SHAPES[shape]
    hf = make_qwen3_next(tmp_path / "hf", **settings)
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    model = config.model
    assert model.layer_types == settings.get("layer_types", ["linear_attention", "full_attention"])
    assert model.attn_output_gate and model.qk_norm and config.moe.shared_expert_gate
    ours = our_model(tmp_path / "ours.safetensors")
    assert_oracle_and_export_back(tmp_path, hf, ours, tokens(), "Qwen3NextForCausalLM",
                                  tied=settings.get("tie_word_embeddings", False))
    # and our tensors, exported and imported again, bit for bit
    import_folder(tmp_path / "back", tmp_path / "again.safetensors", load_config("moe-8x"), seq_len=SEQ)
    again = our_model(tmp_path / "again.safetensors").state_dict()
    for name, value in ours.state_dict().items():
        assert torch.equal(value, again[name]), name


def test_greedy_generation_matches_transformers(tmp_path):
    """20 greedy tokens through our cache (the linear layers' state and convolution inputs, the full layer's keys)
    are transformers' own (its cache: the recurrent form for each new token)."""
    hf = make_qwen3_next(tmp_path / "hf", num_hidden_layers=3,
                         layer_types=["linear_attention", "linear_attention", "full_attention"])
    import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=32)
    ours = our_model(tmp_path / "ours.safetensors")
    prompt = [5, 17, 200, 3, 99, 41, 8]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0, len(prompt):].tolist()
    assert generate(ours, prompt, 20, temperature=0) == theirs


def test_config_as_published_and_bad_input(tmp_path):
    """The published config.json's form (transformers 4.5x: top-level partial_rotary_factor, full_attention_interval
    instead of layer_types) maps; settings we do not implement are refused by name."""
    make_qwen3_next(tmp_path / "hf", num_hidden_layers=4, layer_types=None)
    path = tmp_path / "hf" / "config.json"
    data = json.loads(path.read_text())
    data |= {"full_attention_interval": 4, "partial_rotary_factor": 0.25, "rope_theta": 10000.0,
             "use_sliding_window": False, "rope_scaling": None}
    del data["layer_types"], data["rope_parameters"]
    path.write_text(json.dumps(data))
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    assert config.model.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert config.model.rotary_dim == 2  # a quarter of 8
    cases = [(dict(use_sliding_window=True), "use_sliding_window"), (dict(attention_bias=True), "attention_bias"),
             (dict(partial_rotary_factor=0.1), "partial_rotary_factor=0.1"),
             (dict(linear_num_value_heads=3), "linear_value_heads=3 must be a multiple"),
             (dict(some_new_setting=1), "some_new_setting")]
    assert_each_edit_refused(tmp_path / "hf", cases, tmp_path / "out.safetensors", load_config("moe-8x"), SEQ)


def test_export_picks_qwen3_next_and_refuses_what_it_cannot_express(tmp_path):
    make_qwen3_next(tmp_path / "hf")
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    assert export_family(config.model, config.moe).architecture == "Qwen3NextForCausalLM"
    plain = load_config("moe-8x")
    with pytest.raises(ConfigError, match="qk_norm=false: Qwen3-Next normalises"):
        export_family(plain.model, plain.moe, "Qwen3NextForCausalLM")
    config.model.attn_output_gate = False
    with pytest.raises(ConfigError, match="attn_output_gate=false: Qwen3-Next's attention is gated"):
        export_family(config.model, config.moe, "Qwen3NextForCausalLM")


def make_qwen3_5_moe(folder: Path, seed: int = 0) -> torch.nn.Module:
    """A random tiny Qwen3.5-MoE (text model and a one-block vision tower) saved to ``folder``, weights rounded to
    bf16 values as in ``make_qwen3_next``."""
    text = dict(vocab_size=256, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=6,
                linear_value_head_dim=5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=12,
                shared_expert_intermediate_size=16, max_position_embeddings=64,
                layer_types=["linear_attention", "full_attention", "linear_attention"])
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)
    torch.manual_seed(seed)
    model = transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision))
    model = save_random(model, folder)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16().float())
    model.save_pretrained(folder)
    return model


def test_qwen3_5_moe_text_model_in_and_out(tmp_path, capsys):
    """The multimodal folder's text model: the vision tower named and left out, logits as transformers', exported
    as the text-only Qwen3_5MoeForCausalLM that transformers runs to the same logits, its tensors the original
    folder's text tensors bit for bit."""
    hf = make_qwen3_5_moe(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"  # as the published configs say it (transformers' default sections)
    data = json.loads(path.read_text())
    data["text_config"]["rope_parameters"] |= {"mrope_section": [11, 11, 10], "mrope_interleaved": True}
    path.write_text(json.dumps(data))
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    assert "vision tower" in capsys.readouterr().err and config.moe.renormalize
    ours = our_model(tmp_path / "ours.safetensors")
    x = tokens()
    with torch.no_grad():
        expected = hf(input_ids=x).logits
        torch.testing.assert_close(ours(x), expected, rtol=0, atol=1e-5)
    with pytest.raises(ConfigError, match="use --architecture Qwen3_5MoeForCausalLM"):
        export_family(config.model, config.moe, "Qwen3_5MoeForConditionalGeneration")
    export_folder(tmp_path / "ours.safetensors", tmp_path / "back", "Qwen3_5MoeForCausalLM")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back).__name__ == "Qwen3_5MoeForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, expected, rtol=0, atol=1e-5)
    original = {name.replace("model.language_model.", "model."): value
                for name, value in hf_tensors(tmp_path / "hf").items() if not name.startswith("model.visual.")}
    returned = hf_tensors(tmp_path / "back")
    assert original.keys() == returned.keys()
    for name, value in original.items():
        assert torch.equal(value, returned[name]), name


def test_load_model_reads_the_folder_once_at_its_own_context(tmp_path, capsys):
    """``load_model("hf:DIR")`` (``moe-generate``, ``moe-evaluate``) and ``moe-hf import`` without ``--seq-len`` take
    the model's context (config.json's max_position_embeddings, 64 here; moe-8x's is 256), and the vision tower's
    note is said once, not once per reading of config.json."""
    make_qwen3_5_moe(tmp_path / "hf")
    capsys.readouterr()
    assert load_model(f"hf:{tmp_path / 'hf'}").config.model.seq_len == 64
    assert capsys.readouterr().err.count("vision tower") == 1
    assert main(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "ours.safetensors")]) == 0
    assert capsys.readouterr().err.count("vision tower") == 1
    assert our_model(tmp_path / "ours.safetensors").config.seq_len == 64


def test_init_from_a_qwen3_next_folder_converts_on_the_fly(tmp_path):
    """``--init-from hf:DIR``'s path (``load_hf_weights``: each tensor read box by box through the rows and offsets
    of the mapping) fills a model with the folder's function."""
    hf = make_qwen3_next(tmp_path / "hf")
    config = hf_run_config(load_config("moe-8x"), tmp_path / "hf", seq_len=SEQ)
    model = MoETransformer(config.model, config.moe).eval()
    assert load_hf_weights(model, tmp_path / "hf", config) > 0
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), hf(tokens()).logits, rtol=0, atol=1e-5)
