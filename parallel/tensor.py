"""Tensor parallelism: each tp rank holds a slice of every attention and feed-forward matrix.

``apply_tensor_parallel`` hands each block to DTensor's ``parallelize_module`` with Megatron's pairing
(Shoeybi et al. 2019, sec. 3): a column-parallel projection followed by a row-parallel one, so one
all-reduce per pair in forward (after the row-parallel output) and one in backward (at the
column-parallel input).

- attention: ``wq``, ``wk``, ``wv`` column-parallel, i.e. split by heads (tp divides both head counts;
  ``Attention.forward`` reshapes with ``-1`` heads, so it runs on its nh / tp local heads unchanged);
  ``wo`` row-parallel.
- dense SwiGLU FFN and the MoE layer's shared experts: ``w_in`` and ``w_gate`` column-parallel (split on
  the hidden dim), ``w_out`` row-parallel.
- the router, norms, embedding and head stay whole on every tp rank. The router in particular must see
  the full hidden vector in fp32 so every tp rank routes identically (``moe/router.py``).

Activations between the pairs are replicated over the tp group (no sequence parallelism here), so the
tokens entering an MoE layer are the same on every tp rank. Expert parallelism folds over tp ranks;
sending those tokens once per tp rank would multiply the all-to-all by tp. ``scatter_rows`` and
``gather_rows`` prevent it: each tp rank takes a distinct 1/tp share of the layer's grouped rows
(contiguous, so still grouped by expert), exchanges and computes only that share, and the shares are
all-gathered over tp afterwards. The expert all-to-all then moves exactly the kept assignments once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from moe.transformer import MoETransformer


def _feed_forward_plan(prefix: str) -> dict:
    return {f"{prefix}.w_in": ColwiseParallel(), f"{prefix}.w_gate": ColwiseParallel(),
            f"{prefix}.w_out": RowwiseParallel()}


def apply_tensor_parallel(model: MoETransformer, tp_mesh: DeviceMesh) -> None:
    """Shard every block's attention, dense FFN and shared experts over ``tp_mesh`` (in place).

    The sharded weights become DTensors on the tp mesh with the single-process names and global shapes, so
    FSDP2 composes with them (2-D: dp shards of tp shards) and the state dict is the unsharded one.
    """
    for block in model.layers.values():
        plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel()}
        if block.ffn is not None:
            plan.update(_feed_forward_plan("ffn"))
        elif block.moe.shared_experts is not None:
            plan.update(_feed_forward_plan("moe.shared_experts"))
        parallelize_module(block, tp_mesh, plan)


# ---------------------------------------------------------------------------
# Rows of a replicated tensor, shared out over the tp group
# ---------------------------------------------------------------------------


def row_bounds(num_rows: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` contiguous shares of ``num_rows`` rows, sizes differing by at most one."""
    return [i * num_rows // parts for i in range(parts + 1)]


def share_counts(tokens_per_expert: Tensor, start: int, stop: int) -> Tensor:
    """Rows per expert inside rows [start, stop) of a tensor grouped by expert with these group sizes."""
    ends = torch.cumsum(tokens_per_expert, 0)
    begins = ends - tokens_per_expert
    return (ends.clamp(start, stop) - begins.clamp(start, stop)).to(tokens_per_expert.dtype)


def _all_gather_rows(part: Tensor, bounds: list[int], ranks_per_share: int, group: dist.ProcessGroup) -> Tensor:
    """Every share on every rank: [share, D] -> [bounds[-1], D], share sizes from ``bounds``.

    ``ranks_per_share`` consecutive ranks hold parts of the same share (expert tensor parallelism: each a
    partial sum over its slice of the expert hidden dim); their parts are added, in rank order, so every
    rank gets the same bits.
    """
    sizes = [stop - start for start, stop in zip(bounds, bounds[1:], strict=False)]
    padded = part.new_zeros(max(sizes), *part.shape[1:])
    padded[:part.shape[0]] = part
    parts = [torch.empty_like(padded) for _ in range(len(sizes) * ranks_per_share)]
    dist.all_gather(parts, padded, group=group)
    shares = []
    for index, size in enumerate(sizes):
        share = parts[index * ranks_per_share][:size]
        for other in parts[index * ranks_per_share + 1:(index + 1) * ranks_per_share]:
            share = share + other[:size]
        shares.append(share)
    return torch.cat(shares)


class _ScatterRows(torch.autograd.Function):
    """Forward: keep this rank's share of a tp-replicated tensor. Backward: all-gather the shares' gradients.

    Each share's gradient exists only on the ranks holding it (partial sums, one per expert-tensor-parallel
    rank); the all-gather adds those and makes the replicated input's gradient whole (and again identical)
    on every tp rank.
    """

    @staticmethod
    def forward(ctx, x, bounds, share, ranks_per_share, group):
        ctx.bounds, ctx.ranks_per_share, ctx.group = bounds, ranks_per_share, group
        return x[bounds[share]:bounds[share + 1]]

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_rows(grad.contiguous(), ctx.bounds, ctx.ranks_per_share, ctx.group), None, None, None, None


class _GatherRows(torch.autograd.Function):
    """Forward: all-gather (and add the partial sums of) the shares into the replicated whole.

    Backward: keep this rank's share of the gradient. The whole's gradient is identical on every tp rank (the
    layers after it are replicated or tensor parallel), and each partial sum gets the gradient of the sum,
    so no communication is needed; a reduce-scatter would count it tp times.
    """

    @staticmethod
    def forward(ctx, part, bounds, share, ranks_per_share, group):
        ctx.bounds, ctx.share = bounds, share
        return _all_gather_rows(part.contiguous(), bounds, ranks_per_share, group)

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.bounds[ctx.share]:ctx.bounds[ctx.share + 1]], None, None, None, None


def scatter_rows(x: Tensor, tokens_per_expert: Tensor, tp_mesh: DeviceMesh,
                 ranks_per_share: int = 1) -> tuple[Tensor, Tensor, list[int]]:
    """This tp rank's share of rows grouped by expert: x [N, D] -> ([n, D], its tokens per expert [E], bounds).

    The rows are cut into tp / ``ranks_per_share`` contiguous shares (so each stays grouped by expert);
    ``ranks_per_share`` consecutive tp ranks (an expert-tensor-parallel group) hold the same share.
    ``bounds`` is what ``gather_rows`` needs.
    """
    share = tp_mesh.get_local_rank() // ranks_per_share
    bounds = row_bounds(x.shape[0], tp_mesh.size() // ranks_per_share)
    part = _ScatterRows.apply(x, bounds, share, ranks_per_share, tp_mesh.get_group())
    return part, share_counts(tokens_per_expert, bounds[share], bounds[share + 1]), bounds


def gather_rows(part: Tensor, bounds: list[int], tp_mesh: DeviceMesh, ranks_per_share: int = 1) -> Tensor:
    """Every tp rank's share, in order (parts of one share added): [n, D] -> [N, D], identical on every tp rank."""
    share = tp_mesh.get_local_rank() // ranks_per_share
    return _GatherRows.apply(part, bounds, share, ranks_per_share, tp_mesh.get_group())
