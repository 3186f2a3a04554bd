"""DeepSeek-V4's residual and feed-forward pieces against ``transformers``' ``deepseek_v4`` (the oracle, used only
here), fp32 within 1e-5, forward and gradients:

- the hyper-connected block (``moe/hyper_connections.py`` in ``moe/block.py``) against ``DeepseekV4DecoderLayer``
  with both its branches replaced, in both models, by the same stand-in modules: what is compared is the residual's
  maths (the streams' collapse, Sinkhorn-normalised mixing and expansion around each branch), not V4's attention;
- the final collapse (``HyperHead``) against ``DeepseekV4HyperHead``;
- the learned sqrt-softplus router and the hash router against ``DeepseekV4TopKRouter`` / ``DeepseekV4HashRouter``;
- the MoE layer (limited SwiGLU experts and shared expert, learned or hash routing) against
  ``DeepseekV4SparseMoeBlock``.
"""

import pytest
import torch
from torch import nn

from config.model import ModelConfig, MoEConfig
from moe.block import Block
from moe.hyper_connections import HyperHead
from moe.layer import HashMoELayer, MoELayer
from moe.router import HashRouter, TopKRouter

v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
from transformers import DeepseekV4Config  # noqa: E402

D, H, E, K, V, N = 16, 12, 6, 2, 32, 4  # width, expert width, experts, choices, vocabulary, streams
LIMIT = 1.5  # the SwiGLU limit: low enough that the clamps act on std-1 weights


def hf_config(**overrides) -> DeepseekV4Config:
    options = dict(vocab_size=V, hidden_size=D, moe_intermediate_size=H, num_hidden_layers=2, num_attention_heads=2,
                   head_dim=16, q_lora_rank=8, n_routed_experts=E, num_experts_per_tok=K, o_groups=1, o_lora_rank=8,
                   index_n_heads=2, index_head_dim=16, index_topk=4, sliding_window=4, hc_mult=N,
                   hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, swiglu_limit=LIMIT,
                   routed_scaling_factor=1.5, layer_types=["sliding_attention"] * 2,
                   mlp_layer_types=["hash_moe", "moe"])
    return DeepseekV4Config(**options | overrides)


def our_configs(mlp: str = "moe") -> tuple[ModelConfig, MoEConfig]:
    model = ModelConfig(vocab_size=V, d_model=D, n_layers=1, n_heads=2, seq_len=16, hc_mult=N, hc_sinkhorn_iters=20,
                        hc_eps=1e-6, norm_eps=1e-6, mlp_layer_types=[mlp])
    moe = MoEConfig(num_experts=E, top_k=K, expert_hidden=H, score_func="sqrtsoftplus", activation="limited_swiglu",
                    swiglu_limit=LIMIT, num_shared_experts=1, routed_scaling_factor=1.5, capacity_factor=None,
                    aux_loss_coef=0.0, z_loss_coef=0.0, backend="torch")
    model.validate()
    moe.validate()
    return model, moe


def randomise(module: nn.Module, seed: int) -> None:
    """Every parameter drawn N(0, 1) (their init leaves biases at zero and scales at one: too easy)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))


class Stand_in(nn.Module):
    """A branch both blocks share: tanh(x W), returned alone (ours) or with None (theirs' attention)."""

    def __init__(self, linear: nn.Linear, pair: bool):
        super().__init__()
        self.linear, self.pair = linear, pair

    def forward(self, x, *args, **kwargs):
        out = torch.tanh(self.linear(x))
        return (out, None) if self.pair else out


def close(got, expected, name: str = "") -> None:
    """Within 1e-5 relative, and 1e-5 of the tensor's largest entry absolute: gradients here are sums over tokens
    and streams (and Sinkhorn's 39 divisions) taken in another order than the oracle's, their entries spanning
    orders of magnitude, so a small entry's absolute error is the large ones' rounding."""
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * max(1.0, float(expected.abs().max())),
                               msg=lambda message: f"{name}: {message}")


def copy_hyper(ours, theirs) -> None:
    with torch.no_grad():
        ours.weight.copy_(theirs.fn if hasattr(theirs, "fn") else theirs.hc_fn)
        ours.bias.copy_(theirs.base if hasattr(theirs, "base") else theirs.hc_base)
        ours.scale.copy_(theirs.scale if hasattr(theirs, "scale") else theirs.hc_scale)


