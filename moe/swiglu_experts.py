"""The SwiGLU experts' three grouped GEMMs and activation as one autograd node, on buffers the layer reuses.

Autograd's composition of the same math (``grouped_mm`` for the gate and up projections, ``_SwiGLU``, ``grouped_mm``
for the down projection) allocates every [N, H] activation and gradient afresh: seven per step, four saved for
backward and three in it. On a GPU the caching allocator makes that free; on a CPU each one of 1 MiB or more has
its pages faulted in anew (``moe/workspace.py``). Written out, the forward and backward put every large tensor they
make on the workspace's kept storages, and the backward makes two [N, H] gradients instead of three (the
activation's gradient is written over the down projection's, which nothing else reads). Same kernels in the same
order, the same saved activations: outputs and gradients are autograd's to the bit
(``tests/moe/test_swiglu_experts.py``).

The grouped GEMMs are one ``torch.mm`` per expert into its rows of the output, which is what torch's CPU
``grouped_mm`` runs (bit for bit), but written into a kept buffer instead of a new one. The group sizes are held on
the host, so the node saves no group offsets (autograd's three ``grouped_mm`` calls save one each). CPU only
(``runs_fused``). Shapes: N grouped rows, D = d_model, H = the experts' hidden size, E experts; the
weights are stacked input-major (``w: [E, in, out]``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from moe import workspace


def runs_fused(device_type: str, activation: str, bias: bool) -> bool:
    """Whether the routed experts run as ``SwiGLUExperts``: plain SwiGLU without biases, on a CPU. Elsewhere
    autograd's composition runs (``moe.experts.expert_ffn``): a GPU's caching allocator already keeps its buffers,
    and the clamped, limited and biased variants are not written out. The compiled path keeps the composition too."""
    return device_type == "cpu" and activation == "swiglu" and not bias


def _new(shape: tuple[int, ...], like: Tensor) -> Tensor:
    return workspace.empty(shape, like.dtype, like.device)


class _Groups:
    """Each expert's rows of the grouped tensor, from the group sizes (read on the host: a CPU's own memory). The
    blocks are views made by one ``split`` per tensor, so an expert costs one Python call, its ``torch.mm``."""

    def __init__(self, tokens_per_expert: Tensor):
        self.sizes = tokens_per_expert.tolist()

    def matmul(self, rows: Tensor, weight: Tensor) -> Tensor:
        """Row block e of ``rows`` [N, in] times ``weight[e]`` [in, out] (a transposed view is fine) -> [N, out]."""
        out = _new((rows.shape[0], weight.shape[-1]), rows)
        for block, matrix, result in zip(rows.split(self.sizes), weight.unbind(0), out.split(self.sizes),
                                         strict=True):
            torch.mm(block, matrix, out=result)
        return out

    def weight_gradient(self, rows: Tensor, grad: Tensor) -> Tensor:
        """Per expert e, ``rows[block e].T @ grad[block e]``: [E, in, out] (zero for an empty group)."""
        out = _new((len(self.sizes), rows.shape[1], grad.shape[1]), rows)
        for block, grad_block, result in zip(rows.split(self.sizes), grad.split(self.sizes), out.unbind(0),
                                             strict=True):
            torch.mm(block.t(), grad_block, out=result)
        return out


class SwiGLUExperts(torch.autograd.Function):
    """``(silu(x W_gate) * (x W_in)) W_out`` per expert's rows, with the tensors autograd's composition saves."""

    @staticmethod
    def forward(ctx, x: Tensor, tokens_per_expert: Tensor, w_gate: Tensor, w_in: Tensor, w_out: Tensor) -> Tensor:
        groups = _Groups(tokens_per_expert)
        with torch.autocast("cpu", enabled=False):  # the inputs are already in the compute dtype
            gate = groups.matmul(x, w_gate)
            up = groups.matmul(x, w_in)
            activated = torch.ops.aten.silu.out(gate, out=_new(gate.shape, gate))
            hidden = torch.mul(activated, up, out=_new(up.shape, up))
            out = groups.matmul(hidden, w_out)
        ctx.groups = groups
        ctx.save_for_backward(x, w_gate, w_in, w_out, gate, activated, up, hidden)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        x, w_gate, w_in, w_out, gate, activated, up, hidden = ctx.saved_tensors
        groups: _Groups = ctx.groups
        grad = grad.to(hidden.dtype).contiguous()
        need_x, _, need_gate, need_in, need_out = ctx.needs_input_grad
        grad_w_out = groups.weight_gradient(hidden, grad) if need_out else None
        grad_hidden = groups.matmul(grad, w_out.transpose(-2, -1))
        grad_up = torch.mul(grad_hidden, activated, out=_new(up.shape, up))
        grad_gate = grad_hidden.mul_(up)  # the activation's gradient over the down projection's: read once
        torch.ops.aten.silu_backward.grad_input(grad_gate, gate, grad_input=grad_gate)
        grad_x = None
        if need_x:
            grad_x = groups.matmul(grad_gate, w_gate.transpose(-2, -1))
            grad_x += groups.matmul(grad_up, w_in.transpose(-2, -1))  # in autograd's order: its two inputs' sum
        grad_w_gate = groups.weight_gradient(x, grad_gate) if need_gate else None
        grad_w_in = groups.weight_gradient(x, grad_up) if need_in else None
        return grad_x, None, grad_w_gate, grad_w_in, grad_w_out


def swiglu_experts(x: Tensor, tokens_per_expert: Tensor, w_gate: Tensor, w_in: Tensor, w_out: Tensor) -> Tensor:
    """The SwiGLU experts on ``x`` [N, D] grouped by expert (group sizes ``tokens_per_expert``) -> [N, D]."""
    return SwiGLUExperts.apply(x, tokens_per_expert, w_gate, w_in, w_out)
