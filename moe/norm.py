"""RMSNorm with a fused backward where PyTorch has none.

``nn.RMSNorm`` computes ``y = x · rstd · w`` with ``rstd = 1 / sqrt(mean(x²) + eps)`` over the last dim
(Zhang & Sennrich 2019). On CUDA, with input and weight of one dtype, PyTorch runs it as one kernel each way
(``_fused_rms_norm`` and its backward) and saves only the input and ``rstd``. On CPU it has no fused backward:
autograd differentiates the decomposed forward and backward, about twenty passes over the activations, and
saves the normalised input beside the input. On the CPU ``moe-8x`` step that made the norms the largest part
of what is neither attention nor expert GEMMs (``benchmarks/train_step.py``). On CUDA the decomposed path is
also what an fp32 input with weights of another dtype gets (the fused kernel needs equal dtypes), a case the
trainer does not make today: under FSDP's bf16 weights the residual stream is bf16 too.

Here those cases run ``_RMSNorm``, the closed-form gradient

    x̂ = x · rstd,   g_w = g · w,   dx = rstd · (g_w − x̂ · mean(g_w · x̂)),   dw = Σ_tokens g · x̂,

in about half the passes over the activations that the decomposed ops make, saving what the fused kernels
save: the input and ``rstd``. Forward and backward together ran 2 to 3 times faster than ``nn.RMSNorm``'s on
the CPU step's [16, 256, 192] norms (one process, caches flushed between calls). Everything else (DTensor
inputs under sequence parallelism or tensor-parallel q/k norms, bf16 inputs such as the q/k norms under
autocast, tracing by ``torch.compile``, which fuses the decomposed ops itself) takes ``nn.RMSNorm``'s own
path unchanged.
``uses_fused_backward`` is the rule, and ``analysis.memory_activations`` counts the saved bytes by it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor


def uses_fused_backward(input_dtype: torch.dtype, distributed: bool) -> bool:
    """Whether a norm saves only its input and ``rstd`` for backward (``_RMSNorm``, or CUDA's fused kernel,
    which saves the same): an fp32 input held as a plain tensor. ``distributed``: the input is a DTensor
    (sequence-parallel norms, q/k norms under tensor parallelism), whose ops DTensor runs decomposed.
    Exact on CPU (``tests/analysis/test_memory.py``); on CUDA PyTorch's fused kernel also takes bf16 inputs
    with bf16 weights, which this rule counts as decomposed (an overestimate there, not yet measured)."""
    return input_dtype == torch.float32 and not distributed


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters and state dict) whose backward is fused where PyTorch's is not."""

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if (weight is None or isinstance(weight, DTensor)
                or not uses_fused_backward(x.dtype, isinstance(x, DTensor)) or torch.compiler.is_compiling()
                or (x.device.type == "cuda" and weight.dtype == x.dtype)):  # CUDA's fused kernels
            return super().forward(x)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        return _RMSNorm.apply(x, weight, eps)


class _RMSNorm(torch.autograd.Function):
    """RMSNorm over the last dim of an fp32 ``x``; ``weight`` fp32 or bf16 (FSDP's gathered copy), whose
    gradient comes back in its own dtype (FSDP reduces it in fp32 from there).

    Each pass over [T, D] costs about as much as the next on CPU (memory-bound), so both directions are
    written to make few: forward reads ``x`` once for its norm and writes ``y``; backward uses
    ``dx = rstd · g_w − x · rstd³ · (g_w · x) / D`` (the same gradient without forming x̂) and gets ``dw`` as
    ``(g · x)ᵀ rstd``, a matrix-vector product.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        dim = x.shape[-1]
        rstd = torch.linalg.vector_norm(x, dim=-1, keepdim=True).square_().div_(dim).add_(eps).rsqrt_()  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return (x * rstd).mul_(weight.float())

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        x, weight, rstd = ctx.saved_tensors
        dim = x.shape[-1]
        grad_normed = grad * weight.float()
        coef = torch.linalg.vecdot(grad_normed, x).unsqueeze(-1).mul_(rstd.pow(3)).div_(-dim)
        grad_x = grad_normed.mul_(rstd).addcmul_(x, coef)
        grad_weight = (grad * x).reshape(-1, dim).mT @ rstd.reshape(-1, 1)
        return grad_x, grad_weight.view(dim).to(weight.dtype), None
