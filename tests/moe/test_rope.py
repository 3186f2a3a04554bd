"""RoPE's hand-written backward (``moe.rope._Rotate``) against autograd through the rotation's formula."""

import torch

from moe.rope import apply_rope


def rotate_by_formula(x, cos, sin):
    """RoFormer's rotation of channel pairs (i, i + r/2), differentiated by autograd."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


def test_rope_gradient_is_the_formulas_in_float64():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=generator, requires_grad=True)
    angles = torch.rand(5, 4, dtype=torch.float64, generator=generator) * 6
    cos, sin = angles.cos() * 1.3, angles.sin() * 1.3  # scaled as YaRN scales them: no longer a pure rotation
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cos, sin), (x,))
    grad = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=generator)
    ours, = torch.autograd.grad(apply_rope(x, cos, sin), x, grad)
    reference, = torch.autograd.grad(rotate_by_formula(x, cos, sin), x, grad)
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-12)


def test_rope_in_bf16_computes_in_fp32_and_returns_bf16():
    """Per-document tables ([B, 1, S, r/2]) broadcast the same way; the gradient comes back in x's dtype."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 8, generator=generator).bfloat16().requires_grad_()
    angles = torch.rand(2, 1, 5, 4, generator=generator) * 6
    out = apply_rope(x, angles.cos(), angles.sin())
    assert out.dtype == torch.bfloat16
    reference = rotate_by_formula(x.detach().float(), angles.cos(), angles.sin())
    torch.testing.assert_close(out.float(), reference, rtol=1e-2, atol=1e-2)  # one bf16 rounding of the result
    grad = torch.randn(2, 3, 5, 8, generator=generator)
    out.backward(grad.bfloat16())
    x32 = x.detach().float().requires_grad_()
    rotate_by_formula(x32, angles.cos(), angles.sin()).backward(grad.bfloat16().float())
    assert x.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.float(), x32.grad, rtol=1e-2, atol=1e-2)
