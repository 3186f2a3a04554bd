"""Latent attention and YaRN against the oracle: ``transformers``' DeepseekV3Attention and its rope functions,
built from tiny configs with our weights copied in (DeepSeek's interleaved rotary layout off: that layout is a
permutation of weight rows, which the Hugging Face import applies)."""

import math

import pytest
import torch

from config.errors import ConfigError
from config.model import ModelConfig
from moe.attention.latent import LatentAttention
from moe.rope import rope_tables, yarn_attention_factor, yarn_inverse_frequencies

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek  # noqa: E402

MLA = dict(d_model=32, n_heads=4, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
           seq_len=16, rope_theta=500.0)
YARN = dict(rope_scaling="yarn", rope_factor=40.0, rope_original_seq_len=8, yarn_mscale=1.0,
            yarn_mscale_all_dim=1.0)


def hf_config(model: ModelConfig):
    """The DeepseekV3Config of the same attention (rope parameters in transformers 5's form)."""
    rope = {"rope_type": "default", "rope_theta": model.rope_theta}
    if model.rope_scaling == "yarn":
        rope |= {"rope_type": "yarn", "factor": model.rope_factor, "beta_fast": model.yarn_beta_fast,
                 "beta_slow": model.yarn_beta_slow, "original_max_position_embeddings": model.rope_original_seq_len}
        rope |= {key: value for key, value in (("mscale", model.yarn_mscale),
                                               ("mscale_all_dim", model.yarn_mscale_all_dim),
                                               ("attention_factor", model.yarn_attention_factor)) if value is not None}
    return transformers.DeepseekV3Config(
        hidden_size=model.d_model, num_attention_heads=model.n_heads, num_key_value_heads=model.n_heads,
        q_lora_rank=model.q_lora_rank, kv_lora_rank=model.kv_lora_rank, qk_nope_head_dim=model.qk_nope_head_dim,
        qk_rope_head_dim=model.qk_rope_head_dim, v_head_dim=model.v_head_dim, head_dim=model.qk_rope_head_dim,
        max_position_embeddings=model.seq_len * 8, rope_parameters=rope, rope_interleave=False,
        attention_bias=False, vocab_size=16, num_hidden_layers=1)


@pytest.mark.parametrize("settings", [
    dict(rope_factor=40.0, rope_original_seq_len=4096, yarn_mscale=1.0, yarn_mscale_all_dim=1.0),  # DeepSeek-V3
    dict(rope_factor=32.0, rope_original_seq_len=4096, yarn_beta_fast=16.0),  # the paper's mscale on the tables
    dict(rope_factor=4.0, rope_original_seq_len=64, yarn_mscale=0.707, yarn_mscale_all_dim=1.0),
    dict(rope_factor=8.0, rope_original_seq_len=128, yarn_attention_factor=1.3, yarn_beta_slow=2.0),
], ids=["deepseek-v3", "paper", "mscale-ratio", "given-factor"])
def test_yarn_tables_match_transformers(settings):
    model = ModelConfig(**{**MLA, "qk_rope_head_dim": 64, "seq_len": 300, "rope_theta": 10000.0,
                           "rope_scaling": "yarn", **settings})
    model.validate()
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_config(model))
    torch.testing.assert_close(yarn_inverse_frequencies(model), inv_freq, rtol=1e-6, atol=0)
    assert yarn_attention_factor(model) == pytest.approx(attention_factor, rel=1e-12)
    # the tables: an fp32 angle of ~300 radians is known to ~3e-5, so the rounding of either side shows there
    angles = torch.outer(torch.arange(model.seq_len, dtype=torch.float32), inv_freq)
    cos, sin = rope_tables(model)
    torch.testing.assert_close(cos, angles.cos() * attention_factor, rtol=0, atol=1e-4)
    torch.testing.assert_close(sin, angles.sin() * attention_factor, rtol=0, atol=1e-4)
    # and it differs from plain RoPE (so the comparison above could fail)
    plain = rope_tables(ModelConfig(**{**MLA, "qk_rope_head_dim": 64, "seq_len": 300, "rope_theta": 10000.0}))
    assert (cos - plain[0]).abs().max() > 0.1


@pytest.mark.parametrize("settings", [{}, dict(q_lora_rank=10), dict(q_lora_rank=10, **YARN)],
                         ids=["full-query", "query-lora", "query-lora-yarn"])
