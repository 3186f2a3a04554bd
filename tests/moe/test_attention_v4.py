"""DeepSeek-V4's attention kinds (``moe/attention/shared_kv.py``, ``compressed.py``) against ``transformers``'
``DeepseekV4Attention`` with the same weights (copied by ``hf_attention_name``): forward, the input's and every
parameter's gradient, fp32 to 1e-5, for each of the three layer types. Odd shapes (6 heads in 3 output groups, a
rotary slice narrower than the head, YaRN on the compressed RoPE); the sequence holds several compressed entries
of each kind, and more CSA entries than the indexer keeps, so the top-k selection binds."""

import pytest
import torch

from config.compressed_attention import CompressedAttentionConfig
from config.errors import ConfigError
from config.model import ModelConfig
from config.run import load_config
from moe.attention import CompressedSparseAttention, attention_kind, build_attention
from moe.attention.compressed import hf_attention_name
from moe.attention.compressor import visible_entries
from moe.attention.trailing_rope import rotate_trailing
from moe.kv_cache import LayerCache
from moe.rope import rope_tables
from parallel.resolve import resolve_layout

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_v4  # noqa: E402

LAYER_TYPES = ["sliding_attention", "heavily_compressed_attention", "compressed_sparse_attention"]
SEQ, WINDOW, CSA_RATE, HCA_RATE, TOPK = 48, 6, 4, 8, 5
SECTION = dict(csa_rate=CSA_RATE, hca_rate=HCA_RATE, o_groups=3, o_lora_rank=10, rope_theta=3000.0,
               rope_scaling="yarn", rope_factor=4.0, rope_original_seq_len=12)
MODEL = dict(d_model=24, n_layers=3, n_heads=6, head_dim=16, rotary_dim=8, q_lora_rank=12, sliding_window=WINDOW,
             layer_types=LAYER_TYPES, seq_len=SEQ, rope_theta=500.0, norm_eps=1e-6, index_topk=TOPK,
             index_n_heads=5, index_head_dim=12)


def v4_model(**settings) -> ModelConfig:
    section = CompressedAttentionConfig(**{**SECTION, **settings.pop("section", {})})
    model = ModelConfig(**{**MODEL, **settings}, compressed_attention=section)
    model.validate()
    return model


def hf_config(model: ModelConfig):
    section = model.compressed_attention
    config = hf_v4.DeepseekV4Config(
        vocab_size=32, hidden_size=model.d_model, num_hidden_layers=model.n_layers, num_attention_heads=model.n_heads,
        num_key_value_heads=1, head_dim=model.head_dim, q_lora_rank=model.q_lora_rank,
        partial_rotary_factor=model.rotary_dim / model.head_dim, layer_types=model.layer_types,
        compress_rates={"compressed_sparse_attention": section.csa_rate,
                        "heavily_compressed_attention": section.hca_rate},
        sliding_window=model.sliding_window, o_groups=section.o_groups, o_lora_rank=section.o_lora_rank,
        index_n_heads=model.index_n_heads, index_head_dim=model.index_head_dim, index_topk=model.index_topk,
        rope_theta=model.rope_theta, compress_rope_theta=section.rope_theta, rms_norm_eps=model.norm_eps,
        max_position_embeddings=model.seq_len,
        rope_parameters={"rope_type": "yarn", "factor": section.rope_factor,
                         "original_max_position_embeddings": section.rope_original_seq_len,
                         "beta_fast": section.yarn_beta_fast, "beta_slow": section.yarn_beta_slow})
    config._attn_implementation = "eager"
    return config


def attention_pair(model: ModelConfig, index: int, seed: int = 0):
    """Ours for layer ``index`` with random weights (norm weights near 1, the position biases and sinks too), and
    transformers' with the same ones copied in by name."""
    torch.manual_seed(seed)
    ours = build_attention(model, model.layer(index))
    for name, param in ours.named_parameters():
        with torch.no_grad():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm.weight" in name else torch.randn_like(param) * 0.3)
    theirs = hf_v4.DeepseekV4Attention(hf_config(model), index)
    state = {hf_attention_name(name): value for name, value in ours.state_dict().items()}
    assert set(state) == set(theirs.state_dict())  # every weight of theirs has one of ours, and no more
    theirs.load_state_dict(state)
    return ours, theirs


