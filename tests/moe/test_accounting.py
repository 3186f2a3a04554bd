"""Parameter counts from the config equal the built model's; published shapes come out at their published sizes."""

import pytest
import torch

from config.model import ModelConfig, MoEConfig
from config.run import load_config
from moe.accounting import (
    attention_flops_per_token,
    block_flops_per_token,
    head_flops_per_token,
    mtp_flops_per_token,
    parameter_counts,
    training_flops_per_token,
)
from moe.transformer import MoETransformer

SMALL = [
    (ModelConfig(d_model=32, n_layers=3, n_heads=4, seq_len=16, ffn_hidden=48), MoEConfig(expert_hidden=24)),
    (ModelConfig(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, seq_len=16, ffn_hidden=48, moe_every=2,
                 first_moe_layer=1, tie_embeddings=True),
     MoEConfig(num_experts=6, top_k=3, expert_hidden=16, num_shared_experts=2, activation="gelu")),
    (ModelConfig(d_model=32, n_layers=2, n_heads=2, seq_len=16, ffn_hidden=48, moe_every=0), MoEConfig()),
    # Qwen3-MoE's attention: per-head q/k norms, heads wider than d_model / n_heads
    (ModelConfig(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=12, qk_norm=True, seq_len=16,
                 ffn_hidden=48, first_moe_layer=1), MoEConfig(expert_hidden=24, renormalize=False)),
    # DeepSeek-V3's: latent attention with and without the query bottleneck, dense first layers, a shared expert
    (ModelConfig(d_model=32, n_layers=3, n_heads=4, kv_lora_rank=12, qk_nope_head_dim=6, qk_rope_head_dim=4,
                 v_head_dim=5, seq_len=16, ffn_hidden=48, first_moe_layer=1),
     MoEConfig(expert_hidden=24, num_shared_experts=1, score_func="sigmoid", n_group=4, topk_group=2)),
    # GLM-4.5's: q/k/v biases, half-rotary heads, q/k norms, grouped-query
    (ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, qkv_bias=True, rotary_dim=4, qk_norm=True,
                 seq_len=16, ffn_hidden=48, first_moe_layer=1),
     MoEConfig(expert_hidden=24, num_shared_experts=1, score_func="sigmoid")),
    (ModelConfig(d_model=32, n_layers=2, n_heads=3, q_lora_rank=10, kv_lora_rank=12, qk_nope_head_dim=6,
                 qk_rope_head_dim=4, v_head_dim=5, seq_len=16, ffn_hidden=48),
     MoEConfig(expert_hidden=24)),
    # GPT-OSS's MoE side: biased router and experts, clamped SwiGLU
    (ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16, ffn_hidden=48),
     MoEConfig(expert_hidden=24, activation="clamped_swiglu", router_bias=True, expert_proj_bias=True)),
    (ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16, ffn_hidden=48),
     MoEConfig(expert_hidden=24, activation="gelu", expert_proj_bias=True)),
    # GPT-OSS's attention: q/k/v/o biases, sinks, alternating sliding windows
    (ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, qkv_bias=True, attn_output_bias=True,
                 attention_sinks=True, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                 seq_len=16, ffn_hidden=48),
     MoEConfig(expert_hidden=24, activation="clamped_swiglu", router_bias=True, expert_proj_bias=True)),
    # Qwen3-Next's hybrid: Gated DeltaNet linear attention (more value heads than key heads) beside full attention
    (ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16, ffn_hidden=48,
                 layer_types=["linear_attention", "full_attention"], linear_key_heads=2, linear_value_heads=4,
                 linear_key_head_dim=6, linear_value_head_dim=5), MoEConfig(expert_hidden=24)),
    # and its gated attention and gated shared expert
    (ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, qk_norm=True, rotary_dim=4,
                 attn_output_gate=True, seq_len=16, ffn_hidden=48, layer_types=["linear_attention", "full_attention"],
                 linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=6, linear_value_head_dim=5),
     MoEConfig(expert_hidden=24, num_shared_experts=1, shared_expert_gate=True)),
    # MiniMax-M2's: one q norm over all heads' channels and one k norm, partial rotary, sigmoid routing
    (ModelConfig(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, qk_norm=True, qk_norm_type="per_layer",
                 rotary_dim=4, seq_len=16, ffn_hidden=48), MoEConfig(expert_hidden=24, score_func="sigmoid")),
]


@pytest.mark.parametrize("model_config, moe_config", SMALL)
def test_counts_match_the_built_model(model_config, moe_config):
    model = MoETransformer(model_config, moe_config)
    counts = parameter_counts(model_config, moe_config)
    assert counts.total == sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for layer in model.moe_layers().values() for p in layer.experts.parameters())
    assert counts.routed_experts == routed
    per_expert = routed // max(1, len(model.moe_layers()) * moe_config.num_experts)
    inactive = len(model.moe_layers()) * (moe_config.num_experts - moe_config.top_k) * per_expert
    assert counts.active == counts.total - inactive


