"""Gated DeltaNet linear attention against its oracles: the delta rule (by chunks and step by step) against a
per-position recurrence written from the paper's equation and against ``transformers``' Qwen3-Next torch
functions, forward and gradients; the whole layer against ``Qwen3NextGatedDeltaNet`` with our weights copied in;
generation's cache against the full forward; the stated costs against the built module; the config's refusals."""

import pytest
import torch

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from config.run import RunConfig
from inference.generate import generate
from moe.attention import GatedDeltaAttention, build_attention
from moe.attention.delta_rule import (
    chunked_gated_delta_rule,
    gated_delta_rule,
    recurrent_gated_delta_rule,
    unit_lower_inverse,
)
from moe.kv_cache import LayerCache
from moe.transformer import MoETransformer
from parallel.resolve import resolve_layout

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf_qwen3_next  # noqa: E402

HYBRID = dict(d_model=24, n_layers=2, n_heads=3, layer_types=["linear_attention", "full_attention"],
              linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=6, linear_value_head_dim=5,
              linear_conv_kernel=4, linear_chunk_size=4, seq_len=16)


def naive_gated_delta_rule(q, k, v, log_decay, beta):
    """The paper's recurrence as written (Gated DeltaNet eq. 10), one position at a time with whole matrices:
    S_t = exp(g_t) (I - beta_t k_t k_tᵀ) S_{t-1} + beta_t k_t v_tᵀ, o_t = S_tᵀ q_t; key head h serves value
    heads h·r .. h·r + r - 1."""
    repeat = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)
    batch, heads, seq, dk = k.shape
    state = torch.zeros(batch, heads, dk, v.shape[-1], dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)
    outputs = []
    for t in range(seq):
        k_t, b_t = k[:, :, t].double(), beta[:, :, t].double()[..., None, None]
        erase = eye - b_t * k_t.unsqueeze(-1) * k_t.unsqueeze(-2)
        state = log_decay[:, :, t].double().exp()[..., None, None] * (erase @ state)
        state = state + b_t * k_t.unsqueeze(-1) * v[:, :, t].double().unsqueeze(-2)
        outputs.append((state.mT @ q[:, :, t].double().unsqueeze(-1)).squeeze(-1))
    return torch.stack(outputs, dim=2), state


