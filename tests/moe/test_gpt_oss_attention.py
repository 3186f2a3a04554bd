"""GPT-OSS's attention (q/k/v/o biases, per-head sinks, sliding-window layers) against ``transformers``'
``GptOssAttention`` from tiny random configs (the oracle, used only here), and through the key-value cache.

Both sides get the same rotary tables (ours, from ``moe.rope``): RoPE is checked elsewhere, and GPT-OSS rotates
halves as we do. The oracle's mask is written here from the family's definition (a key is seen when it is not
after the query and, in a sliding layer, fewer than ``sliding_window`` positions before it).
"""

import pytest
import torch

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from moe.attention import GroupedQueryAttention
from moe.kv_cache import LayerCache
from moe.rope import rope_tables, yarn_attention_factor, yarn_inverse_frequencies
from moe.transformer import MoETransformer

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
from transformers import GptOssConfig  # noqa: E402

D, SEQ = 32, 12


def oracle_mask(seq: int, window: int | None) -> torch.Tensor:
    """[1, 1, S, S] additive mask, by loops: 0 where query i sees key j, the dtype's lowest value elsewhere."""
    mask = torch.full((1, 1, seq, seq), torch.finfo(torch.float32).min)
    for i in range(seq):
        for j in range(seq):
            if j <= i and (window is None or i - j < window):
                mask[0, 0, i, j] = 0.0
    return mask


def pair(n_heads: int, n_kv_heads: int, head_dim: int, window: int | None, seq: int = SEQ, seed: int = 0):
    """Their GptOssAttention (one layer of the given kind, every weight random) and ours with its weights."""
    torch.manual_seed(seed)
    config = GptOssConfig(hidden_size=D, num_attention_heads=n_heads, num_key_value_heads=n_kv_heads,
                          head_dim=head_dim, num_hidden_layers=1, sliding_window=window or 4,
                          layer_types=["sliding_attention" if window else "full_attention"], attention_bias=True)
    config._attn_implementation = "eager"
    theirs = gpt_oss.GptOssAttention(config, layer_idx=0).float().eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
        theirs.sinks.mul_(10)  # logits of a few units: sinks that take a real share of the softmax
    ours_config = ModelConfig(d_model=D, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, n_layers=1,
                              seq_len=seq, qkv_bias=True, attn_output_bias=True, attention_sinks=True,
                              sliding_window=window, layer_types=["sliding_attention" if window else "full_attention"])
    ours_config.validate()
    ours = GroupedQueryAttention(ours_config, ours_config.layer(0))
    names = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}
    with torch.no_grad():
        for mine, their in names.items():
            getattr(ours, mine).weight.copy_(getattr(theirs, their).weight)
            getattr(ours, mine).bias.copy_(getattr(theirs, their).bias)
        ours.sinks.copy_(theirs.sinks)
    return theirs, ours, ours_config


# heads, kv heads, head width, window, sequence: windows of 5 on 12 positions take the masked SDPA, 1 and 3 the
# blocked one (sequences at least 4 windows long), 4 on 23 the blocked one with the sequence padded to whole blocks
CASES = [(4, 2, 8, 5, SEQ), (4, 2, 8, None, SEQ), (2, 2, 16, 3, SEQ), (4, 1, 8, 1, SEQ), (4, 2, 8, 4, 23)]


@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim, window, seq", CASES)
def test_attention_matches_transformers_gpt_oss_attention(n_heads, n_kv_heads, head_dim, window, seq):
    """fp32 outputs within 1e-5, and the gradients of the input and of every weight, bias and sink, for sliding
    layers with windows shorter than the sequence (so the window matters) and a full layer."""
    theirs, ours, config = pair(n_heads, n_kv_heads, head_dim, window, seq)
    cos, sin = rope_tables(config)
    x = torch.randn(2, seq, D)
    grad_out = torch.randn(2, seq, D)

    x_theirs = x.clone().requires_grad_(True)
    expected, _ = theirs(x_theirs, (cos[None, :seq], sin[None, :seq]), oracle_mask(seq, window))
    (expected * grad_out).sum().backward()
    x_ours = x.clone().requires_grad_(True)
    got = ours(x_ours, cos, sin)
    (got * grad_out).sum().backward()

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-5, atol=1e-5)
    pairs = {"sinks": (ours.sinks, theirs.sinks)}
    for mine, their in {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj"}.items():
        pairs[f"{mine}.weight"] = (getattr(ours, mine).weight, getattr(theirs, their).weight)
        pairs[f"{mine}.bias"] = (getattr(ours, mine).bias, getattr(theirs, their).bias)
    for name, (mine, their) in pairs.items():  # sums over positions, in SDPA's fused-kernel order, not eager's:
        # 1e-5 relative, and 1e-6 of the largest entry (some reach 50) absolute, a few fp32 ulps of it
        torch.testing.assert_close(mine.grad, their.grad, rtol=1e-5, atol=1e-6 * float(their.grad.abs().max()),
                                   msg=name)


def test_sinks_and_window_change_the_output():
    """Neither option is a no-op on these shapes: without the sinks, or with full attention, the output differs."""
    theirs, ours, config = pair(4, 2, 8, 5)
    cos, sin = rope_tables(config)
    x = torch.randn(1, SEQ, D)
    with torch.no_grad():
        both = ours(x, cos, sin)
        ours.window = None
        no_window = ours(x, cos, sin)
        ours.window, sinks = 5, ours.sinks
        ours.sinks = None
        no_sinks = ours(x, cos, sin)
        ours.sinks = sinks
    assert (both - no_window).abs().max() > 1e-3 and (both - no_sinks).abs().max() > 1e-3


@pytest.mark.parametrize("window", [3, None])
def test_generation_through_the_cache_equals_the_whole_sequence(window):
    """A prefix, then one token, then several: each piece through the key-value cache gives the whole sequence's
    outputs at its positions (the window and the sinks applied to cached keys too)."""
    _, ours, config = pair(4, 2, 8, window)
    cos, sin = rope_tables(config)
    x = torch.randn(2, SEQ, D)
    with torch.no_grad():
        whole = ours(x, cos, sin)
        cache, pieces = LayerCache(), []
        for lo, hi in [(0, 5), (5, 6), (6, 10), (10, 12)]:
            pieces.append(ours(x[:, lo:hi], cos, sin, cache))
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-5)