def test_hyper_connected_block_matches_transformers_decoder_layer_residual():
    """Streams [B, S, 4, D] through both branches: the output streams and the gradients of the input streams, of
    both hyper-connections' weights, biases and scales, and of the norms, within 1e-5 (fp32)."""
    config = hf_config()
    theirs = v4.DeepseekV4DecoderLayer(config, 1).float()
    randomise(theirs, 0)
    attn_linear, ffn_linear = nn.Linear(D, D), nn.Linear(D, D)
    randomise(attn_linear, 1)
    randomise(ffn_linear, 2)
    theirs.self_attn, theirs.mlp = Stand_in(attn_linear, True), Stand_in(ffn_linear, False)
    model, moe = our_configs()
    ours = Block(model, moe, model.layer(0))
    ours.attn, ours.moe = Stand_in(attn_linear, False), Stand_in(ffn_linear, False)
    copy_hyper(ours.attn_hc, theirs.attn_hc)
    copy_hyper(ours.ffn_hc, theirs.ffn_hc)
    with torch.no_grad():
        ours.attn_norm.weight.copy_(theirs.input_layernorm.weight)
        ours.ffn_norm.weight.copy_(theirs.post_attention_layernorm.weight)

    streams = torch.randn(2, 5, N, D)
    grad_out = torch.randn(2, 5, N, D)
    x_theirs, x_ours = streams.clone().requires_grad_(True), streams.clone().requires_grad_(True)
    expected = theirs(x_theirs)
    got = ours(x_ours, None, None)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    theirs_params = dict(theirs.named_parameters())
    (expected * grad_out).sum().backward()
    theirs_grads = {name: param.grad.clone() for name, param in theirs_params.items()}
    for param in [*attn_linear.parameters(), *ffn_linear.parameters()]:
        param.grad = None
    (got * grad_out).sum().backward()
    close(x_ours.grad, x_theirs.grad, "input streams")
    pairs = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
    for branch in ("attn_hc", "ffn_hc"):
        pairs |= {f"{branch}.weight": f"{branch}.fn", f"{branch}.bias": f"{branch}.base",
                  f"{branch}.scale": f"{branch}.scale"}
    ours_params = dict(ours.named_parameters())
    for name, their_name in pairs.items():
        close(ours_params[name].grad, theirs_grads[their_name], name)
    close(attn_linear.weight.grad, theirs_grads["self_attn.linear.weight"], "attention's stand-in")


def test_plain_block_keeps_one_stream():
    """hc_mult 1 (the default) builds no hyper-connection: the block is the plain residual."""
    model = ModelConfig(vocab_size=V, d_model=D, n_layers=1, n_heads=2, seq_len=16)
    block = Block(model, MoEConfig(num_experts=E, top_k=K, expert_hidden=H), model.layer(0))
    assert block.attn_hc is None and block.ffn_hc is None
    assert not any("hc" in name for name, _ in block.named_parameters())


def test_hyper_head_matches_transformers():
    theirs = v4.DeepseekV4HyperHead(hf_config()).float()
    randomise(theirs, 3)
    model, _ = our_configs()
    ours = HyperHead(model)
    copy_hyper(ours, theirs)
    streams = torch.randn(2, 5, N, D)
    x_theirs, x_ours = streams.clone().requires_grad_(True), streams.clone().requires_grad_(True)
    expected, got = theirs(x_theirs), ours(x_ours)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    expected.square().sum().backward()
    got.square().sum().backward()
    close(x_ours.grad, x_theirs.grad)
    for ours_param, theirs_param in zip(ours.parameters(), theirs.parameters(), strict=True):
        close(ours_param.grad, theirs_param.grad)