def hf_forward(theirs, model: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    batch, seq, _ = x.shape
    positions = torch.arange(seq).expand(batch, seq)
    rotary = hf_v4.DeepseekV4RotaryEmbedding(theirs.config)
    tables = {kind: rotary(x, positions, layer_type=kind) for kind in ("main", "compress")}
    distance = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
    mask = torch.zeros(seq, seq).masked_fill((distance < 0) | (distance >= model.sliding_window), float("-inf"))
    return theirs(x, tables, positions, mask.expand(batch, 1, seq, seq))[0]


def assert_same_forward_and_gradients(ours, theirs, model: ModelConfig, batch: int = 2):
    torch.manual_seed(1)
    x = torch.randn(batch, model.seq_len, model.d_model)
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    cos, sin = rope_tables(model)
    out = ours(x_ours, cos, sin)
    expected = hf_forward(theirs, model, x_theirs)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, atol=1e-5, rtol=1e-5)
    their_params = dict(theirs.named_parameters())
    for name, param in ours.named_parameters():
        their_grad = their_params[hf_attention_name(name)].grad
        if their_grad is None and name.startswith("indexer."):  # theirs untrained; ours by its own loss alone
            assert ours.training == (param.grad is not None), name  # (which reaches nothing else: compared here)
        elif their_grad is None:  # no entry made yet
            assert param.grad is None or not param.grad.any(), name
        else:
            torch.testing.assert_close(param.grad, their_grad, atol=1e-5, rtol=1e-5, msg=name)
    return x


@pytest.mark.parametrize("index", [0, 1, 2], ids=LAYER_TYPES)
def test_each_layer_type_matches_transformers(index):
    model = v4_model()
    ours, theirs = attention_pair(model, index)
    x = assert_same_forward_and_gradients(ours, theirs, model)
    if isinstance(ours, CompressedSparseAttention):
        assert_selection_binds_and_is_unambiguous(ours, model, x)


def assert_selection_binds_and_is_unambiguous(ours: CompressedSparseAttention, model: ModelConfig, x: torch.Tensor):
    """The test means something only where the top k bind (some query sees more entries than k) and no two
    entries tie at the k-th place (a tie could pick either, in either implementation)."""
    indexer, seq = ours.indexer, model.seq_len
    cos, sin = ours.compressed_tables(x.device)
    with torch.no_grad():
        latent = ours.q_a_norm(ours.q_a_proj(x))
        keys = indexer.compressor(x, cos, sin)
        q = indexer.wq(latent).view(*x.shape[:2], indexer.heads, indexer.head_dim)
        scores = indexer.weigh(x, rotate_trailing(q, cos[:seq, None], sin[:seq, None]), keys)
    visible = visible_entries(torch.arange(seq), keys.shape[1], CSA_RATE)
    binding = visible.sum(-1) > TOPK
    assert binding.sum() >= 8 and keys.shape[1] >= 2 * TOPK
    ranked = scores.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True).values[:, binding]
    assert (ranked[..., TOPK - 1] - ranked[..., TOPK]).min() > 1e-6 * ranked[..., 0].abs().max()


def test_sequence_shorter_than_a_window_of_entries():
    """No compressed entry yet (S < rate): the compressed layers attend to the window alone, as transformers'."""
    model = v4_model(seq_len=7, sliding_window=5)
    for index in (1, 2):
        ours, theirs = attention_pair(model, index)
        assert_same_forward_and_gradients(ours, theirs, model, batch=1)


def test_one_group_and_power_of_two_heads():
    model = v4_model(n_heads=4, section={"o_groups": 1})
    ours, theirs = attention_pair(model, 2, seed=3)
    assert_same_forward_and_gradients(ours, theirs, model, batch=1)


