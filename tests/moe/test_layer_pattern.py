"""The layer pattern: each layer's attention kind, window and feed-forward kind, given outright
(``model.mlp_layer_types``) or by the shorthands; the model's blocks, its parameter counts and the exports follow it."""

import pytest
import torch

from config.errors import ConfigError
from config.model import LayerSpec, ModelConfig, MoEConfig
from interop.hf_deepseek_v3 import sigmoid_moe_refusals
from interop.hf_mixtral import hf_from_config as mixtral_config
from moe.accounting import parameter_counts, training_flops_per_token
from moe.attention import GroupedQueryAttention, LatentAttention
from moe.feed_forward import FeedForward
from moe.layer import MoELayer
from moe.transformer import MoETransformer

SHAPE = dict(d_model=32, n_heads=4, seq_len=16, ffn_hidden=48)


def test_the_shorthands_expand_into_the_pattern():
    model = ModelConfig(n_layers=5, moe_every=2, first_moe_layer=1, sliding_window=4, mtp_depth=1,
                        layer_types=["sliding_attention", "full_attention"] * 2 + ["sliding_attention"], **SHAPE)
    model.validate()
    assert [layer.feed_forward for layer in model.layer_pattern] == ["dense", "moe", "dense", "moe", "dense", "moe"]
    assert [layer.window for layer in model.layer_pattern] == [4, None, 4, None, 4, None]  # MTP's block: full
    assert {layer.attention for layer in model.layer_pattern} == {"grouped_query"}


def test_an_explicit_pattern_builds_its_blocks_and_counts_them():
    """Layers 0 and 3 MoE, 1 and 2 dense: the blocks, the parameter counts and the FLOPs follow the words, and an
    MTP module's block takes the last layer's kind."""
    model = ModelConfig(n_layers=4, mlp_layer_types=["moe", "dense", "dense", "moe"], mtp_depth=1, **SHAPE)
    model.validate()
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=24)
    built = MoETransformer(model, moe)
    kinds = [type(block.feed_forward) for block in built.blocks()]
    assert kinds == [MoELayer, FeedForward, FeedForward, MoELayer, MoELayer]
    assert sorted(built.moe_layers()) == [0, 3, 4] and model.n_moe_layers == 2
    counts = parameter_counts(model, moe)
    assert counts.total == sum(p.numel() for p in built.parameters())
    routed = sum(p.numel() for layer in built.moe_layers().values() for p in layer.experts.parameters())
    assert counts.routed_experts == routed and counts.active == counts.total - routed // 2
    logits = built(torch.randint(0, model.vocab_size, (2, model.seq_len)))
    assert logits.shape == (2, model.seq_len, model.vocab_size)
    assert training_flops_per_token(model, moe) > 6 * (counts.active - counts.embedding)


def test_latent_attention_is_the_pattern_s_attention_kind():
    model = ModelConfig(n_layers=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, **SHAPE)
    model.validate()
    assert model.layer(0) == LayerSpec("latent", "moe")
    built = MoETransformer(model, MoEConfig(expert_hidden=8))
    assert all(isinstance(block.attn, LatentAttention) for block in built.blocks())
    plain = MoETransformer(ModelConfig(n_layers=1, **SHAPE), MoEConfig(expert_hidden=8))
    assert isinstance(plain.layers["0"].attn, GroupedQueryAttention)


@pytest.mark.parametrize("overrides, message", [
    (dict(mlp_layer_types=["moe"]), r"model.mlp_layer_types has 1 entries; it needs one per layer"),
    (dict(mlp_layer_types=["moe", "sparse"]), r"model.mlp_layer_types\[1\]='sparse' is not a feed-forward kind"),
    (dict(mlp_layer_types=["moe", "dense"], moe_every=2), r"model.moe_every=2 and model.first_moe_layer=0 are its "
                                                          r"shorthand: set one or the other"),
])
def test_a_bad_pattern_is_a_config_error(overrides, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(n_layers=2, **SHAPE, **overrides).validate()


def test_exports_refuse_a_pattern_their_family_cannot_name():
    """Mixtral has every layer MoE, DeepSeek-V3 dense layers first and MoE from first_k_dense_replace on: a pattern
    outside that would be exported as another model, so it is refused by name."""
    moe = MoEConfig(num_experts=4, top_k=2, expert_hidden=24)
    with pytest.raises(ConfigError, match="every layer must be MoE"):
        mixtral_config(ModelConfig(n_layers=2, mlp_layer_types=["dense", "moe"], **SHAPE), moe)
    interleaved = ModelConfig(n_layers=3, mlp_layer_types=["dense", "moe", "dense"], **SHAPE)
    assert any("from first_k_dense_replace on" in why for refused, why in sigmoid_moe_refusals(interleaved, moe,
                                                                                              "DeepSeek-V3") if refused)
    dense_first = ModelConfig(n_layers=3, mlp_layer_types=["dense", "moe", "moe"], **SHAPE)
    assert not any(refused and "first_k_dense_replace" in why
                   for refused, why in sigmoid_moe_refusals(dense_first, moe, "DeepSeek-V3"))
