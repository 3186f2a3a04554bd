"""GPT-OSS interop against the oracle: ``transformers``' own GptOssForCausalLM, built locally from tiny random
configs (no download), saved with ``save_pretrained``, imported by us, exported back; and MXFP4 expert stacks
read against transformers' own dequantising load of the same folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from config.errors import ConfigError
from config.run import load_config
from interop.hf import HFFolder, HFWeights, export_family, export_folder, import_folder
from tests.interop.hf_models import (
    assert_each_edit_refused,
    assert_oracle_and_export_back,
    edit_config,
    hf_tensors,
    our_model,
    save_random,
)
from tests.interop.test_hf import tokens
from tests.interop.test_hf_tokenizer import bpe

transformers = pytest.importorskip("transformers")
SEQ = 16
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}


def make_gpt_oss(folder: Path, seed: int = 0, shard: bool = False, **overrides) -> torch.nn.Module:
    """A random tiny GPT-OSS saved to ``folder``: norms, every bias and the sinks drawn (transformers starts the
    biases at zero), so a dropped or swapped one shows."""
    settings = dict(vocab_size=256, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                    num_experts_per_tok=2, sliding_window=3, rope_parameters=YARN, max_position_embeddings=64,
                    initializer_range=0.2, tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**settings))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("bias", "sinks")):
                param.normal_(0, 0.5)
    return save_random(model, folder, shard)


def as_published(folder: Path) -> None:
    """Rewrite a saved config.json as gpt-oss-20b's published one has it (transformers 4.55): YaRN under a top-level
    ``rope_scaling``, ``rope_theta`` apart, OpenAI's ``experts_per_token`` and ``initial_context_length``, no
    ``swiglu_alpha`` (1.702 was fixed in the code)."""
    data = json.loads((folder / "config.json").read_text())
    rope = data.pop("rope_parameters")
    data |= {"rope_theta": rope.pop("rope_theta"), "rope_scaling": rope,
             "experts_per_token": data["num_experts_per_tok"],
             "initial_context_length": rope["original_max_position_embeddings"], "torch_dtype": data.pop("dtype"),
             "transformers_version": "4.55.0.dev0"}
    del data["swiglu_alpha"]
    (folder / "config.json").write_text(json.dumps(data))


# windows shorter than SEQ: 3 takes the blocked path (a sequence of at least four windows), 5 the masked one
SHAPES = {
    "alternating-window-3-blocked-yarn-untruncated": {},
    "full-first-window-5-masked-tied-top1-clamped-sharded": dict(
        layer_types=["full_attention", "sliding_attention"], num_hidden_layers=2, sliding_window=5,
        tie_word_embeddings=True, num_experts_per_tok=1, swiglu_limit=0.3, swiglu_alpha=1.2, shard=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "as-published-4.x-config": dict(published=True),
}


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_import_export_match_transformers(tmp_path, shape):
    """Logits within 1e-5 in fp32; the export (fp32 asked for) loads back into transformers with the same logits,
    every tensor bit-exact."""
    settings = dict(SHAPES[shape])
    published = settings.pop("published", False)
    hf = make_gpt_oss(tmp_path / "hf", **settings)
    if published:
        as_published(tmp_path / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    model, moe = config.model, config.moe
    assert model.attention_sinks and model.qkv_bias and model.attn_output_bias and moe.router_bias
    default_kinds = ["sliding_attention", "full_attention", "sliding_attention"]
    assert model.layer_types == settings.get("layer_types", default_kinds)
    assert model.sliding_window == settings.get("sliding_window", 3)
    # GPT-OSS's YaRN does not truncate; plain RoPE keeps the default
    assert model.rope_scaling == ("none" if "rope_parameters" in settings else "yarn")
    assert model.yarn_truncate == (model.rope_scaling == "none")
    assert (moe.activation, moe.swiglu_limit, moe.swiglu_alpha) == (
        "clamped_swiglu", settings.get("swiglu_limit", 7.0), settings.get("swiglu_alpha", 1.702))
    ours = our_model(tmp_path / "ours.safetensors")
    assert_oracle_and_export_back(tmp_path, hf, ours, tokens(), "GptOssForCausalLM",
                                  tied=settings.get("tie_word_embeddings", False), dtype="fp32")


def test_default_export_is_bf16_and_says_so(tmp_path, capsys):
    """Without --dtype the export is bf16 (the note says so); from a bf16 folder the round trip is bit-exact. The
    folder's tokenizer reads the run's data and travels with the export, as for every family."""
    make_gpt_oss(tmp_path / "fp32", num_hidden_layers=2, vocab_size=300)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path / "hf")
    tokenizer = bpe(tmp_path / "hf")
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    assert config.data.tokenizer == str(tokenizer)
    export_folder(tmp_path / "ours.safetensors", tmp_path / "back")
    assert "writing GptOssForCausalLM in bf16" in capsys.readouterr().err
    assert (tmp_path / "back" / "tokenizer.json").read_bytes() == tokenizer.read_bytes()
    original, back = hf_tensors(tmp_path / "hf"), hf_tensors(tmp_path / "back")
    assert original.keys() == back.keys()
    for name, value in original.items():
        assert back[name].dtype == torch.bfloat16 and torch.equal(value, back[name]), name


def quantize_experts(folder: Path, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Replace a saved folder's expert stacks with random MXFP4 blocks and scales (2^-5 .. 2^-2, so activations stay
    moderate), as the published checkpoints store them, and declare it in config.json; returns the new tensors."""
    tensors = load_file(folder / "model.safetensors")
    for name in [name for name in tensors if name.endswith(("gate_up_proj", "down_proj"))]:
        experts, inputs, outputs = tensors.pop(name).shape
        tensors[name + "_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), dtype=torch.uint8,
                                                  generator=generator)
        tensors[name + "_scales"] = torch.randint(122, 126, (experts, outputs, inputs // 32), dtype=torch.uint8,
                                                  generator=generator)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    edit_config(folder, quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    return tensors


def test_mxfp4_experts_match_transformers_dequantised_load(tmp_path):
    """A folder with MXFP4 expert stacks: our import (dequantised as read) gives the logits of transformers' own
    load of it (``Mxfp4Config(dequantize=True)``) within 1e-5; a box across a 32-value block boundary reads the same
    values as the whole; blocks that do not match their scales are named before anything is read."""
    make_gpt_oss(tmp_path / "hf", hidden_size=64, intermediate_size=32, num_hidden_layers=2)
    tensors = quantize_experts(tmp_path / "hf", torch.Generator().manual_seed(2))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "hf", quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    ours = our_model(tmp_path / "ours.safetensors")
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens()), hf(tokens()).logits, rtol=0, atol=1e-5)

    with HFFolder(tmp_path / "hf") as folder:
        weights = HFWeights.of_family(folder, config.model, config.moe)
        name = "layers.1.moe.experts.w_gate"
        assert weights.dtype(name) == torch.bfloat16 and weights.shape(name) == (4, 64, 32)
        box = (slice(1, 3), slice(20, 45), slice(3, 11))
        assert torch.equal(weights.read(name, box), weights.read(name, ())[box])

    blocks = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    tensors[blocks] = tensors[blocks][:, :, :1].contiguous()  # one block per row where the scales have two
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=f"MXFP4 tensor '{blocks}' of shape \\[4, 64, 1, 16\\] does not match"):
        import_folder(tmp_path / "hf", tmp_path / "again.safetensors", load_config("moe-8x"), seq_len=SEQ)


