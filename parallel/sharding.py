"""Sharded data parallelism with FSDP2 (``fully_shard``), and the global gradient norm over sharded gradients.

Each transformer block is its own FSDP unit (its parameters are all-gathered just
before it runs and freed after), and the root wraps what is left: embedding, final
norm and head. With ``dp_replicate > 1`` the mesh is 2-D and FSDP2 runs HSDP:
shards within a replica group, gradients all-reduced across replicas.

Under expert parallelism the routed experts of each MoE layer are their own FSDP unit
first, over the expert-data-parallel mesh (dp_replicate, edp) instead of the dense one
(torchtitan's order: experts, then the block that holds router and shared experts).

Parameters stay fp32 (the master weights, what AdamW steps and keeps state for). Under bf16 training FSDP2's
mixed precision (``mixed_precision``) all-gathers every unit's weights in bf16 and computes with them, and
reduce-scatters the gradients in fp32: no unit's weights are cast again per matmul, nor kept as cast copies
until backward (what autocast does with fp32 weights). Each router is then an fp32 unit of its own, since
routing must see fp32 weights (``moe/router.py``). Autocast stays on around the model for the ops it runs in
fp32 (norms, softmax) and for the weights outside FSDP (experts spread over every rank, and tp without dp).

Under gradient accumulation ``set_gradient_sync`` decides, before each micro-batch's backward, whether
FSDP reduces the gradients it produces (``parallel.grad_reduce``): ``step`` reduces once per optimizer
step, on the last micro-batch; before it each unit keeps its unsharded gradients (the tp-local, fp32
``.grad`` of its unsharded parameters, which FSDP2 accumulates into and reduce-scatters on the last
backward). ``microbatch`` reduce-scatters every micro-batch (ZeRO-3: only sharded gradients are held) and,
under HSDP, sums the shards locally until the last micro-batch's all-reduce over the replicas. The sum is
linear, so both give the same gradients; the experts outside FSDP (one expert replica) communicate nothing
either way.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from moe.transformer import MoETransformer
from parallel.layout import Layout


def shard_experts(model: MoETransformer, expert_dp_mesh: DeviceMesh | None, dp_size: int,
                  reshard_after_forward: bool = True, param_dtype: torch.dtype | None = None) -> set[nn.Parameter]:
    """Make each layer's ep-sharded experts reduce their gradients to those of the global mean loss.

    After the all-to-all's backward, an expert's gradient on its ep rank is the SUM over the ranks
    of its ep group of their local mean losses' gradients (under tensor parallelism, of their shares
    of them: the tp ranks of one data-parallel rank send disjoint rows). The global loss is the mean over all
    ``dp_size`` data-parallel ranks, so the gradient is the sum over the expert's replicas (the
    expert-data-parallel ranks, dp_replicate × edp) divided by ``dp_size``: averaged over edp, never
    over ep, with the data-parallel size as the divisor.

    With several replicas FSDP2 shards each layer's experts over ``expert_dp_mesh`` (1-D edp, or 2-D
    (dp_replicate, edp) for HSDP). FSDP averages over that mesh, i.e. divides by dp_replicate × edp;
    an all-reduce hook scales by mesh size / dp (without tp: divides by ep). This, rather than
    ``set_gradient_divide_factor(dp)``, keeps to the reductions every backend has: on gloo a custom
    factor needs ``set_force_sum_reduction_for_comms``, and torch 2.13 then divides twice when the
    shard group has one rank (HSDP with edp = 1). With a single replica (``expert_dp_mesh`` None: ep
    spans all of dp_shard × tp) there is nothing to shard or reduce: the experts stay out of FSDP and their
    module divides their gradients (``ExpertParallelExperts.grad_scale``). Returns the parameters FSDP must
    leave alone in the dense units
    (empty in the first case: FSDP already owns them).
    """
    unmanaged: set[nn.Parameter] = set()
    for layer in model.moe_layers().values():
        experts = layer.experts
        if expert_dp_mesh is None:
            experts.grad_scale = 1.0 / dp_size
            unmanaged.update(experts.parameters())
            continue
        def placement(param: Tensor, local: int = experts.num_local_experts, edp: int = expert_dp_mesh.size(-1)):
            return Shard(expert_fsdp_dim(local, edp, _etp_dim(param)))

        fully_shard(experts, mesh=expert_dp_mesh, shard_placement_fn=placement,
                    reshard_after_forward=reshard_after_forward, mp_policy=mixed_precision(param_dtype))
        # FSDP divided by the replicas; the global mean needs dp_size. With tp folded in, the replicas can
        # outnumber the data-parallel ranks (edp = dp_shard·tp/ep), so this factor may exceed one.
        factor = expert_dp_mesh.size() / dp_size
        if factor != 1:
            experts.set_all_reduce_hook(lambda reduced, factor=factor: reduced.mul_(factor))
    return unmanaged


def experts_spread(layout: Layout, has_moe_layers: bool) -> bool:
    """Whether the routed experts become ``parallel.expert.ExpertParallelExperts`` (ep, etp or tp > 1).

    With tp alone the rows are still shared out over tp, each tp rank computing its share. Such experts
    are then their own FSDP unit over edp (``shard_experts``), apart from their block. The one rule that
    ``parallelize`` applies and the memory and communication models count.
    """
    return has_moe_layers and (layout.ep > 1 or layout.etp > 1 or layout.tp > 1)


def experts_replicated(layout: Layout) -> bool:
    """Whether routed experts in their own unit (``experts_spread``) have several replicas for FSDP to shard over
    (dp_replicate × edp > 1). With one they stay out of FSDP: ep (× etp) then spans dp_shard × tp."""
    return layout.dp_replicate * layout.edp > 1


def expert_fsdp_dim(num_local_experts: int, edp: int, etp_dim: int | None) -> int:
    """The dim of an expert stack [E/ep, ...] that FSDP shards over the edp ranks.

    The experts dim when it splits evenly over edp, else the first dim that expert tensor parallelism
    (``etp_dim``, None without it) leaves whole (torchtitan: dim 1). Used by ``shard_experts`` and the
    memory model alike.
    """
    if num_local_experts % edp == 0:
        return 0
    return next(dim for dim in (1, 2) if dim != etp_dim)


def _etp_dim(param: Tensor) -> int | None:
    """The dim expert tensor parallelism shards in a stack's placements (after the experts dim), if any."""
    if not isinstance(param, DTensor):
        return None
    return next((p.dim for p in param.placements if isinstance(p, Shard) and p.dim > 0), None)


