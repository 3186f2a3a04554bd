"""GPT-OSS's MoE feed-forward (router with bias, softmax over the top-k logits, biased experts, clamped SwiGLU)
against ``transformers``' own ``GptOssMLP`` built from a tiny random config: the oracle, used only here.

Our stacked layout differs from theirs in one way: GPT-OSS keeps gate and up interleaved in one [E, D, 2H]
matrix (gate in the even columns, up in the odd); ours are separate [E, D, H] stacks, so the test copies the
even columns into ``w_gate`` and the odd into ``w_in`` (what an import does).
"""

import pytest
import torch

from config.errors import ConfigError
from config.model import MoEConfig
from moe.layer import MoELayer
from moe.router import TopKRouter

gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
from transformers import GptOssConfig  # noqa: E402

D, H, E, K = 16, 12, 6, 2


def oracle(limit: float, alpha: float = 1.702, seed: int = 0):
    """transformers' GptOssMLP with every weight and bias drawn at random (its own init leaves them empty)."""
    torch.manual_seed(seed)
    config = GptOssConfig(hidden_size=D, intermediate_size=H, num_local_experts=E, num_experts_per_tok=K,
                          swiglu_limit=limit)
    config.swiglu_alpha = alpha
    mlp = gpt_oss.GptOssMLP(config).float()
    with torch.no_grad():
        for name, param in mlp.named_parameters():
            param.copy_(torch.randn_like(param) * (0.5 if "bias" in name else 1.0))
    return mlp


def ours_from(mlp, limit: float, alpha: float = 1.702) -> MoELayer:
    config = MoEConfig(num_experts=E, top_k=K, expert_hidden=H, activation="clamped_swiglu", swiglu_limit=limit,
                       swiglu_alpha=alpha, router_bias=True, expert_proj_bias=True, capacity_factor=None,
                       aux_loss_coef=0.0, z_loss_coef=0.0, backend="torch")
    config.validate()
    layer = MoELayer(D, config)
    experts, theirs = layer.experts, mlp.experts
    with torch.no_grad():
        layer.router.gate.copy_(mlp.router.weight)
        layer.router.gate_bias.copy_(mlp.router.bias)
        experts.w_gate.copy_(theirs.gate_up_proj[..., ::2])
        experts.w_in.copy_(theirs.gate_up_proj[..., 1::2])
        experts.gate_bias.copy_(theirs.gate_up_proj_bias[:, ::2])
        experts.in_bias.copy_(theirs.gate_up_proj_bias[:, 1::2])
        experts.w_out.copy_(theirs.down_proj)
        experts.out_bias.copy_(theirs.down_proj_bias)
    return layer


# The weights drawn at std 1 give gate and up pre-activations of std ~ 4 with x of std 1: limit 7 (GPT-OSS's)
# clips a few percent of them, limit 1 most; alpha 1.0 checks the slope is read from the config.
@pytest.mark.parametrize("limit, alpha", [(7.0, 1.702), (1.0, 1.702), (7.0, 1.0)])
def test_layer_matches_transformers_gpt_oss_mlp(limit, alpha):
    """Outputs and the input's gradient within 1e-5 in fp32, and every weight's gradient (read back through
    the interleaving), on tokens whose pre-activations cross the limit (the clamps are exercised)."""
    mlp = oracle(limit, alpha)
    layer = ours_from(mlp, limit, alpha)
    x = torch.randn(2, 9, D)
    grad_out = torch.randn(2, 9, D)

    gate_up = x.reshape(-1, D) @ mlp.experts.gate_up_proj[0] + mlp.experts.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > limit).any() and (gate_up[:, 1::2].abs() > limit).any(), "the clamps would not act"

    x_theirs = x.clone().requires_grad_(True)
    expected, _ = mlp(x_theirs)
    (expected * grad_out).sum().backward()
    x_ours = x.clone().requires_grad_(True)
    got = layer(x_ours)
    (got * grad_out).sum().backward()

    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, **grad_tolerance(x_theirs.grad))
    grads = {
        "router.weight": (layer.router.gate.grad, mlp.router.weight.grad),
        "router.bias": (layer.router.gate_bias.grad, mlp.router.bias.grad),
        "gate columns": (layer.experts.w_gate.grad, mlp.experts.gate_up_proj.grad[..., ::2]),
        "up columns": (layer.experts.w_in.grad, mlp.experts.gate_up_proj.grad[..., 1::2]),
        "gate bias": (layer.experts.gate_bias.grad, mlp.experts.gate_up_proj_bias.grad[:, ::2]),
        "up bias": (layer.experts.in_bias.grad, mlp.experts.gate_up_proj_bias.grad[:, 1::2]),
        "down": (layer.experts.w_out.grad, mlp.experts.down_proj.grad),
        "down bias": (layer.experts.out_bias.grad, mlp.experts.down_proj_bias.grad),
    }
    for name, (ours, theirs) in grads.items():
        torch.testing.assert_close(ours, theirs, msg=name, **grad_tolerance(theirs))


def grad_tolerance(expected):
    """fp32 gradients here reach a few hundred and are sums over tokens and experts taken in another order than
    the oracle's: 1e-5 relative, and 1e-6 of the tensor's largest entry absolute (a few fp32 ulps of it)."""
    return dict(rtol=1e-5, atol=1e-6 * float(expected.abs().max()))


def test_router_matches_transformers_gpt_oss_top_k_router():
    """Top-k over the biased logits, then a softmax over the k: the same experts, in the same order, with the same
    weights as ``GptOssTopKRouter``, from our softmax-then-renormalise router (equal by the docstring's algebra)."""
    mlp = oracle(7.0)
    router = ours_from(mlp, 7.0).router
    x = torch.randn(40, D)
    logits, scores, indices = mlp.router(x)
    routed = router(x)
    torch.testing.assert_close(routed.logits, logits, rtol=1e-6, atol=1e-6)
    assert torch.equal(routed.expert_ids, indices)
    torch.testing.assert_close(routed.weights, scores, rtol=1e-6, atol=1e-6)


def test_router_bias_changes_the_choice():
    """The logit bias takes part in selection (not only in the weights): a large bias on one expert makes every
    token choose it first; without ``router_bias`` there is no such parameter."""
    config = MoEConfig(num_experts=E, top_k=K, router_bias=True)
    router = TopKRouter(D, config)
    with torch.no_grad():
        router.gate.normal_()
        router.gate_bias.zero_()
        router.gate_bias[3] = 1e3
    assert (router(torch.randn(20, D)).expert_ids[:, 0] == 3).all()
    assert TopKRouter(D, MoEConfig(num_experts=E, top_k=K)).gate_bias is None


@pytest.mark.parametrize("key, value", [("swiglu_limit", 0.0), ("swiglu_limit", -7.0), ("swiglu_alpha", 0.0),
                                        ("swiglu_limit", float("inf"))])
def test_bad_clamp_settings_are_config_errors(key, value):
    with pytest.raises(ConfigError, match=f"moe.{key}={value}"):
        MoEConfig(activation="clamped_swiglu", **{key: value}).validate()