def test_bad_input_is_named(tmp_path):
    make_gpt_oss(tmp_path / "hf", num_hidden_layers=2)
    out, base = tmp_path / "ours.safetensors", load_config("moe-8x")
    cases = [
        (dict(sliding_window=20), "config.json sliding_window=20 is longer than model.seq_len=16"),
        (dict(sliding_window=None), "sliding_window=None: its layer_types have sliding_attention layers"),
        (dict(swiglu_limit=0.0), "moe.swiglu_limit=0.0 must be a positive finite number"),
        (dict(layer_types=["chunked_attention", "full_attention"]), "layer_types\\[0\\]='chunked_attention'"),
        (dict(experts_per_token=3), "num_experts_per_tok=2 and experts_per_token=3 disagree"),
        (dict(quantization_config={"quant_method": "fp8"}), "GPT-OSS folders are read unquantised or with MXFP4"),
        (dict(quantization_config={"quant_method": "mxfp4", "group_size": 16}), "setting 'group_size' is not supp"),
        (dict(rope_parameters=YARN | {"truncate": "no"}),
         "rope_parameters.truncate='no' is a string: it must be true or false"),
        (dict(hidden_act="gelu"), "hidden_act must be 'silu'"),
    ]
    assert_each_edit_refused(tmp_path / "hf", cases, out, base, SEQ)


def test_export_picks_gpt_oss_and_no_family_drops_its_tensors():
    """GPT-OSS's options go to GptOssForCausalLM; a model with sinks but none of its biases is refused by every
    family, GPT-OSS for its biases and the others for the sinks they have no place for (never dropped silently)."""
    attention = ["model.n_kv_heads=2", "model.attention_sinks=true", "model.sliding_window=4",
                 "model.layer_types=[sliding_attention,full_attention,sliding_attention,full_attention]"]
    biases = ["model.qkv_bias=true", "model.attn_output_bias=true", "moe.router_bias=true",
              "moe.expert_proj_bias=true", "moe.activation=clamped_swiglu"]
    config = load_config("moe-8x", attention + biases)
    assert export_family(config.model, config.moe).architecture == "GptOssForCausalLM"
    with pytest.raises(ConfigError, match="cannot export as MixtralForCausalLM: moe.activation='clamped_swiglu'"):
        export_family(config.model, config.moe, "MixtralForCausalLM")
    config = load_config("moe-8x", attention[:2])
    with pytest.raises(ConfigError, match="MixtralForCausalLM: it has no place for our tensor 'layers.0.attn.sinks'"
                                          ".*GptOssForCausalLM: moe.router_bias and moe.expert_proj_bias must be true"):
        export_family(config.model, config.moe)
    config = load_config("moe-8x", attention[2:] + biases)
    with pytest.raises(ConfigError, match="GptOssForCausalLM: model.attention_sinks=false"):
        export_family(config.model, config.moe, "GptOssForCausalLM")