@pytest.mark.parametrize("settings, message", [
    ({"section": {"o_groups": 4}}, "must divide model.n_heads=6"),
    ({"index_topk": None}, "index_topk=None"),
    ({"n_kv_heads": 2}, "one key/value head"),
    ({"q_lora_rank": None}, "model.q_lora_rank"),
    ({"index_head_dim": 6}, "must hold the rotary channels"),
    ({"section": {"rope_original_seq_len": None}}, "rope_original_seq_len"),
    ({"layer_types": ["full_attention"] * 3}, "is not a layer of DeepSeek-V4's attention"),
])
def test_config_refuses(settings, message):
    with pytest.raises(ConfigError, match=message):
        v4_model(**settings)


def test_compressed_layer_types_need_the_section():
    model = ModelConfig(**{**MODEL, "index_topk": None, "index_n_heads": None, "index_head_dim": None,
                           "q_lora_rank": None})
    with pytest.raises(ConfigError, match="set model.compressed_attention"):
        model.validate()


@pytest.mark.parametrize("index", [0, 1, 2], ids=LAYER_TYPES)
def test_stated_parameters_are_the_built_ones(index):
    """What each kind states of its weights (``parameter_tensors``, which the accounting and the memory model sum)
    is what it builds."""
    model = v4_model()
    layer = model.layer(index)
    stated = sorted(tensor.shape for tensor in attention_kind(layer).parameter_tensors(model, index))
    assert stated == sorted(tuple(param.shape) for param in build_attention(model, layer).parameters())


def test_tensor_parallelism_needs_whole_output_groups_per_rank():
    """3 output groups cannot be split over 2 ranks: refused before any work, by name."""
    overrides = [f"model.{key}={value}" for key, value in MODEL.items() if key != "layer_types"]
    config = load_config("moe-8x", [*overrides, "model.layer_types=[sliding_attention,heavily_compressed_attention,"
                                    "compressed_sparse_attention]", "model.compressed_attention.o_groups=3",
                                    "model.n_kv_heads=null", "parallel.dp_shard=1", "parallel.tp=2"])
    with pytest.raises(ConfigError, match="does not divide model.compressed_attention.o_groups=3"):
        resolve_layout(config, 2)


@pytest.mark.parametrize("index", [0, 1, 2], ids=LAYER_TYPES)
def test_generation_through_the_cache_is_the_whole_forward(index):
    """A prompt, then one position at a time and a few at once through generation's cache: the outputs of the
    whole sequence's forward (which the test above holds to transformers')."""
    model = v4_model()
    ours, _ = attention_pair(model, index)
    torch.manual_seed(1)
    x = torch.randn(2, model.seq_len, model.d_model)
    if isinstance(ours, CompressedSparseAttention):  # a tie at the k-th place could go either way on a prefix
        assert_selection_binds_and_is_unambiguous(ours, model, x)
    cos, sin = rope_tables(model)
    with torch.no_grad():
        whole = ours(x, cos, sin)
        cache = LayerCache()
        steps = [ours(x[:, :30], cos, sin, cache)] + [ours(x[:, i:i + 1], cos, sin, cache) for i in range(30, 45)]
        steps.append(ours(x[:, 45:], cos, sin, cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=1e-5, rtol=1e-5)
    assert cache.length == model.seq_len


@pytest.mark.parametrize("index", [0, 1, 2], ids=LAYER_TYPES)
def test_stated_matmuls_are_the_built_projections(index):
    """The planner's matmuls (``projection_gemms``): one token's K·N summed is every projection weight the layer
    builds (the position biases are added, not multiplied), on one rank and per rank under tp=2, where the heads'
    projections (``q_b_proj``, ``o_a_proj``, ``o_b_proj``: ``parallel/tensor.py``) hold half."""
    model = v4_model(section={"o_groups": 2})
    layer = model.layer(index)
    built = {name: param.numel() for name, param in build_attention(model, layer).named_parameters()
             if param.dim() == 2 and not name.endswith("position_bias")}
    for tp in (1, 2):
        stated = sum(count * k * n for count, _, k, n in attention_kind(layer).projection_gemms(model, tp, 1))
        split = ("q_b_proj.weight", "o_a_proj.weight", "o_b_proj.weight")
        assert stated == sum(numel // tp if name in split else numel for name, numel in built.items())