def test_biases_start_at_zero():
    """q/k/v biases are initialised to zeros (``moe/init.py``): a new model starts as one without them."""
    model = MoETransformer(*SMALL[5])
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    assert len(biases) == 3 * 2 and all(torch.equal(b, torch.zeros_like(b)) for b in biases)


def test_router_and_expert_biases_start_at_zero():
    """The router's and the experts' biases (``moe.router_bias``, ``moe.expert_proj_bias``) start at zero
    (``moe/init.py``): a new model routes and computes as one without them."""
    model = MoETransformer(ModelConfig(d_model=32, n_layers=2, n_heads=4, seq_len=16, ffn_hidden=48),
                           MoEConfig(expert_hidden=24, activation="clamped_swiglu", router_bias=True,
                                     expert_proj_bias=True))
    biases = [p for name, p in model.named_parameters() if name.endswith("bias")]
    assert len(biases) == 2 * 4 and all(torch.equal(b, torch.zeros_like(b)) for b in biases)


def test_mixtral_shape_has_its_published_size():
    config = load_config("mixtral-8x7b")
    counts = parameter_counts(config.model, config.moe)
    assert counts.total / 1e9 == pytest.approx(46.7, abs=0.1)  # "47B total" (Jiang et al. 2024)
    assert counts.active / 1e9 == pytest.approx(12.9, abs=0.1)  # "13B active"


def test_flops_per_token_hand_formula():
    model_config, moe_config = SMALL[0]
    counts = parameter_counts(model_config, moe_config)
    expected = 6 * (counts.active - 256 * 32) + 12 * 3 * 32 * 16
    assert training_flops_per_token(model_config, moe_config) == expected


def test_flops_of_wide_heads_count_their_width():
    """Attention costs 12 · L · (n_heads · hd) · S, with hd = head_dim here, not d_model / n_heads."""
    model_config, moe_config = SMALL[3]
    counts = parameter_counts(model_config, moe_config)
    expected = 6 * (counts.active - 256 * 32) + 12 * 3 * (4 * 12) * 16
    assert training_flops_per_token(model_config, moe_config) == expected


def test_flops_of_latent_attention_count_its_widths():
    """Scores over n + r channels, values v wide: 6 · S · nh · (n + r + v) per layer."""
    model_config, moe_config = SMALL[6]
    counts = parameter_counts(model_config, moe_config)
    expected = 6 * (counts.active - 256 * 32) + 2 * 6 * 16 * 3 * (6 + 4 + 5)
    assert training_flops_per_token(model_config, moe_config) == expected


def test_qwen3_30b_a3b_shape_has_its_published_size():
    """Its model card: 30.5B total, 29.9B without the embedding and head, 3.3B activated."""
    config = load_config("qwen3-30b-a3b")
    counts = parameter_counts(config.model, config.moe)
    assert counts.total / 1e9 == pytest.approx(30.5, abs=0.05)
    assert (counts.total - 2 * counts.embedding) / 1e9 == pytest.approx(29.9, abs=0.05)
    assert counts.active / 1e9 == pytest.approx(3.3, rel=0.02)  # 3.35B


def test_a_dense_model_has_no_inactive_parameters():
    model_config, moe_config = SMALL[2]
    counts = parameter_counts(model_config, moe_config)
    assert counts.active == counts.total and counts.routed_experts == 0
    assert not MoETransformer(model_config, moe_config).moe_layers()


@pytest.mark.parametrize("model_config, moe_config", SMALL)
def test_block_and_head_flops_add_up_to_the_model(model_config, moe_config):
    blocks = sum(block_flops_per_token(model_config, moe_config, model_config.layer(i))
                 for i in range(model_config.n_layers))
    total = blocks + head_flops_per_token(model_config)
    assert total == pytest.approx(training_flops_per_token(model_config, moe_config), rel=1e-12)
    if model_config.n_moe_layers and model_config.n_moe_layers < model_config.n_layers:
        kinds = {layer.is_moe: layer for layer in model_config.layer_pattern}
        assert block_flops_per_token(model_config, moe_config, kinds[True]) != block_flops_per_token(
            model_config, moe_config, kinds[False])