def by_expert(ids, weights):
    """Each token's (expert, weight) pairs in expert order: their router does not sort its choices."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("hashed", [False, True])
def test_routers_match_transformers(hashed):
    """sqrt(softplus) scores; the learned router's choice by the biased scores (a random correction bias), the hash
    router's by the table; the chosen scores renormalised and scaled by 1.5."""
    config = hf_config()
    theirs = (v4.DeepseekV4HashRouter if hashed else v4.DeepseekV4TopKRouter)(config)
    randomise(theirs, 4)
    _, moe = our_configs()
    ours = HashRouter(D, moe, V) if hashed else TopKRouter(D, moe)
    tokens = torch.randint(0, V, (10,))
    with torch.no_grad():
        ours.gate.copy_(theirs.weight)
        if hashed:
            theirs.tid2eid.copy_(torch.rand(V, E).topk(K, dim=-1).indices)
            ours.tid2eid.copy_(theirs.tid2eid)
        else:
            theirs.e_score_correction_bias.copy_(torch.randn(E) * 0.3)
            ours.expert_bias.copy_(theirs.e_score_correction_bias)
    x = torch.randn(10, D)
    _, their_weights, their_ids = theirs(x, tokens) if hashed else theirs(x)
    routed = ours(x, tokens) if hashed else ours(x)
    got_ids, got_weights = by_expert(routed.expert_ids, routed.weights)
    expected_ids, expected_weights = by_expert(their_ids, their_weights)
    assert torch.equal(got_ids, expected_ids)
    torch.testing.assert_close(got_weights, expected_weights, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("hashed", [False, True])
def test_moe_layer_matches_transformers_sparse_moe_block(hashed):
    """Routed experts and the shared expert with V4's limited SwiGLU (the clamps acting), learned or hash routing:
    the output and the gradients of the input, the gate and every expert weight."""
    config = hf_config()
    theirs = v4.DeepseekV4SparseMoeBlock(config, 0 if hashed else 1).float()
    randomise(theirs, 5)
    model, moe = our_configs("hash_moe" if hashed else "moe")
    ours = HashMoELayer(D, moe, V) if hashed else MoELayer(D, moe)
    tokens = torch.randint(0, V, (2, 7))
    experts = ours.experts
    with torch.no_grad():
        theirs.experts.gate_up_proj.mul_(0.5)
        ours.router.gate.copy_(theirs.gate.weight)
        if hashed:
            theirs.gate.tid2eid.copy_(torch.rand(V, E).topk(K, dim=-1).indices)
            ours.router.tid2eid.copy_(theirs.gate.tid2eid)
        experts.w_gate.copy_(theirs.experts.gate_up_proj[:, :H].transpose(1, 2))
        experts.w_in.copy_(theirs.experts.gate_up_proj[:, H:].transpose(1, 2))
        experts.w_out.copy_(theirs.experts.down_proj.transpose(1, 2))
        shared, their_shared = ours.shared_experts, theirs.shared_experts
        shared.w_gate.weight.copy_(their_shared.gate_proj.weight)
        shared.w_in.weight.copy_(their_shared.up_proj.weight)
        shared.w_out.weight.copy_(their_shared.down_proj.weight)
    x = torch.randn(2, 7, D)
    gate_up = x.reshape(-1, D) @ theirs.experts.gate_up_proj[0].t()
    assert (gate_up[:, :H] > LIMIT).any() and (gate_up[:, H:].abs() > LIMIT).any(), "the clamps would not act"
    x_theirs, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    expected = theirs(x_theirs, input_ids=tokens)
    got = ours(x_ours, token_ids=tokens) if hashed else ours(x_ours)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    grad_out = torch.randn_like(expected)
    (expected * grad_out).sum().backward()
    (got * grad_out).sum().backward()
    close(x_ours.grad, x_theirs.grad)
    their_gate_up = theirs.experts.gate_up_proj.grad
    for got_grad, expected_grad in [
            (ours.router.gate.grad, theirs.gate.weight.grad),
            (experts.w_gate.grad, their_gate_up[:, :H].transpose(1, 2)),
            (experts.w_in.grad, their_gate_up[:, H:].transpose(1, 2)),
            (experts.w_out.grad, theirs.experts.down_proj.grad.transpose(1, 2)),
            (shared.w_gate.weight.grad, their_shared.gate_proj.weight.grad),
            (shared.w_in.weight.grad, their_shared.up_proj.weight.grad),
            (shared.w_out.weight.grad, their_shared.down_proj.weight.grad)]:
        close(got_grad, expected_grad)
