"""The megablocks backend (``grouped_gemm.ops.gmm``) against the torch backend on a GPU, in bf16.

Same layer, same weights, same tokens: outputs, input gradients and every parameter's gradient, dropless and
with capacity 1.0, with routing skewed (a shared direction in the tokens concentrates the load, as real residual
streams do, so some experts get many tokens and some few or none) and balanced (``force_balance``). Tolerance:
both run bf16 GEMMs with fp32 accumulation but in different kernels and summation orders, so each tensor must
agree to 1% of its norm (``‖a − b‖ ≤ 0.01 ‖b‖``), about three bf16 roundings (2^-8 each) of headroom.
"""

import pytest
import torch

from config.model import MoEConfig
from moe.experts import ComputeCopies, expert_ffn, megablocks_unavailable
from moe.init import initialize
from moe.layer import MoELayer

REASON = megablocks_unavailable("cuda") if torch.cuda.is_available() else "needs a CUDA GPU"
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"megablocks backend unavailable: {REASON}")
D, TOKENS = 512, 4096
RELATIVE = 0.01


def run(backend: str, capacity_factor: float | None, routing: str):
    config = MoEConfig(num_experts=8, top_k=2, expert_hidden=1024, capacity_factor=capacity_factor,
                       force_balance=routing == "balanced", backend=backend)
    layer = MoELayer(D, config).cuda()
    initialize(layer, 0, 0.02, 0.02)
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(4, TOKENS // 4, D, device="cuda", generator=generator)
    if routing == "skewed":
        x = x + 0.45 * x.new_ones(D) * torch.randn(D, device="cuda", generator=generator).sign()
    x.requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer(x)
    grad = torch.randn(out.shape, device="cuda", generator=generator, dtype=out.dtype)
    out.backward(grad)
    load = layer.last_stats.tokens_per_expert
    return {"output": out.float(), "input grad": x.grad.float(),
            **{name: p.grad.float() for name, p in layer.named_parameters()}}, load


@pytest.mark.parametrize("routing", ["skewed", "balanced"])
@pytest.mark.parametrize("capacity_factor", [None, 1.0], ids=["dropless", "capacity1.0"])
def test_megablocks_equals_torch_backend(capacity_factor, routing):
    reference, load = run("torch", capacity_factor, routing)
    candidate, _ = run("megablocks", capacity_factor, routing)
    if routing == "skewed":
        assert load.max() > 1.3 * load.float().mean(), f"the skewed tokens did not skew the routing: {load.tolist()}"
    for name, expected in reference.items():
        error = (candidate[name] - expected).norm() / expected.norm().clamp_min(1e-30)
        assert error <= RELATIVE, f"{name}: relative error {error:.3g} > {RELATIVE} (load {load.tolist()})"


def test_experts_without_tokens():
    """Group sizes of 0 (cuBLAS is then called with m = 0, and k = 0 for the weight gradients): the other rows
    equal the torch backend's and the idle experts' weight gradients are exactly zero."""
    sizes = torch.tensor([300, 0, 212, 0], device="cuda")
    x = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn(512, 128, device="cuda", dtype=torch.bfloat16)
    results = {}
    for backend in ("torch", "megablocks"):
        torch.manual_seed(0)
        weights = [torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                   torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True),
                   torch.randn(4, 256, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)]
        inputs = x.clone().requires_grad_()
        expert_ffn(inputs, sizes, *weights, ComputeCopies(), backend).backward(grad)
        results[backend] = [inputs.grad] + [w.grad for w in weights]
        for w in weights:
            assert torch.count_nonzero(w.grad[1]) == 0 and torch.count_nonzero(w.grad[3]) == 0
    for expected, got in zip(results["torch"], results["megablocks"], strict=True):
        assert (got.float() - expected.float()).norm() <= RELATIVE * expected.float().norm()
