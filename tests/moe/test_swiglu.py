"""``moe.experts.swiglu``: autograd's ``F.silu(gate) * up`` to the bit, forward and gradients, keeping what it keeps."""

import pytest
import torch
import torch.nn.functional as F

from moe.experts import swiglu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_equals_autograd_to_the_bit(dtype):
    torch.manual_seed(0)
    gate = (3 * torch.randn(67, 45)).to(dtype).requires_grad_(True)
    up = torch.randn(67, 45).to(dtype).requires_grad_(True)
    grad = torch.randn(67, 45).to(dtype)
    ours = swiglu(gate, up)
    d_gate, d_up = torch.autograd.grad(ours, (gate, up), grad)
    reference = F.silu(gate) * up
    ref_gate, ref_up = torch.autograd.grad(reference, (gate, up), grad)
    assert torch.equal(ours, reference)
    assert torch.equal(d_gate, ref_gate) and torch.equal(d_up, ref_up)


def test_swiglu_keeps_the_gate_its_silu_and_up():
    """What the memory model counts (``analysis.memory_activations``: these three; the product is w_out's)."""
    gate, up = torch.randn(8, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        swiglu(gate, up)
    assert len(saved) == 3 and saved[0] is gate and saved[2] is up
    assert torch.equal(saved[1], torch.nn.functional.silu(gate))
