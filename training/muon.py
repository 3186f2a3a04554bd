"""Muon for an MoE: orthogonalised momentum for hidden matrices, one expert at a time; AdamW for the rest.

Muon (Jordan et al. 2024) replaces each hidden matrix's update by the nearest semi-orthogonal matrix to its
momentum, found by a quintic Newton–Schulz iteration. Liu et al. 2025 ("Muon is Scalable for LLM Training",
sec. 2.2) add decoupled weight decay and scale the orthogonalised update by ``0.2 * sqrt(max(A, B))`` for an
``A x B`` matrix, so that its RMS is 0.2, about AdamW's: AdamW's learning rate and weight decay then carry over.

The math is ``torch.optim.Muon``'s (``adjust_lr_fn="match_rms_adamw"``), step for step: the momentum buffer is
an average (``buf.lerp_(grad, 1 - momentum)``), Nesterov's look-ahead ``grad.lerp(buf, momentum)``, the
iteration in bf16 with the coefficients (3.4445, -4.7750, 2.0315) on the matrix scaled to unit Frobenius norm
and transposed to be wide, and ``param *= 1 - lr * weight_decay`` before ``param -= lr * scale * O``. The
iteration is written here rather than called because ``torch.optim.Muon`` takes only 2-D parameters: a routed
expert stack ``[experts, in, out]`` is a batch of ``experts`` matrices, each orthogonalised alone (one matrix
per expert is what each expert computes with; orthogonalising the stack flattened to ``[experts * in, out]``
would couple the experts' updates). The batched form does each Newton–Schulz iteration for all experts in one
``baddbmm`` instead of ``experts`` small calls. The AdamW groups use ``torch.optim.adam.adam`` with decoupled
weight decay, exactly ``torch.optim.AdamW``'s update, so that one optimizer holds all the state and a
checkpoint (``torch.distributed.checkpoint``'s optimizer state dict) saves and restores it whole.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim.adam import adam

# Jordan et al. 2024's quintic coefficients, the ones torch.optim.Muon uses
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7  # the floor of the Frobenius norm the matrix is divided by (torch.optim.Muon's eps)


def newton_schulz(update: torch.Tensor, steps: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The approximate orthogonalisation ``U S' V^T`` of each matrix in ``update`` ``[..., A, B]`` (``U S V^T``
    its SVD, ``S'`` near 1), iterated and returned in ``dtype`` with the same shape.

    bf16 is torch.optim.Muon's choice; it also makes the result chaotic in the last bits: a change of one unit
    in the 7th digit of one gradient element (another reduction order) flips some bf16 roundings, and five
    iterations spread them, so two layouts' updates part by bf16's resolution (measured: final weights 9e-4
    apart after 5 steps at lr 1e-2, where fp32 iterations keep them within 1.2e-7).

    Leading dimensions are a batch (the experts of a stack): each matrix is normalised by its own Frobenius norm
    and iterated alone, so a batch gives what each matrix would give by itself.
    """
    a, b, c = NS_COEFFICIENTS
    rows, cols = update.shape[-2:]
    x = update.reshape(-1, rows, cols).to(dtype)
    tall = rows > cols
    if tall:  # iterate on the wide orientation: the Gram matrix X X^T is then the smaller one
        x = x.transpose(-2, -1)
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=NS_EPS)
    for _ in range(steps):
        gram = x @ x.transpose(-2, -1)
        polynomial = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b * G + c * G^2
        x = torch.baddbmm(x, polynomial, x, beta=a)  # a * X + (b * G + c * G^2) X
    if tall:
        x = x.transpose(-2, -1)
    return x.reshape(update.shape)