def rule_inputs(seq, heads=4, key_heads=2, dk=8, dv=6, seed=0):
    """q, k (L2-normalised) [B, Hk, S, dk], v [B, H, S, dv], log_decay <= 0 and beta in (0, 1) [B, H, S],
    requiring gradients."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, key_heads, seq, dk, generator=generator) * dk ** -0.5
    k = torch.nn.functional.normalize(torch.randn(2, key_heads, seq, dk, generator=generator), dim=-1)
    v = torch.randn(2, heads, seq, dv, generator=generator)
    log_decay = -torch.rand(2, heads, seq, generator=generator)
    beta = torch.rand(2, heads, seq, generator=generator)
    return [x.requires_grad_() for x in (q, k, v, log_decay, beta)]


def outputs_and_gradients(rule, inputs):
    out, state = rule(*inputs)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    grads = torch.autograd.grad((out * weights).sum() + state.square().sum(), inputs)
    return out, state, grads


def hf_rule(chunked):
    """transformers' torch functions on our [B, H, S, d] layout (theirs is [B, S, H, d]; they scale q by dk^-0.5
    themselves, so ours gets it undone)."""
    def rule(q, k, v, log_decay, beta):
        q = q * q.shape[-1] ** 0.5
        args = [x.transpose(1, 2) for x in (q, k, v, log_decay, beta)]
        if chunked:
            out, state = hf_qwen3_next.torch_chunk_gated_delta_rule(*args, chunk_size=4, output_final_state=True)
        else:
            out, state = hf_qwen3_next.torch_recurrent_gated_delta_rule(*args, output_final_state=True)
        return out.transpose(1, 2), state
    return rule


OURS = {"chunked": lambda *x: chunked_gated_delta_rule(*x, chunk_size=4), "recurrent": recurrent_gated_delta_rule,
        "recomputed in backward": lambda *x: gated_delta_rule(*x, chunk_size=4)}


@pytest.mark.parametrize("form", OURS)
@pytest.mark.parametrize("seq", [1, 11])  # not a multiple of the chunk
def test_delta_rule_matches_naive_recurrence_and_transformers(form, seq):
    inputs = rule_inputs(seq)
    out, state, grads = outputs_and_gradients(OURS[form], inputs)
    naive_out, naive_state = naive_gated_delta_rule(*inputs)
    torch.testing.assert_close(out.double(), naive_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.double(), naive_state, rtol=1e-5, atol=1e-5)
    naive_grads = outputs_and_gradients(lambda *x: [y.float() for y in naive_gated_delta_rule(*x)], inputs)[2]
    for theirs_form in (True, False):
        hf_out, hf_state, hf_grads = outputs_and_gradients(hf_rule(theirs_form), inputs)
        torch.testing.assert_close(out, hf_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state, hf_state, rtol=1e-5, atol=1e-5)
        for ours, theirs, naive in zip(grads, hf_grads, naive_grads, strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(ours, naive, rtol=1e-5, atol=1e-5)


def test_chunked_rule_continues_from_a_state():
    """Two halves, the second starting from the first's state, are the whole sequence (what generation's prompt
    and cross-chunk carry rely on)."""
    q, k, v, g, b = (x.detach() for x in rule_inputs(10))
    whole, whole_state = chunked_gated_delta_rule(q, k, v, g, b, 4)
    first, state = chunked_gated_delta_rule(q[:, :, :7], k[:, :, :7], v[:, :, :7], g[:, :, :7], b[:, :, :7], 4)
    second, state = chunked_gated_delta_rule(q[:, :, 7:], k[:, :, 7:], v[:, :, 7:], g[:, :, 7:], b[:, :, 7:], 4,
                                             state)
    torch.testing.assert_close(torch.cat((first, second), dim=2), whole, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, whole_state, rtol=1e-5, atol=1e-6)


def random_layer(model: ModelConfig) -> GatedDeltaAttention:
    torch.manual_seed(0)
    layer = build_attention(model, model.layer(0))
    with torch.no_grad():
        for name, param in layer.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else torch.randn_like(param) * 0.3)
    return layer


def hf_layer(model: ModelConfig, ours: GatedDeltaAttention):
    """``Qwen3NextGatedDeltaNet`` holding our weights: its fused projections interleave, per key head, that head's
    q, k and its r value heads' v and z rows (and b, a per value head likewise); the convolution is ours
    concatenated."""
    config = transformers.Qwen3NextConfig(
        hidden_size=model.d_model, linear_num_key_heads=model.linear_key_heads,
        linear_num_value_heads=model.linear_value_heads, linear_key_head_dim=model.linear_key_head_dim,
        linear_value_head_dim=model.linear_value_head_dim, linear_conv_kernel_dim=model.linear_conv_kernel,
        rms_norm_eps=model.norm_eps, num_hidden_layers=1, layer_types=["linear_attention"], vocab_size=16)
    theirs = hf_qwen3_next.Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    groups = model.linear_key_heads

    def per_group(*linears):
        return torch.cat([w.weight.view(groups, -1, model.d_model) for w in linears], dim=1).reshape(-1, model.d_model)

    theirs.load_state_dict({
        "in_proj_qkvz.weight": per_group(ours.wq, ours.wk, ours.wv, ours.wz),
        "in_proj_ba.weight": per_group(ours.wb, ours.wa),
        "conv1d.weight": torch.cat((ours.conv_q, ours.conv_k, ours.conv_v)),
        "dt_bias": ours.decay_bias, "A_log": ours.log_decay_rate, "norm.weight": ours.out_norm.weight,
        "out_proj.weight": ours.wo.weight})
    return theirs


@pytest.mark.parametrize("shape", [{}, dict(linear_key_heads=3, linear_value_heads=3, linear_chunk_size=64),
                                   dict(linear_key_heads=1, linear_value_heads=3, linear_conv_kernel=2)],
                         ids=["more-value-heads", "equal-heads-one-chunk", "one-key-head"])
def test_layer_matches_transformers(shape):
    model = ModelConfig(**{**HYBRID, **shape})
    model.validate()
    ours = random_layer(model)
    theirs = hf_layer(model, ours)
    x = torch.randn(2, 11, model.d_model, requires_grad=True)
    out = ours(x, None, None)
    expected = theirs(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    ours_grad = torch.autograd.grad((out * weights).sum(), [x, ours.conv_k, ours.log_decay_rate])
    theirs_grad = torch.autograd.grad((expected * weights).sum(), [x, theirs.conv1d.weight, theirs.A_log])
    keys = model.linear_key_heads * model.linear_key_head_dim
    torch.testing.assert_close(ours_grad[0], theirs_grad[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_grad[1], theirs_grad[1][keys:2 * keys], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours_grad[2], theirs_grad[2], rtol=1e-5, atol=1e-5)


def test_generation_cache_continues_the_sequence():
    """A prompt by chunks, then one token at a time through the cache (the step form, the convolution's kept
    inputs), gives the outputs of one forward over the whole sequence."""
    model = ModelConfig(**HYBRID)
    layer = random_layer(model).eval()
    x = torch.randn(2, 9, model.d_model)
    with torch.no_grad():
        whole = layer(x, None, None)
        cache = LayerCache()
        pieces = [layer(x[:, :6], None, None, cache)] + [layer(x[:, t:t + 1], None, None, cache) for t in range(6, 9)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, rtol=1e-5, atol=1e-5)
    assert cache.length == 9 and cache.state.shape == (2, 4, 6, 5)


def test_stated_costs_match_the_module():
    model = ModelConfig(**HYBRID)
    layer = build_attention(model, model.layer(0))
    stated = GatedDeltaAttention.parameter_tensors(model, 0)
    assert [p.shape for p in stated] == [tuple(p.shape) for p in layer.parameters()]
    d, tokens = model.d_model, 7
    gemms = {(m, k, n) for _, m, k, n in GatedDeltaAttention.projection_gemms(model, 1, tokens)}
    assert gemms == {(tokens, d, w.out_features) for w in (layer.wq, layer.wv, layer.wb)} | {(tokens, 20, d)}


def test_layer_pattern_and_refusals():
    model = ModelConfig(**HYBRID)
    model.validate()
    assert [spec.attention for spec in model.layer_pattern] == ["gated_delta", "grouped_query"]
    for bad, message in [(dict(linear_value_heads=3), "multiple of"), (dict(linear_key_head_dim=None), "positive"),
                         (dict(layer_types=None, n_layers=2), "linear-attention setting")]:
        with pytest.raises(ConfigError, match=message):
            ModelConfig(**{**HYBRID, **bad}).validate()
    run = RunConfig(model=ModelConfig(**{**HYBRID, "linear_key_heads": 3, "linear_value_heads": 3}))
    run.data.document_mask = True
    with pytest.raises(ConfigError, match="data.document_mask=true is not implemented for linear attention"):
        run.validate()
    run.data.document_mask = False
    run.parallel.tp, run.model.n_heads = 2, 4  # 2 does not divide the 3 linear key heads
    with pytest.raises(ConfigError, match="parallel.tp=2 does not divide model.linear_key_heads=3"):
        resolve_layout(run, 2)


def test_hybrid_model_generates_the_same_with_and_without_the_cache():
    """A hybrid model (a linear layer, then a full-attention one) writes the same greedy tokens through the cache
    (the linear layer's state and convolution inputs, the other's keys) as by recomputing every step."""
    torch.manual_seed(0)
    model = MoETransformer(ModelConfig(**{**HYBRID, "vocab_size": 32, "ffn_hidden": 16}),
                           MoEConfig(num_experts=4, expert_hidden=8, capacity_factor=None)).eval()
    prompt = [3, 1, 4, 1, 5, 9, 2]
    cached = generate(model, prompt, 8, temperature=0)
    assert cached == generate(model, prompt, 8, temperature=0, use_cache=False)


@pytest.mark.parametrize("size", [1, 5, 8, 64])  # chunk sizes padded to a power of two, and not
def test_unit_lower_inverse_is_the_triangular_solve(size):
    strict = torch.randn(3, size, size, dtype=torch.float64).tril(-1) * 0.5
    identity = torch.eye(size, dtype=torch.float64).expand(3, size, size)
    expected = torch.linalg.solve_triangular(identity + strict, identity, upper=False)
    torch.testing.assert_close(unit_lower_inverse(strict), expected, rtol=1e-10, atol=1e-10)
