"""DeepSeek-V4 interop against the oracle: ``transformers``' DeepseekV4ForCausalLM built from a tiny random config
with all three attention layer types (sliding, compressed sparse with the indexer's top 2 of 4 entries binding,
heavily compressed), a hash-routed and two learned MoE layers and 4 hyper-connected streams; imported by us (logits
within 1e-5 fp32), exported back (every tensor bit for bit, the hash table's integers included), and loaded by
``transformers`` from our export to the same logits; greedy generation of 20 tokens equal to ``transformers``'
``generate`` (its cache), ours through our cache and recomputing the sequence at each step alike."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from config.run import load_config
from inference import load_model
from inference.generate import generate
from interop.hf import import_folder
from tests.interop.hf_models import assert_each_edit_refused, assert_oracle_and_export_back, our_model, save_random

transformers = pytest.importorskip("transformers")
SEQ, VOCAB, EXPERTS, TOP_K = 16, 256, 4, 2
LAYER_TYPES = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]


def make_v4(folder: Path, seed: int = 0, layer_types: list[str] = LAYER_TYPES,
            mlp_layer_types: tuple[str, ...] = ("hash_moe", "moe", "moe"), **sizes) -> torch.nn.Module:
    """A random tiny DeepSeek-V4 saved to ``folder``: every weight drawn (its init leaves the hyper-connections'
    biases at zero and scales at one, the sinks and position biases at zero), the correction biases drawn so that
    they change the experts chosen, and each token id's hash experts distinct and random. One layer per entry of
    ``layer_types`` and ``mlp_layer_types``; ``sizes``: config values that override the tiny ones."""
    config = transformers.DeepseekV4Config(**{
        "vocab_size": VOCAB, "hidden_size": 32, "moe_intermediate_size": 16, "num_hidden_layers": len(layer_types),
        "num_attention_heads": 4, "head_dim": 16, "q_lora_rank": 12, "partial_rotary_factor": 0.25,
        "n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K, "o_groups": 2, "o_lora_rank": 8,
        "index_n_heads": 2, "index_head_dim": 8, "index_topk": 2, "sliding_window": 4, "hc_mult": 4,
        "layer_types": layer_types, "mlp_layer_types": list(mlp_layer_types),
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "max_position_embeddings": 64, "initializer_range": 0.1, "swiglu_limit": 1.0, "rms_norm_eps": 1e-6} | sizes)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(config)
    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith("tid2eid"):
                tensor.copy_(torch.rand(VOCAB, EXPERTS).topk(TOP_K, dim=-1).indices)
            elif name.endswith(("e_score_correction_bias", "sinks", "position_bias", "base", "scale", "hc_base",
                                "hc_scale")):
                tensor.normal_(0, 0.3)
    return save_random(model, folder)


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def test_import_and_export_match_transformers(tmp_path):
    hf = make_v4(tmp_path / "hf")
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    assert [spec.attention for spec in config.model.layer_pattern] == ["sliding_shared_kv", "compressed_sparse",
                                                                        "heavily_compressed"]
    assert [spec.feed_forward for spec in config.model.layer_pattern] == ["hash_moe", "moe", "moe"]
    assert (config.model.hc_mult, config.moe.score_func, config.moe.activation) == (4, "sqrtsoftplus",
                                                                                     "limited_swiglu")
    ours = our_model(tmp_path / "ours.safetensors")
    assert torch.equal(ours.layers["0"].moe.router.tid2eid, hf.model.layers[0].mlp.gate.tid2eid)
    assert_oracle_and_export_back(tmp_path, hf, ours, tokens(), "DeepseekV4ForCausalLM", tied=False)


def test_settings_we_do_not_implement_are_refused(tmp_path):
    make_v4(tmp_path / "hf")
    assert_each_edit_refused(tmp_path / "hf", [
        ({"num_key_value_heads": 2}, "num_key_value_heads must be 1"),
        ({"n_shared_experts": 2}, "n_shared_experts must be 1"),
        ({"scoring_func": "relu"}, "scoring_func='relu'"),
        ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "expert_dtype": "int8"}}, "expert_dtype='int8' is not supported"),
        ({"mlp_layer_types": ["dense", "moe", "moe"]}, "hash_moe or moe"),
    ], tmp_path / "out.safetensors", load_config("moe-8x"), SEQ)


def test_greedy_generation_matches_transformers(tmp_path):
    hf = make_v4(tmp_path / "hf", seed=1)
    generator = load_model(f"hf:{tmp_path / 'hf'}", seq_len=32).model
    prompt = [5, 77, 200, 3, 41, 9, 120, 18]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                             generation_config=transformers.GenerationConfig(pad_token_id=0))
    written = generate(generator, prompt, 20, temperature=0)
    assert written == theirs[0, len(prompt):].tolist()
    assert generate(generator, prompt, 20, temperature=0, use_cache=False) == written


@pytest.mark.parametrize("name, total, active", [("deepseek-v4-flash", 284_332_230_231, 13_270_091_351),
                                                 ("deepseek-v4-pro", 1_572_973_188_067, 48_828_388_323)])
def test_published_configs_count_what_transformers_builds(name, total, active):
    """Our V4 configs at published size: the config.json we export of each, built by ``transformers`` on the meta
    device (without the multi-token-prediction layer, which it does not build), has our parameter count; Flash's
    shape is transformers' defaults (its docstring's checkpoint, DeepSeek-V4-Flash-Base) but for its layer types.
    Published: Flash "284B total, 13B activated", Pro "1.6T total, 49B activated" (activated without the
    embedding lookup)."""
    from interop.hf_deepseek_v4 import hf_from_config
    from moe.accounting import parameter_counts

    config = load_config(name)
    exported = hf_from_config(config.model, config.moe)
    hf_config = transformers.DeepseekV4Config(**{key: value for key, value in exported.items()
                                                 if key not in ("architectures", "model_type")})
    if name == "deepseek-v4-flash":
        defaults = transformers.DeepseekV4Config()
        for key in ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "head_dim", "q_lora_rank", "qk_rope_head_dim", "num_experts_per_tok", "n_routed_experts",
                    "scoring_func", "routed_scaling_factor", "compress_rates", "compress_rope_theta", "hc_mult",
                    "hc_sinkhorn_iters", "hc_eps", "mlp_layer_types", "swiglu_limit", "sliding_window", "o_groups",
                    "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "rms_norm_eps"):
            assert getattr(hf_config, key) == getattr(defaults, key), key
    with torch.device("meta"):
        built = transformers.DeepseekV4ForCausalLM(hf_config)
    counts = parameter_counts(config.model, config.moe)
    assert counts.total == sum(param.numel() for param in built.parameters()) == total
    assert counts.active - counts.embedding == active
    assert round(counts.total / 1e9) == 284 if name == "deepseek-v4-flash" else round(counts.total / 1e11) == 16
    assert round(active / 1e9) == (13 if name == "deepseek-v4-flash" else 49)


def published_name(name: str) -> str:
    """A tensor's name in DeepSeek's published folders (their index lists ``embed.weight``, ``hc_head_fn``,
    ``layers.0.attn.kv_norm.weight``, ``mtp.0.attn.kv_norm.weight``) from the name ``transformers`` saves."""
    name = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}.get(name, name)
    if name.endswith(".attn.norm.weight"):
        name = name.removesuffix("norm.weight") + "kv_norm.weight"
    return name.replace("model.hc_head.hc_", "hc_head_").removeprefix("model.")


def test_published_tensor_names_are_read(tmp_path):
    """A folder under DeepSeek's published names (no ``model.`` prefix, ``embed``, ``hc_head_fn``, the attention's
    ``kv_norm``, an ``mtp.`` layer beside): ``transformers`` loads it to the oracle's logits (so the names are those
    its conversion mapping takes), and so does our import, which leaves the ``mtp.`` tensors out."""
    from safetensors.torch import load_file, save_file

    hf = make_v4(tmp_path / "hf")
    published = {}
    for name, tensor in load_file(str(tmp_path / "hf" / "model.safetensors")).items():
        published[published_name(name)] = tensor
    published["mtp.0.eh_proj.weight"] = torch.zeros(32, 64)
    (tmp_path / "hf" / "model.safetensors").unlink()
    save_file(published, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        expected = hf(tokens()).logits
        reloaded = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "hf").eval()
        torch.testing.assert_close(reloaded(tokens()).logits, expected, rtol=0, atol=1e-6)
        import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
        torch.testing.assert_close(our_model(tmp_path / "ours.safetensors")(tokens()), expected, rtol=0, atol=1e-5)


def test_published_config_json_is_read_as_transformers_folds_it(tmp_path):
    """DeepSeek's published config.json (DeepSeek-V4-Flash's keys: ``compress_ratios`` with an entry past the last
    layer for the MTP layer, ``num_hash_layers``, ``rope_scaling`` YaRN, ``qk_rope_head_dim``, ``topk_method``,
    ``expert_dtype`` beside ``quantization_config``) in place of the keys ``transformers`` writes: our import of the
    folder gives the logits of ``transformers``' load of the same folder (which folds those keys itself); keys that
    would contradict each other are refused."""
    import json

    make_v4(tmp_path / "hf", compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128})
    config_file = tmp_path / "hf" / "config.json"
    config = json.loads(config_file.read_text())
    for key in ("layer_types", "mlp_layer_types", "rope_parameters", "partial_rotary_factor", "compress_rates"):
        config.pop(key)
    config |= {"compress_ratios": [0, 4, 128, 0], "num_hash_layers": 1, "qk_rope_head_dim": 4, "rope_theta": 10000,
               "compress_rope_theta": 160000, "topk_method": "noaux_tc", "rope_scaling": {
                   "type": "yarn", "factor": 8, "original_max_position_embeddings": 8, "beta_fast": 32,
                   "beta_slow": 1}}
    config_file.write_text(json.dumps(config))
    imported = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    section = imported.model.compressed_attention
    assert [spec.attention for spec in imported.model.layer_pattern] == ["sliding_shared_kv", "compressed_sparse",
                                                                          "heavily_compressed"]
    assert [spec.feed_forward for spec in imported.model.layer_pattern] == ["hash_moe", "moe", "moe"]
    assert (section.rope_scaling, section.rope_factor, section.rope_theta) == ("yarn", 8.0, 160000.0)
    oracle = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(our_model(tmp_path / "ours.safetensors")(tokens()), oracle(tokens()).logits,
                                   rtol=0, atol=1e-5)
    assert_each_edit_refused(tmp_path / "hf", [
        ({"layer_types": LAYER_TYPES}, "both compress_ratios and layer_types"),
        ({"compress_ratios": [0, 4, 64]}, r"compress_ratios=\[0, 4, 64\]: one of \[0, 4, 128\] per layer"),
        ({"topk_method": "greedy"}, "topk_method='greedy'"),
        ({"rope_scaling": {"type": "yarn", "factor": 4, "mscale": 1.0}}, "rope_scaling setting 'mscale'"),
    ], tmp_path / "out.safetensors", load_config("moe-8x"), SEQ)


# DeepSeek-V4-Flash's config.json as published (transcribed from the file; the ``compress_ratios`` entry past the
# 43 layers is the MTP layer's)
FLASH_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0,
    "eos_token_id": 1, "expert_dtype": "fp4", "hc_eps": 1e-06, "hc_mult": 4, "hc_sinkhorn_iters": 20, "head_dim": 512,
    "hidden_act": "silu", "hidden_size": 4096, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
    "initializer_range": 0.02, "max_position_embeddings": 1048576, "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 64, "num_experts_per_tok": 6, "num_hidden_layers": 43, "num_hash_layers": 3,
    "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": 8, "o_lora_rank": 1024, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64, "quantization_config": {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16,
                                            "original_max_position_embeddings": 65536, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "sliding_window": 128,
    "swiglu_limit": 10.0, "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1", "use_cache": True, "vocab_size": 129280, "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0]}


def test_published_flash_config_json_is_our_flash_config():
    """The published config.json of DeepSeek-V4-Flash maps onto exactly ``configs/deepseek-v4-flash.yaml``'s model
    and routing, and our fold of its published keys is ``transformers``' (layer and MLP types, both RoPEs)."""
    from interop.hf_deepseek_v4 import _fold_published, shape_from_hf

    shape, ours = shape_from_hf(FLASH_CONFIG), load_config("deepseek-v4-flash")
    section = shape.model.pop("compressed_attention")
    assert {key: getattr(ours.model.compressed_attention, key) for key in section} == section
    assert {key: getattr(ours.model, key) for key in shape.model} == shape.model
    assert {key: getattr(ours.moe, key) for key in shape.moe} == shape.moe | {"shared_expert_hidden": None}
    folded = _fold_published(FLASH_CONFIG)
    theirs = transformers.DeepseekV4Config(**copy.deepcopy(FLASH_CONFIG))  # which edits the dicts it is given
    assert (folded["layer_types"], folded["mlp_layer_types"]) == (theirs.layer_types, theirs.mlp_layer_types)
    compress = {key: value for key, value in theirs.rope_parameters["compress"].items() if key != "type"}
    assert compress == folded["rope_parameters"]["compress"] | {"rope_theta": 160000, "partial_rotary_factor": 0.125}
    assert theirs.rope_parameters["main"]["rope_theta"] == shape.model["rope_theta"] == 10000
