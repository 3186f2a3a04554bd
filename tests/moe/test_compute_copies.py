"""The experts' bf16 compute copies: the same numbers as casting at every call, one cast per optimizer step."""

import torch
import torch.nn.functional as F

from config.run import TrainConfig
from moe.experts import GroupedExperts, grouped_matmul
from moe.init import initialize
from training.optim import build_optimizer

E, D, H = 4, 16, 32
SIZES = torch.tensor([5, 0, 7, 4])


def _experts() -> GroupedExperts:
    experts = GroupedExperts(E, D, H)
    initialize(experts, seed=3, std=0.5, out_std=0.5)
    return experts


def _cast_every_call(x, experts: GroupedExperts):
    """The reference: the SwiGLU experts with each weight cast to bf16 at the call, through autograd."""
    x = x.to(torch.bfloat16)
    w_in, w_gate, w_out = (w.to(torch.bfloat16) for w in (experts.w_in, experts.w_gate, experts.w_out))
    hidden = F.silu(grouped_matmul(x, w_gate, SIZES)) * grouped_matmul(x, w_in, SIZES)
    return grouped_matmul(hidden, w_out, SIZES)


def _forward_backward(fn, experts, x, grad):
    experts.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fn(x)
    out.backward(grad)
    return out.detach(), x.grad, {name: p.grad.clone() for name, p in experts.named_parameters()}


def test_compute_copies_give_the_numbers_of_a_cast_at_every_call():
    experts = _experts()
    torch.manual_seed(0)
    x, grad = torch.randn(int(SIZES.sum()), D), torch.randn(int(SIZES.sum()), D, dtype=torch.bfloat16)
    for _ in range(2):  # the second call reuses the copies
        out, x_grad, grads = _forward_backward(lambda t: experts(t, SIZES), experts, x, grad)
        ref_out, ref_x_grad, ref_grads = _forward_backward(lambda t: _cast_every_call(t, experts), experts, x, grad)
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref_out)
        assert torch.equal(x_grad, ref_x_grad)
        for name, value in grads.items():
            assert value.dtype == torch.float32 and torch.equal(value, ref_grads[name]), name


def test_one_cast_per_optimizer_step():
    experts = _experts()
    optimizer = build_optimizer(experts, TrainConfig(lr=0.1))
    x = torch.randn(int(SIZES.sum()), D)

    def micro_batch():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            experts(x, SIZES).float().square().mean().backward()
        return [id(copy) for copy in experts.compute_copies.tensors()]

    made = micro_batch()
    assert len(made) == 3 and micro_batch() == made  # micro-batches of one step share the copies
    optimizer.step()
    assert experts.compute_copies.tensors() == []  # dropped before the weights changed
    after = micro_batch()
    assert len(after) == 3
    # and made from the updated weights
    assert torch.equal(experts.compute_copies.tensors()[0], experts.w_in.detach().to(torch.bfloat16))


def test_a_write_to_the_weights_outside_the_optimizer_remakes_the_copy():
    experts = _experts()
    x = torch.randn(int(SIZES.sum()), D)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        before = experts(x, SIZES)
        experts.load_state_dict({name: 2 * p.detach() for name, p in experts.named_parameters()})
        after = experts(x, SIZES)
        expected = _cast_every_call(x, experts)
    assert torch.equal(after, expected) and not torch.equal(after, before)


def test_weights_already_in_the_compute_dtype_pass_through():
    experts = _experts().to(torch.bfloat16)
    x = torch.randn(int(SIZES.sum()), D, dtype=torch.bfloat16)
    experts(x, SIZES)
    assert experts.compute_copies.tensors() == []