def test_latent_attention_matches_transformers(settings):
    torch.manual_seed(0)
    model = ModelConfig(**MLA, **settings)
    model.validate()
    ours = LatentAttention(model, model.layer(0))
    for name, param in ours.named_parameters():
        with torch.no_grad():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else torch.randn_like(param) * 0.3)
    config = hf_config(model)
    config._attn_implementation = "eager"
    theirs = hf_deepseek.DeepseekV3Attention(config, layer_idx=0).eval()
    names = {"wkv_a": "kv_a_proj_with_mqa", "kv_latent_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj",
             "wo": "o_proj", "wq": "q_proj", "wq_a": "q_a_proj", "q_latent_norm": "q_a_layernorm", "wq_b": "q_b_proj"}
    theirs.load_state_dict({names[key.split(".")[0]] + "." + key.split(".", 1)[1]: value
                            for key, value in ours.state_dict().items()})
    rotary = hf_deepseek.DeepseekV3RotaryEmbedding(config)
    x = torch.randn(2, model.seq_len, model.d_model)
    positions = torch.arange(model.seq_len)[None].expand(2, -1)
    mask = torch.full((model.seq_len, model.seq_len), float("-inf")).triu(1)[None, None]
    expected, _ = theirs(x, rotary(x, positions), mask)
    cos, sin = rope_tables(model)
    torch.testing.assert_close(ours(x, cos, sin), expected, rtol=0, atol=1e-5)
    if model.rope_scaling == "yarn":  # the softmax scale carries YaRN's mscale squared
        assert ours.softmax_scale == pytest.approx((0.1 * math.log(40.0) + 1) ** 2 / math.sqrt(10))


@pytest.mark.parametrize("settings, message", [
    (dict(MLA, v_head_dim=None), r"model.v_head_dim=None: latent attention \(model.kv_lora_rank set\) needs"),
    (dict(MLA, qk_rope_head_dim=3), r"model.qk_rope_head_dim=3 must be even"),
    (dict(MLA, n_kv_heads=2), r"model.n_kv_heads=2 does not apply to latent attention"),
    (dict(q_lora_rank=8), r"model.q_lora_rank is a latent-attention setting: it needs model.kv_lora_rank"),
    (dict(rope_factor=4.0), r"model.rope_factor=4.0 needs model.rope_scaling: yarn"),
    (dict(rope_scaling="yarn", rope_factor=4.0), r"model.rope_original_seq_len=None: YaRN needs"),
    (dict(yarn_mscale=1.0), r"model.yarn_mscale is a YaRN setting"),
])
def test_impossible_attention_settings_are_refused_by_name(settings, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**settings).validate()


@pytest.mark.parametrize("settings", [dict(rotary_dim=4, qkv_bias=True, qk_norm=True), dict(rotary_dim=8),
                                      dict(qkv_bias=True, n_kv_heads=2, rotary_dim=6)],
                         ids=["half-rotary-bias-qk-norm", "full-rotary", "gqa-bias-three-quarters"])
def test_partial_rotary_and_biases_match_transformers_glm(settings):
    """GLM-4.5's attention: RoPE on the first rotary_dim channels of each head, biases on q/k/v, q/k norms."""
    from transformers.models.glm4_moe import modeling_glm4_moe as hf_glm

    from moe.attention import GroupedQueryAttention

    torch.manual_seed(0)
    model = ModelConfig(d_model=32, n_heads=4, seq_len=16, rope_theta=500.0, **settings)
    model.validate()
    ours = GroupedQueryAttention(model, model.layer(0))
    for name, param in ours.named_parameters():
        with torch.no_grad():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else torch.randn_like(param) * 0.3)
    config = transformers.Glm4MoeConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=model.kv_heads, head_dim=8,
        attention_bias=model.qkv_bias, use_qk_norm=model.qk_norm, rms_norm_eps=model.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": model.rope_dim / 8},
        max_position_embeddings=64, vocab_size=16, num_hidden_layers=1)
    config._attn_implementation = "eager"
    theirs = hf_glm.Glm4MoeAttention(config, layer_idx=0).eval()
    names = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj", "q_norm": "q_norm", "k_norm": "k_norm"}
    theirs.load_state_dict({names[key.split(".")[0]] + "." + key.split(".", 1)[1]: value
                            for key, value in ours.state_dict().items()})
    x = torch.randn(2, model.seq_len, model.d_model)
    positions = torch.arange(model.seq_len)[None].expand(2, -1)
    mask = torch.full((model.seq_len, model.seq_len), float("-inf")).triu(1)[None, None]
    expected, _ = theirs(x, hf_glm.Glm4MoeRotaryEmbedding(config)(x, positions), mask)
    cos, sin = rope_tables(model)
    torch.testing.assert_close(ours(x, cos, sin), expected, rtol=0, atol=1e-5)
