"""DeepSeek-V3.2 and GLM-5 interop against the oracle: ``transformers``' DeepseekV32ForCausalLM and
GlmMoeDsaForCausalLM built from tiny random configs whose indexer keeps 5 of the 16 positions (the selection binds),
imported by us (logits within 1e-5), exported back (every tensor bit for bit), and greedy generation through our
cache (the indexer's keys kept beside the latent keys) equal to ``transformers``' ``generate``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from config.errors import ConfigError
from config.run import load_config
from inference import load_model
from inference.generate import generate
from interop.hf import export_family, import_folder
from tests.interop.hf_models import assert_each_edit_refused, assert_oracle_and_export_back, our_model, save_random
from tests.interop.test_hf import tokens

transformers = pytest.importorskip("transformers")
SEQ = 16
FAMILIES = {"deepseek-v3.2": ("DeepseekV32ForCausalLM", "DeepseekV32Config"),
            "glm-5": ("GlmMoeDsaForCausalLM", "GlmMoeDsaConfig")}


def make_sparse(folder: Path, family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """A random tiny model of ``family`` saved to ``folder``, its correction biases drawn so that they change the
    experts chosen, and its indexer's LayerNorm bias away from zero."""
    architecture, config = FAMILIES[family]
    settings = dict(vocab_size=256, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                    n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2, first_k_dense_replace=1,
                    q_lora_rank=10, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                    index_topk=5, index_n_heads=8, index_head_dim=8, routed_scaling_factor=2.5,
                    max_position_embeddings=64, initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(getattr(transformers, config)(**settings | overrides))
    with torch.no_grad():
        for name, tensor in [*model.named_buffers(), *model.named_parameters()]:
            if name.endswith(("e_score_correction_bias", "k_norm.bias")):
                tensor.normal_(0, 0.1)
    return save_random(model, folder)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_export_and_greedy_generation_match_transformers(tmp_path, family):
    hf = make_sparse(tmp_path / "hf", family)
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    assert (config.model.index_topk, config.model.index_n_heads, config.model.index_head_dim) == (5, 8, 8)
    assert all(spec.attention == "sparse_latent" for spec in config.model.layer_pattern)
    ours = our_model(tmp_path / "ours.safetensors")
    assert_oracle_and_export_back(tmp_path, hf, ours, tokens(), FAMILIES[family][0], tied=False,
                                  named=family == "glm-5")
    generator = load_model(f"hf:{tmp_path / 'hf'}", seq_len=48).model
    prompt = [5, 77, 200, 3, 41, 9, 120, 18]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                             generation_config=transformers.GenerationConfig(pad_token_id=0))
    assert generate(generator, prompt, 20, temperature=0) == theirs[0, len(prompt):].tolist()


@pytest.mark.parametrize("topk, length", [(5, SEQ), (2, 32)])  # the masked kernel; the gathered one (32 >= 16·2)
def test_glm_5_layers_sharing_a_selection_match_transformers(tmp_path, topk, length):
    """GLM-5's indexer_types: the shared layers carry no indexer and attend to the keys the last full layer before
    them selected (F S S F S: a chain of two, then a new full layer's selection); logits within 1e-5, export
    bit-exact (no indexer tensors written for shared layers), picked as GLM-5 (DeepSeek-V3.2 cannot say it)."""
    types = ["full", "shared", "shared", "full", "shared"]
    hf = make_sparse(tmp_path / "hf", "glm-5", num_hidden_layers=5, indexer_types=types, index_topk=topk)
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=length)
    assert config.model.indexer_types == types
    assert [spec.attention for spec in config.model.layer_pattern] == [
        "sparse_latent" if kind == "full" else "shared_selection" for kind in types]
    ours = our_model(tmp_path / "ours.safetensors")
    assert ours.layers["2"].attn.indexer is None and ours.layers["2"].attn.relay is ours.layers["0"].attn.relay
    x = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(1))
    assert_oracle_and_export_back(tmp_path, hf, ours, x, "GlmMoeDsaForCausalLM", tied=False)
    for i in ("1", "2", "4"):  # the shared layers attending densely instead: other logits, so the sharing binds
        ours.layers[i].attn.dense_warmup = True
    with torch.no_grad():
        assert (ours(x) - hf(x).logits).abs().max() > 1e-3
    if length == SEQ:  # and generation through the cache, each step's selection shared as in the whole forward
        generator = load_model(f"hf:{tmp_path / 'hf'}", seq_len=48).model
        prompt = [5, 77, 200, 3, 41, 9, 120, 18]
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                 generation_config=transformers.GenerationConfig(pad_token_id=0))
        assert generate(generator, prompt, 12, temperature=0) == theirs[0, len(prompt):].tolist()