def mixed_precision(param_dtype: torch.dtype | None) -> MixedPrecisionPolicy:
    """FSDP2's policy for ``param_dtype`` compute: weights all-gathered and computed in it, gradients reduced in fp32.

    The sharded parameters stay fp32 (the optimizer's master weights), so AdamW steps and keeps fp32 state;
    None (or fp32) keeps everything fp32.
    """
    if param_dtype in (None, torch.float32):
        return MixedPrecisionPolicy()
    # inputs are not cast: a block's hidden states arrive in bf16 anyway (the embedding computes in it), and the
    # rotary tables passed beside them must stay fp32
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)


def apply_fsdp(model: MoETransformer, mesh: DeviceMesh, reshard_after_forward: bool = True,
               ignored_params: set[nn.Parameter] | None = None, param_dtype: torch.dtype | None = None) -> None:
    """Shard ``model`` in place over ``mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP), computing in ``param_dtype``.

    Gradients are averaged over the mesh, which with every rank's loss a mean over its
    own equal share of the global batch gives the gradient of the global mean loss.
    Parameters already in an FSDP unit (the routed experts under expert parallelism)
    are skipped by FSDP itself; ``ignored_params`` are left alone entirely. Under a bf16 ``param_dtype`` each
    router is an fp32 unit of its own first: routing must see fp32 weights (``moe/router.py``).
    """
    policy = mixed_precision(param_dtype)
    if policy.param_dtype is not None:
        for layer in model.moe_layers().values():
            fully_shard(layer.router, mesh=mesh, reshard_after_forward=reshard_after_forward,
                        ignored_params=ignored_params, mp_policy=mixed_precision(None))
    # a unit per block, and per multi-token-prediction module (its block with the 2d x d projection and norms)
    for block in [*model.layers.values(), *(model.mtp or [])]:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored_params,
                    mp_policy=policy)
    # the root's parameters (embedding, norm, head) are needed again right after forward: keep them
    fully_shard(model, mesh=mesh, reshard_after_forward=False, ignored_params=ignored_params, mp_policy=policy)


GRAD_REDUCE = ("step", "microbatch")


