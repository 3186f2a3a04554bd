"""``moe.norm.RMSNorm`` against ``nn.RMSNorm`` run in float64 (an independent reference), and what it saves."""

import pytest
import torch
from torch import nn

from moe.norm import RMSNorm


def _reference(x, weight, eps, grad):
    """nn.RMSNorm's output and gradients, all in float64."""
    norm = nn.RMSNorm(x.shape[-1], eps=eps, dtype=torch.float64)
    with torch.no_grad():
        norm.weight.copy_(weight.double())
    x64 = x.detach().double().requires_grad_()
    y = norm(x64)
    y.backward(grad.double())
    return y, x64.grad, norm.weight.grad


@pytest.mark.parametrize("shape", [(64, 48), (3, 17, 40), (2, 5, 4, 16)])
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(shape, weight_dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3 + 0.5).requires_grad_()
    norm = RMSNorm(shape[-1], eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[-1]) + 0.5)
    norm.to(weight_dtype)
    grad = torch.randn(shape).transpose(0, -1).contiguous().transpose(0, -1)  # a non-contiguous gradient
    y = norm(x)
    y.backward(grad)
    ref_y, ref_dx, ref_dw = _reference(x, norm.weight, 1e-5, grad)
    assert y.dtype == torch.float32 and norm.weight.grad.dtype == weight_dtype
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), ref_dx, rtol=1e-4, atol=1e-5)
    tolerance = 1e-4 if weight_dtype == torch.float32 else 1e-2  # the bf16 gradient is rounded once
    torch.testing.assert_close(norm.weight.grad.double(), ref_dw, rtol=tolerance, atol=tolerance)


def test_bf16_input_takes_the_library_path():
    """bf16 inputs (q/k norms under autocast) run nn.RMSNorm itself: the same bits."""
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    ours, theirs = RMSNorm(32), nn.RMSNorm(32)
    assert torch.equal(ours(x), theirs(x))


def _saved_bytes(module, x):
    saved = []

    def pack(tensor):
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
              if not isinstance(t, nn.Parameter) and t.data_ptr() != module.weight.data_ptr()}
    return sum(unique.values())


def test_saves_only_the_input_and_rstd():
    """What the memory model counts for a fused norm (``analysis.memory_activations._norm``): the input and
    one fp32 rstd per row, where nn.RMSNorm on CPU also keeps the normalised input."""
    rows, d = 40, 24
    x = torch.randn(rows, d, requires_grad=True)
    assert _saved_bytes(RMSNorm(d), x) == rows * (d + 1) * 4
    assert _saved_bytes(nn.RMSNorm(d), x) >= rows * (2 * d + 1) * 4