def test_glm_5_indexer_types_derive_as_transformers_derives_them():
    from interop.hf_glm_moe_dsa import indexer_types

    for settings in (dict(), dict(index_topk_freq=2), dict(index_topk_freq=3, index_skip_topk_offset=4),
                     dict(index_topk_pattern="FSSFS")):
        expected = transformers.GlmMoeDsaConfig(num_hidden_layers=5, **settings).indexer_types
        assert indexer_types(settings, 5) == expected, settings


def test_the_glm_5_indexer_rows_are_reordered(tmp_path):
    """GLM-5's indexer rotates interleaved pairs: read as DeepSeek-V3.2's (copied as they are), the logits differ."""
    hf = make_sparse(tmp_path / "hf", "glm-5")
    config = import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    ours = our_model(tmp_path / "ours.safetensors")
    with torch.no_grad():
        expected = hf(tokens()).logits
        torch.testing.assert_close(ours(tokens()), expected, rtol=0, atol=1e-5)
        from interop.hf_glm_moe_dsa import index_rows

        for block in ours.layers.values():
            query_rows, key_rows = (torch.tensor(rows).argsort() for rows in index_rows(config.model))
            indexer = block.attn.indexer  # back to GLM-5's row order: our reading undone
            indexer.wq.weight.copy_(indexer.wq.weight[query_rows])
            for param in (indexer.wk.weight, indexer.k_norm.weight, indexer.k_norm.bias):
                param.copy_(param[key_rows])
        assert (ours(tokens()) - expected).abs().max() > 1e-3


def test_bad_input_is_named(tmp_path):
    make_sparse(tmp_path / "hf", "glm-5")
    assert_each_edit_refused(tmp_path / "hf", [
        (dict(indexer_types=["shared", "full", "full"]), r"indexer_types=\['shared', 'full', 'full'\] is not "
                                                         "supported: one 'full' or 'shared' per layer, the first"),
        (dict(indexer_types=["full", "full"]), r"indexer_types=\['full', 'full'\] is not supported"),
        (dict(layer_types=["indexed_attention", "full_attention", "indexed_attention"]),
         r"layer_types=.* is not supported: GLM-5 here has"),
        (dict(mlp_layer_types=["sparse"] * 3), r"mlp_layer_types=.* is not supported"),
        (dict(indexer_types=None, index_topk_pattern="SFF"), r"indexer_types=\['shared', 'full', 'full'\] is not"),
        (dict(indexer_rope_interleave=False), r"indexer_rope_interleave=False is not supported"),
    ], tmp_path / "out.safetensors", load_config("moe-8x"), SEQ)


def test_export_picks_the_sparse_families_and_refuses_what_they_cannot_express():
    sparse = load_config("deepseek-v3", [
        "model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.q_lora_rank=10", "model.kv_lora_rank=12",
        "model.qk_nope_head_dim=6", "model.qk_rope_head_dim=4", "model.v_head_dim=5", "model.index_topk=5",
        "model.index_n_heads=4", "model.index_head_dim=8", "model.first_moe_layer=1", "moe.num_experts=8",
        "moe.expert_hidden=16", "moe.top_k=2", "moe.n_group=4", "moe.topk_group=2", "model.ffn_hidden=40",
        "model.seq_len=16", "model.mtp_depth=0"])
    assert export_family(sparse.model, sparse.moe).architecture == "DeepseekV32ForCausalLM"
    dense = load_config("deepseek-v3", ["model.n_layers=2", "model.first_moe_layer=1", "model.mtp_depth=0",
                                        "model.seq_len=16"])
    for architecture in ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"):
        with pytest.raises(ConfigError, match=f"cannot export as {architecture}: model.index_topk=null"):
            export_family(dense.model, dense.moe, architecture)


def test_fp8_weights_are_dequantized_as_read(tmp_path):
    """A folder stored as DeepSeek publishes its weights (fp8 e4m3 with block scales): every quantised weight, the
    indexer's head weights among them, imports as the reference dequantisation, bit for bit in bf16."""
    from safetensors import safe_open

    from tests.interop.test_hf_deepseek_v3 import quantize_folder

    make_sparse(tmp_path / "hf", "deepseek-v3.2")
    reference = quantize_folder(tmp_path / "hf")
    assert "model.layers.1.self_attn.indexer.weights_proj.weight" in reference
    import_folder(tmp_path / "hf", tmp_path / "ours.safetensors", load_config("moe-8x"), seq_len=SEQ)
    with safe_open(str(tmp_path / "ours.safetensors"), framework="pt") as handle:
        state = {name: handle.get_tensor(name) for name in handle.keys()}
    for ours, theirs in (("layers.1.attn.indexer.head_weights.weight", "indexer.weights_proj.weight"),
                         ("layers.1.attn.wkv_b.weight", "kv_b_proj.weight")):
        assert state[ours].dtype == torch.bfloat16
        assert torch.equal(state[ours], reference[f"model.layers.1.self_attn.{theirs}"]), ours