@pytest.mark.parametrize("name, total, active", [("deepseek-v3", 671e9, 37e9), ("kimi-k2", 1e12, 32e9)])
def test_deepseek_v3_family_has_its_published_size(name, total, active):
    """DeepSeek-V3 ("671B total, 37B activated", without its multi-token-prediction module) and Kimi K2 ("1T total,
    32B activated"): published figures are rounded, to the billion for DeepSeek-V3 and for the activated ones
    (which count without the embedding lookup), to the trillion for K2's total; ours round to them."""
    config = load_config(name)
    counts = parameter_counts(config.model, config.moe)
    digits = 9 if total < 1e12 else 12
    assert round(counts.total / 10**digits) * 10**digits == total
    assert round((counts.active - counts.embedding) / 1e9) * 1e9 == active


def test_glm_4_5_is_within_one_percent_of_its_published_size():
    """GLM-4.5: "355B total, 32B active". Ours, without its multi-token-prediction layer: 352.8B (0.6% under;
    with a layer of its MoE block's size and the projection, 356.8B) and 32.9B active besides the embedding."""
    config = load_config("glm-4.5")
    counts = parameter_counts(config.model, config.moe)
    assert counts.total == pytest.approx(355e9, rel=0.01)
    assert counts.active - counts.embedding == pytest.approx(32e9, rel=0.03)


def test_minimax_m2_has_its_published_size():
    """MiniMax-M2: "230 billion total parameters with 10 billion active" (its model card). Ours, without its
    multi-token-prediction modules: 228.69B (0.6% under) and 10.42B active besides the embedding, which round to
    the card's figures."""
    config = load_config("minimax-m2")
    counts = parameter_counts(config.model, config.moe)
    assert counts.total == pytest.approx(230e9, rel=0.01)
    assert round((counts.active - counts.embedding) / 1e9) * 1e9 == 10e9


@pytest.mark.parametrize("name, total, active", [("gpt-oss-20b", 20.9e9, 3.6e9), ("gpt-oss-120b", 116.8e9, 5.1e9)])
def test_gpt_oss_has_its_published_size(name, total, active):
    """gpt-oss-20b "20.9B total, 3.6B active" and gpt-oss-120b "116.8B total, 5.1B active" (OpenAI's model card;
    active without the embedding lookup, as for DeepSeek-V3): ours are 20.91B / 3.61B and 116.83B / 5.13B, so the
    totals within 0.5% and the active counts round to the published tenth of a billion (5.13B is 0.6% over 5.1B)."""
    config = load_config(name)
    counts = parameter_counts(config.model, config.moe)
    assert counts.total == pytest.approx(total, rel=0.005)
    assert round((counts.active - counts.embedding) / 1e8) * 1e8 == active


@pytest.mark.parametrize("overrides", [["model.mtp_depth=1"], ["model.mtp_depth=2", "model.moe_every=2"]])
def test_mtp_flops_are_what_the_modules_add_to_the_model(overrides):
    """The modules' FLOPs (which the last pipeline stage's split and the planner add beside the head) are what they
    add to the whole model's training FLOPs, whose parameters the accounting counts from built models; with
    ``moe_every=2`` one module is dense and one MoE."""
    with_mtp = load_config("moe-8x", overrides)
    without = load_config("moe-8x", [o for o in overrides if not o.startswith("model.mtp_depth")])
    added = (training_flops_per_token(with_mtp.model, with_mtp.moe)
             - training_flops_per_token(without.model, without.moe))
    assert mtp_flops_per_token(with_mtp.model, with_mtp.moe) == pytest.approx(added, rel=1e-12)
    assert mtp_flops_per_token(without.model, without.moe) == 0


V4_RESIDUAL = ["model.hc_mult=4", "model.mlp_layer_types=[hash_moe, moe]", "moe.score_func=sqrtsoftplus",
               "moe.activation=limited_swiglu", "moe.num_shared_experts=1"]


def test_hyper_connections_flops_by_hand():
    """With 4 hyper-connected streams (D = 192, 2 layers, one MTP module), beyond 6 per active weight (their
    projections among them) and attention's scores: per branch the collapse sum_j pre_j x_j (n · D multiply-adds)
    and the merge's comb^T x (n² · D) and post_k f (n · D), two branches a block; per final collapse (the model's
    and the module's) n · D; each multiply-add 2 FLOPs, forward and backward 3 times that."""
    config = load_config("moe-8x", [*V4_RESIDUAL, "model.n_layers=2", "model.mtp_depth=1"])
    model, moe = config.model, config.moe
    n, d, blocks = 4, model.d_model, 3
    counts = parameter_counts(model, moe)
    weights = counts.active - counts.embedding + model.vocab_size * d  # the shared head once more, for the module
    attention = sum(attention_flops_per_token(model, layer) for layer in model.layer_pattern)
    branch = 2 * (n * d + n * n * d + n * d)
    expected = 6 * weights + attention + 3 * (blocks * 2 * branch + 2 * 2 * n * d)
    assert d == 192 and len(model.layer_pattern) == blocks
    assert training_flops_per_token(model, moe) == expected
    # the pieces the pipeline split and the step-time model sum: blocks, head (with the collapse), MTP
    pieces = (sum(block_flops_per_token(model, moe, model.layer(i)) for i in range(model.n_layers))
              + head_flops_per_token(model) + mtp_flops_per_token(model, moe))
    assert pieces == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name, family, total, active", [
    ("deepseek-v3.2", "hf_deepseek_v32", 671_877_929_216, 37_477_128_448),
    ("glm-5", "hf_glm_moe_dsa", 743_911_199_232, 40_833_126_912)])