def test_layer_types_give_each_block_its_window():
    config = ModelConfig(d_model=D, n_layers=4, n_heads=4, seq_len=SEQ, sliding_window=4, attention_sinks=True,
                         layer_types=["sliding_attention", "full_attention"] * 2)
    config.validate()
    model = MoETransformer(config, MoEConfig(expert_hidden=8))
    assert [block.attn.window for block in model.layers.values()] == [4, None, 4, None]
    assert all(block.attn.sinks.shape == (4,) for block in model.layers.values())


LATENT = dict(n_kv_heads=None, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)


@pytest.mark.parametrize("overrides, key", [
    (dict(sliding_window=SEQ + 1), "model.sliding_window=13"),
    (dict(sliding_window=0), "model.sliding_window=0"),
    (dict(sliding_window=4, layer_types=["sliding_attention"]), "model.layer_types has 1 entries"),
    (dict(sliding_window=4, layer_types=["sliding", "full_attention"]), "model.layer_types\\[0\\]='sliding'"),
    (dict(layer_types=["sliding_attention", "full_attention"]), "set model.sliding_window"),
    # latent attention's SDPA carries neither a sink nor a window: refused, not ignored
    (dict(LATENT, attention_sinks=True), "model.attention_sinks=true is not implemented for latent attention"),
    (dict(LATENT, sliding_window=4), "model.sliding_window=4 is not implemented for latent attention"),
    (dict(LATENT, attn_output_bias=True), "model.attn_output_bias=true is not implemented for latent attention"),
])
def test_bad_window_settings_are_config_errors(overrides, key):
    with pytest.raises(ConfigError, match=key):
        ModelConfig(d_model=D, n_layers=2, n_heads=4, seq_len=SEQ, **overrides).validate()


@pytest.mark.parametrize("window, seq", [(4, 23), (5, SEQ)])  # the blocked path and the masked one
def test_bf16_autocast_close_to_fp32(window, seq):
    """Under bf16 autocast the sink's logit rides on a bf16 query channel (s_h · sqrt(hd)): the output stays
    within bf16's rounding of the fp32 one, relative to its largest value (measured: 0.8-1.0% of it; dropping
    the sinks moves the output by 34% of it)."""
    _, ours, config = pair(4, 2, 8, window, seq)
    cos, sin = rope_tables(config)
    x = torch.randn(2, seq, D)
    with torch.no_grad():
        reference = ours(x, cos, sin)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = ours(x, cos, sin)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), reference, rtol=0, atol=3e-2 * float(reference.abs().max()))


def test_gpt_oss_yarn_frequencies_match_transformers():
    """GPT-OSS's YaRN (factor 32 over 4,096 positions, beta 32 and 1, theta 150,000, 64-wide heads) keeps the
    ramp's bounds fractional ("truncate": false): ours with ``yarn_truncate`` false gives transformers'
    frequencies and table scale; rounding the bounds (the default) would give others."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(rope_theta=150000.0, rope_scaling="yarn", rope_factor=32.0, rope_original_seq_len=4096,
                yarn_beta_fast=32.0, yarn_beta_slow=1.0)
    ours = ModelConfig(d_model=D, n_heads=4, head_dim=64, seq_len=SEQ, yarn_truncate=False, **rope)
    ours.validate()
    hf = GptOssConfig(hidden_size=D, num_attention_heads=4, head_dim=64, rope_parameters={
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 4096, "truncate": False})
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf)
    torch.testing.assert_close(yarn_inverse_frequencies(ours), inv_freq, rtol=1e-6, atol=0)
    assert yarn_attention_factor(ours) == pytest.approx(attention_factor, rel=1e-12)
    truncated = yarn_inverse_frequencies(ModelConfig(d_model=D, n_heads=4, head_dim=64, seq_len=SEQ, **rope))
    assert not torch.allclose(truncated, inv_freq, rtol=1e-3)
    with pytest.raises(ConfigError, match="model.yarn_truncate=false is a YaRN setting"):
        ModelConfig(d_model=D, n_heads=4, seq_len=SEQ, yarn_truncate=False).validate()
