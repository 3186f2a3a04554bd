"""flash-linear-attention's kernels (``model.linear_backend=fla``) against the torch reference of the gated delta
rule on the GPU: the same outputs, final state and gradients (grouped value heads, an initial state, a sequence
that is not a multiple of the chunk), and a hybrid model's loss and gradients the same under either backend.

Tolerances: fla's Triton matmuls take fp32 inputs in TF32 (10-bit mantissa), so the two agree to about 1e-3
relative, not to fp32's rounding; the torch path is itself held to the paper's recurrence in fp64 on the CPU
(``tests/moe/test_gated_delta.py``).
"""

from __future__ import annotations

import pytest
import torch

from config.model import ModelConfig, MoEConfig
from moe.attention.delta_rule import gated_delta_rule
from moe.attention.delta_rule_fla import fla_gated_delta_rule, fla_unavailable
from moe.transformer import MoETransformer
from tests.moe.test_gated_delta import HYBRID

MISSING = fla_unavailable("cuda") if torch.cuda.is_available() else None  # no GPU: conftest skips, saying so
pytestmark = pytest.mark.skipif(MISSING is not None, reason=f"model.linear_backend=fla: {MISSING} (scripts/"
                                                            "gpu_check.sh installs fla-core from its --wheels folder)")
TOLERANCE = dict(rtol=2e-3, atol=2e-3)


def _inputs(batch=2, key_heads=2, value_heads=4, seq=100, dk=32, dv=48):
    generator = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device="cuda", generator=generator)

    q = torch.nn.functional.normalize(rand(batch, key_heads, seq, dk), dim=-1) * dk ** -0.5
    k = torch.nn.functional.normalize(rand(batch, key_heads, seq, dk), dim=-1)
    v = rand(batch, value_heads, seq, dv)
    log_decay = -torch.nn.functional.softplus(rand(batch, value_heads, seq))
    beta = torch.sigmoid(rand(batch, value_heads, seq))
    state = rand(batch, value_heads, dk, dv) * 0.1
    return [t.requires_grad_() for t in (q, k, v, log_decay, beta, state)]


def test_fla_rule_equals_the_torch_rule():
    inputs = _inputs()
    expected_out, expected_state = gated_delta_rule(*inputs[:5], 64, inputs[5])
    grad_out, grad_state = torch.randn_like(expected_out), torch.randn_like(expected_state)
    expected = torch.autograd.grad((expected_out, expected_state), inputs, (grad_out, grad_state))
    out, state = fla_gated_delta_rule(*inputs[:5], inputs[5])
    torch.testing.assert_close(out.float(), expected_out, **TOLERANCE)
    torch.testing.assert_close(state.float(), expected_state, **TOLERANCE)
    grads = torch.autograd.grad((out, state), inputs, (grad_out.to(out.dtype), grad_state.to(state.dtype)))
    for name, got, want in zip(("q", "k", "v", "log_decay", "beta", "state"), grads, expected, strict=True):
        torch.testing.assert_close(got.float(), want, **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")


def test_a_hybrid_model_trains_the_same_under_either_backend():
    def loss_and_grads(backend):
        torch.manual_seed(0)
        model = MoETransformer(ModelConfig(**{**HYBRID, "vocab_size": 64, "ffn_hidden": 32, "seq_len": 96,
                                              "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                              "linear_chunk_size": 64, "linear_backend": backend}),
                               MoEConfig(num_experts=4, expert_hidden=16, capacity_factor=None), seed=0).cuda()
        tokens = torch.randint(0, 64, (2, 96), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        return loss.detach(), {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    loss, grads = loss_and_grads("fla")
    expected_loss, expected_grads = loss_and_grads("torch")
    torch.testing.assert_close(loss, expected_loss, **TOLERANCE)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **TOLERANCE, msg=lambda m, name=name: f"{name}: {m}")