def test_sparse_attention_families_count_what_transformers_builds_of_the_published_config(name, family, total,
                                                                                          active):
    """DeepSeek-V3.2 and GLM-5: our config's shape is the published config.json's (transformers' defaults for both
    are the published checkpoints'), and our count equals the parameters transformers builds of it (on the meta
    device; without the multi-token-prediction layer, which it does not build either). Published: DeepSeek-V3.2
    685B with its MTP module as DeepSeek-V3; GLM-5 "744B total, 40B active"."""
    import importlib

    transformers = pytest.importorskip("transformers")
    config = load_config(name)
    mapping = importlib.import_module(f"interop.{family}")
    ours = mapping.hf_from_config(config.model, config.moe)
    published = getattr(transformers, mapping.ARCHITECTURE.replace("ForCausalLM", "Config"))()
    for key in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
                "first_k_dense_replace", "index_topk", "index_n_heads", "index_head_dim", "routed_scaling_factor",
                "norm_topk_prob", "tie_word_embeddings", "rms_norm_eps"):
        assert ours[key] == getattr(published, key), key
    with torch.device("meta"):
        built = getattr(transformers, mapping.ARCHITECTURE)(published)
    counts = parameter_counts(config.model, config.moe)
    assert counts.total == sum(param.numel() for param in built.parameters()) == total
    assert counts.active - counts.embedding == active


@pytest.mark.parametrize("name, total, active", [("qwen3-next-80b-a3b", 80, 3), ("qwen3.5-35b-a3b", 35, 3),
                                                 ("qwen3.5-397b-a17b", 397, 17)])
def test_qwen3_next_family_has_its_published_size(name, total, active):
    """The published names round their counts: the text model's total lies in the billion below the name's (the
    Qwen3.5 totals also count a vision tower we leave out), its active parameters (embedding and head included)
    in the billion above the name's A-figure (79.7B / 3.9B, 34.7B / 3.5B, 396.3B / 17.3B)."""
    config = load_config(name)
    counts = parameter_counts(config.model, config.moe)
    assert total - 1 < counts.total / 1e9 <= total
    assert active <= counts.active / 1e9 < active + 1


def test_qwen3_5_122b_counts_its_checkpoint_and_what_transformers_builds():
    """Qwen3.5-122B-A10B: transformers builds the config.json we export of it (the text model, on the meta device)
    to our count, which is the checkpoint's own text-model count, 122,111,526,912 (llama.cpp's n_params of its GGUF,
    and a safetensors-header count in github.com/HectorHHZ/Less-is-MoE). Its name rounds to the nearest billion
    (122.11B total, 9.77B active with embedding and head, A10B), so the 397B's one-sided ranges do not fit it."""
    from interop import hf_qwen3_5_moe

    transformers = pytest.importorskip("transformers")
    config = load_config("qwen3.5-122b-a10b")
    counts = parameter_counts(config.model, config.moe)
    exported = hf_qwen3_5_moe.hf_from_config(config.model, config.moe)
    text_keys = {key: value for key, value in exported.items() if key not in ("architectures", "model_type")}
    with torch.device("meta"):
        built = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text_keys))
    assert counts.total == sum(param.numel() for param in built.parameters()) == 122_111_526_912
    assert (round(counts.total / 1e9), round(counts.active / 1e9)) == (122, 10)


@pytest.mark.parametrize("name, architecture, config_class", [
    ("qwen3-next-80b-a3b", "Qwen3NextForCausalLM", "Qwen3NextConfig"),
    ("qwen3.5-35b-a3b", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig")])
def test_qwen3_next_family_counts_what_transformers_builds_of_the_published_config(name, architecture, config_class):
    """transformers' default configs for these two are the published checkpoints' (its docstrings name
    Qwen3-Next-80B-A3B and Qwen3.5-35B-A3B): our count equals the parameters it builds of them on the meta device,
    to the parameter (79,674,391,296 and 34,660,610,688; the text model only)."""
    transformers = pytest.importorskip("transformers")
    config = load_config(name)
    with torch.device("meta"):
        built = getattr(transformers, architecture)(getattr(transformers, config_class)())
    assert parameter_counts(config.model, config.moe).total == sum(param.numel() for param in built.parameters())