def orthogonalised(update: torch.Tensor, steps: int, index: int, dtype: torch.dtype) -> torch.Tensor:
    """``newton_schulz`` of ``update``, which may be a shard (a DTensor), returned with ``update``'s dtype and
    placements; ``index`` is the matrix's position in the optimizer's order (the same on every rank); ``dtype``
    Newton–Schulz's.

    Newton–Schulz needs each whole matrix: on a shard it would compute another update. So the mesh dimensions
    that cut a matrix's last two dimensions (FSDP's dp_shard, tensor and expert tensor parallelism) are
    all-gathered; one rank of them, chosen by ``index`` round the ranks, orthogonalises it, and the others pass
    zeros; a reduce-scatter back to the update's placements then sums each shard of the result from one nonzero
    term, exactly (Liu et al. 2025's distributed Muon assembles the matrix on the data-parallel ranks alike; the
    orthogonalisation's work is spread as Dion and Megatron-Core's distributed Muon spread it, one matrix per
    rank). A dimension that splits only the experts of a stack (expert parallelism) leaves each local matrix
    whole: those are orthogonalised in place, with no communication.

    FSDP over a tensor-parallel weight shards each tp shard again along the same dimension: ``_StridedShard`` on
    dp_shard, then ``Shard`` on tp. On torch 2.13 ``_StridedShard`` is not a ``Shard`` (nor ``is_shard()``), so it
    is named here: missed, only tp would be gathered, and DTensor cannot unshard tp beneath a strided dp_shard
    (it fails in ``_maybe_unpad_tensor``, the gathered rows fewer than the logical size it expects).
    """
    if not isinstance(update, DTensor):
        return newton_schulz(update, steps, dtype).to(update.dtype)
    mesh, placements = update.device_mesh, update.placements
    matrix_dims = {update.dim() - 2, update.dim() - 1}
    cutting = [i for i, p in enumerate(placements)
               if isinstance(p, Shard | _StridedShard) and p.dim % update.dim() in matrix_dims]
    if not cutting:
        local = newton_schulz(update.to_local(), steps, dtype).to(update.dtype)
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=update.shape,
                                  stride=update.stride())
    whole = update.redistribute(mesh, [Replicate() if i in cutting else p for i, p in enumerate(placements)])
    coordinate = mesh.get_coordinate()
    position = 0
    for i in cutting:  # this rank's place among the ranks that hold pieces of the same matrices
        position = position * mesh.size(i) + coordinate[i]
    ranks = math.prod(mesh.size(i) for i in cutting)
    local = whole.to_local()
    mine = index % ranks == position
    result = newton_schulz(local, steps, dtype).to(update.dtype) if mine else torch.zeros_like(local)
    summed = DTensor.from_local(result, mesh, [Partial() if i in cutting else p for i, p in enumerate(placements)],
                                run_check=False, shape=update.shape, stride=update.stride())
    return summed.redistribute(mesh, placements)


def update_scale(shape: torch.Size, update_rms: float) -> float:
    """The factor on the orthogonalised update of a matrix ``shape[-2:] = (A, B)``: ``update_rms * sqrt(max(A, B))``.

    A semi-orthogonal ``A x B`` matrix has RMS ``1 / sqrt(max(A, B))``, so this gives the update RMS
    ``update_rms`` whatever the shape (Liu et al. 2025, sec. 2.2, with 0.2).
    """
    return update_rms * math.sqrt(max(shape[-2], shape[-1]))


class Muon(torch.optim.Optimizer):
    """One optimizer for a whole model: groups with ``use_muon`` True take Muon's update (a parameter's last two
    dimensions are the matrix, any leading ones a batch of matrices), the others AdamW's.

    ``momentum``, ``nesterov``, ``ns_steps``, ``update_rms`` and ``ns_dtype`` are Muon's; ``betas`` and ``eps``
    AdamW's; ``lr`` and ``weight_decay`` both's (decoupled: ``param *= 1 - lr * weight_decay``).
    """

    def __init__(self, params, lr: float, weight_decay: float, momentum: float = 0.95, nesterov: bool = True,
                 ns_steps: int = 5, update_rms: float = 0.2, ns_dtype: torch.dtype = torch.bfloat16,
                 betas: tuple[float, float] = (0.9, 0.95),
                 eps: float = 1e-8) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                        update_rms=update_rms, ns_dtype=ns_dtype, betas=betas, eps=eps, use_muon=False)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for param in group["params"]:
                if group["use_muon"] and param.dim() < 2:
                    raise ValueError(f"Muon orthogonalises matrices, but got a parameter of shape "
                                     f"{tuple(param.shape)}; give it to an AdamW group (use_muon=False)")

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                self._muon(group, params)
            else:
                self._adamw(group, params)
        return loss

    def _muon(self, group: dict, params: list[torch.Tensor]) -> None:
        lr, momentum = group["lr"], group["momentum"]
        for index, param in enumerate(params):
            grad = param.grad
            state = self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buffer = state["momentum_buffer"]
            buffer.lerp_(grad, 1 - momentum)
            update = grad.lerp(buffer, momentum) if group["nesterov"] else buffer
            orthogonal = orthogonalised(update, group["ns_steps"], index, group["ns_dtype"])
            param.mul_(1 - lr * group["weight_decay"])
            param.add_(orthogonal, alpha=-lr * update_scale(param.shape, group["update_rms"]))

    def _adamw(self, group: dict, params: list[torch.Tensor]) -> None:
        exp_avgs, exp_avg_sqs, steps = [], [], []
        for param in params:
            state = self.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param)
                state["exp_avg_sq"] = torch.zeros_like(param)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adam(params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps, foreach=False,
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