def set_gradient_sync(model: nn.Module, grad_reduce: str, last: bool) -> None:
    """Set, before a micro-batch's backward, which gradient collectives FSDP runs in it.

    ``last``: the step's last micro-batch (or its only one). Every FSDP unit inside ``model`` is set, the
    root or not (the experts' units over edp have their own mesh): the reduce-scatter runs on the last
    micro-batch under ``step`` and on every one under ``microbatch``; HSDP's all-reduce over the replicas
    only on the last (FSDP2 sums the reduce-scattered shards until then). Without FSDP nothing changes.
    """
    if grad_reduce not in GRAD_REDUCE:
        raise ValueError(f"parallel.grad_reduce={grad_reduce!r} is not one of {', '.join(GRAD_REDUCE)}")
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_requires_gradient_sync(last or grad_reduce == "microbatch", recurse=False)
            module.set_requires_all_reduce(last, recurse=False)


def _mesh_key(tensor: Tensor) -> object:
    return tensor.device_mesh if isinstance(tensor, DTensor) else None


@torch.no_grad()
def sum_partial_gradients(parameters: Iterable[nn.Parameter]) -> None:
    """Make whole, in place, the gradients that DTensor left partial over tp (``parallel/tensor.py``): those of the
    replicated weights that see part of the activations (the sequence-parallel norms and hyper-connections a
    sequence slice, the per-head norms this rank's heads). Under FSDP its gradient reduction has made them whole
    already. Otherwise one all-reduce per mesh of their concatenation, once per step, before the gradient norm:
    left partial, the norm and then the optimizer would each all-reduce every one of them on its own."""
    partial: dict[tuple[DeviceMesh, torch.dtype], list[nn.Parameter]] = {}
    for param in parameters:
        grad = param.grad
        if isinstance(grad, DTensor) and grad.placements == (Partial(),) and param.placements == (Replicate(),):
            partial.setdefault((grad.device_mesh, grad.dtype), []).append(param)
    for (mesh, _), params in partial.items():
        locals_ = [param.grad.to_local() for param in params]
        summed = torch.cat([g.flatten() for g in locals_])
        dist.all_reduce(summed, group=mesh.get_group())
        for param, local, whole in zip(params, locals_, summed.split([g.numel() for g in locals_]), strict=True):
            param.grad = DTensor.from_local(whole.view_as(local), mesh, [Replicate()], run_check=False)


@torch.no_grad()
def clip_grad_norm_(parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float = 2.0,
                    pp_group: dist.ProcessGroup | None = None, copies: Iterable[nn.Parameter] = ()) -> Tensor:
    """Clip gradients to a global ``norm_type``-norm of at most ``max_norm``; returns the norm before clipping.

    ``torch.nn.utils.clip_grad_norm_`` stacks per-tensor norms into one tensor, which fails for
    DTensors on different meshes (dense FSDP shards and the ep-sharded experts). Here the norm is
    taken per mesh, made a full (reduced) value there, then combined: every shard counts exactly
    once, replicas not at all. Under pipeline parallelism each rank holds only its stages'
    parameters, so the stages' norms are combined over ``pp_group`` (sum of p-th powers; max for
    the inf-norm). ``copies``, parameters among ``parameters`` that another stage holds too with the same
    gradient (the last stage's embedding under multi-token prediction), are clipped but not counted: the
    original counts them once. Returns a plain scalar tensor, the same on every rank.

    Clipping multiplies every gradient by ``min(1, max_norm / (norm + 1e-6))``, computed on the device so
    that no host sync is needed (PyTorch's design), and so a full pass over the gradients even when the factor
    is 1, as it is for most steps of a run. On CPU reading the norm costs nothing: there the pass is skipped
    when the factor is 1.
    """
    by_mesh: dict[object, list[nn.Parameter]] = {}
    for param in parameters:
        if param.grad is not None:
            by_mesh.setdefault(_mesh_key(param.grad), []).append(param)
    uncounted = {id(param) for param in copies}
    norms = []
    for group in by_mesh.values():
        counted = [p.grad for p in group if id(p) not in uncounted]
        if not counted:
            continue
        norm = torch.nn.utils.get_total_norm(counted, norm_type)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type) if norms else torch.zeros(())
    if pp_group is not None:
        total = _combine_over_stages(total, norm_type, pp_group)
    if max_norm < math.inf and (total.device.type != "cpu" or float(total) + 1e-6 >= max_norm):
        for group in by_mesh.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _combine_over_stages(norm: Tensor, norm_type: float, pp_group: dist.ProcessGroup) -> Tensor:
    """The norm over all pipeline stages from each stage's own ``norm_type``-norm."""
    if math.isinf(norm_type):
        out = norm.clone()
        dist.all_reduce(out, op=dist.ReduceOp.MAX, group=pp_group)
        return out
    out = norm.pow(norm_type)
    dist.all_reduce(out, group=pp_group)
    return out.pow(1.0 / norm_type)
