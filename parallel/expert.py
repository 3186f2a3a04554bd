"""Expert parallelism: each ep rank holds E / ep of the routed experts and tokens travel to them by all-to-all.

It plugs into ``MoELayer``'s one seam, the experts module: ``apply_expert_parallel`` replaces each layer's
``GroupedExperts`` with an ``ExpertParallelExperts``, which takes the layer's tokens, its dispatch plan (the local
routing, permutation and capacity drop) and the router's weights, and returns the routed experts' weighted sum.
The model code does not change. With k > 1 and no tensor parallelism the exchange sends a token once per rank its
experts live on (``parallel/expert_dispatch.py``; once per node across nodes, then per rank inside the node, where
the ep group spans nodes: ``parallel/node_dispatch.py``); otherwise it is the row exchange below, one row per kept
assignment, grouped by *global* expert id. One forward, with ep ranks r and local experts l:

    1. counts:   all-to-all of tokens_per_expert [E]: what every rank sends to each of my local experts
    2. splits:   rows to send to / receive from each rank (the one device-to-host sync)
    3. dispatch: uneven all-to-all of the rows; they arrive rank-major  (r0: l0 l1 .., r1: l0 l1 .., ...)
    4. experts:  reorder to local-expert-major (l0: r0 r1 .., l1: ...), grouped GEMM on the local experts
    5. combine:  inverse reorder, reverse all-to-all (splits swapped): each row returns to its sender

With ``parallel.ep_replicas`` > 0 every rank also has replica slots that hot experts are copied into for the
micro-batch, and the row exchange runs over the copies (``parallel/replica_exchange.py``, the plan in
``parallel/replication.py``).

Backward mirrors it through autograd: the all-to-all's gradient is the reverse all-to-all. The exchange moves
exactly the kept assignments (capacity drops happen before it, in ``moe/dispatch.py``): no padding, so the
bytes a rank sends forward are its kept (token, expert) pairs bound for other ranks × d_model × element size.
Any alignment padding a grouped-GEMM backend wants would be added locally, after the exchange.

Shapes: E experts, ep ranks in the expert-parallel group, L = E / ep local experts, N rows sent (kept
assignments of this rank), M rows received, D = d_model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from moe.dispatch import DispatchPlan, permute, unpermute_and_combine
from moe.experts import ComputeCopies, ExpertBiases, GroupedExperts, compute_dtype, expert_ffn
from moe.transformer import MoETransformer
from parallel.expert_dispatch import all_to_all_rows, exchange_pairs
from parallel.layout import Layout
from parallel.node_dispatch import exchange_by_node
from parallel.ranks import expert_nodes
from parallel.replica_exchange import fetch_replicas, join_backward, route_replicas
from parallel.replication import ReplicaPlan
from parallel.tensor import gather_rows, scatter_rows


def expert_major_index(counts: Tensor, num_rows: int | None = None) -> Tensor:
    """Rows of the rank-major received tensor, listed in local-expert-major order.

    counts: [ep, L], ``counts[r, l]`` rows from rank r for local expert l; the received rows are blocks in
    rank-major order (r, then l). Returns ``index`` [M] with ``received[index]`` in expert-major order
    (l, then r), each block keeping its row order. ``num_rows`` (M, when known on the host) avoids a sync.
    """
    sizes = counts.reshape(-1)  # rank-major block sizes
    rank_major_start = (torch.cumsum(sizes, 0) - sizes).view_as(counts)
    sizes_em = counts.t().reshape(-1)  # the same blocks, expert-major
    starts_em = rank_major_start.t().reshape(-1)  # where each expert-major block sits in the received rows
    out_start = torch.cumsum(sizes_em, 0) - sizes_em  # where it goes
    rows = torch.arange(int(sizes.sum()) if num_rows is None else num_rows, device=counts.device)
    return torch.repeat_interleave(starts_em - out_start, sizes_em, output_size=rows.numel()) + rows


def exchanges_pairs(ep: int, tp: int, top_k: int, replicas: int = 0) -> bool:
    """Whether the experts' exchange goes by (token, rank) pairs (``parallel/expert_dispatch.py``) rather than by
    assignment rows: expert parallelism without tensor parallelism, k > 1 (``ExpertParallelExperts.forward`` says
    why), and no replica slots (replicas split an expert's rows over ranks, which a token's pair cannot follow).
    The one rule the layer, the memory model and the communication model follow."""
    return ep > 1 and tp == 1 and top_k > 1 and replicas == 0


def exchanges_by_node(layout: Layout, top_k: int, ranks_per_node: int, replicas: int = 0) -> bool:
    """Whether the pair exchange goes in two hops, once per node across the network, then per rank inside it
    (``parallel/node_dispatch.py``): where it is the pair exchange and the ep groups span nodes of
    ``ranks_per_node`` ranks with several ep ranks in each (``parallel.ranks.expert_nodes``). The one rule the
    layer's construction, the memory model and the communication model follow."""
    return exchanges_pairs(layout.ep, layout.tp, top_k, replicas) and expert_nodes(layout, ranks_per_node) is not None


class _ScaleGradient(torch.autograd.Function):
    """Identity in forward; multiplies the gradient by ``scale`` in backward."""

    @staticmethod
    def forward(ctx, tensor: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.scale, None


@dataclass
class ExchangePlan:
    """One forward's exchange, built by ``plan_exchange`` and used by dispatch and combine of that call only.

    It lives on the stack of ``ExpertParallelExperts.forward``, never on the module, so nothing carries
    from one call to the next (activation checkpointing may re-run a forward; overlapped schedules may
    interleave two).
    """

    send_splits: list[int]  # [ep] rows this rank sends to each ep rank (its experts' share of our kept rows)
    recv_splits: list[int]  # [ep] rows this rank receives from each ep rank
    expert_major: Tensor  # [M] received rows in local-expert-major order (``expert_major_index``)
    rank_major: Tensor  # [M] its inverse: expert-major rows back in the received (rank-major) order
    tokens_per_local_expert: Tensor  # [L] group sizes for the local grouped GEMM


def plan_exchange(tokens_per_expert: Tensor, group: dist.ProcessGroup) -> ExchangePlan:
    """Steps 1-2: exchange per-expert counts over the ep group and derive the splits. tokens_per_expert: [E]."""
    ep = dist.get_world_size(group)
    send_counts = tokens_per_expert.to(torch.int64).contiguous()
    recv_counts = torch.empty_like(send_counts)
    # rank r's slice l of the input is its count for my local expert l: equal splits of L per rank
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    recv_counts = recv_counts.view(ep, -1)  # [ep, L]: rows from rank r for local expert l
    splits = torch.stack([send_counts.view(ep, -1).sum(1), recv_counts.sum(1)])
    # NOTE: the one device-to-host sync of expert parallelism: the collective needs the split sizes as
    # host integers. On GPU it stalls the host until the counts have arrived (FSDP prefetching across it
    # must be set explicitly); the rest of the exchange is launched without waiting.
    send_splits, recv_splits = splits.tolist()
    return exchange_plan(send_splits, recv_splits, recv_counts)


def exchange_plan(send_splits: list[int], recv_splits: list[int], recv_counts: Tensor) -> ExchangePlan:
    """The plan from the splits and the received counts [ep, L] (rows from rank r for local expert l)."""
    expert_major = expert_major_index(recv_counts, sum(recv_splits))
    rank_major = torch.empty_like(expert_major)
    rank_major[expert_major] = torch.arange(expert_major.numel(), device=expert_major.device)
    return ExchangePlan(
        send_splits=send_splits,
        recv_splits=recv_splits,
        expert_major=expert_major,
        rank_major=rank_major,
        tokens_per_local_expert=recv_counts.sum(0),
    )


class ExpertParallelExperts(nn.Module):
    """The routed experts of one MoE layer, spread over the expert-parallel group: ``GroupedExperts``' seam.

    Parameters keep ``GroupedExperts``' names and global shapes ([E, D, H], [E, H, D]) as DTensors
    sharded on dim 0 (``Shard(0)``) over the ep mesh: this rank's local tensors are experts
    [r·L, (r+1)·L). So the state dict is that of the single-process model (``full_tensor()`` gives the
    [E, ...] stack, ``torch.distributed.checkpoint`` saves and reshards it across ep degrees), FSDP2
    composes with it over the expert-data-parallel mesh as it does with tensor parallelism, and a global
    gradient norm counts each expert once (``sharding.clip_grad_norm_``).

    With expert tensor parallelism the mesh is 2-D (ep, etp) and each expert's hidden dim H is split too
    (``Shard(2)`` of ``w_in``/``w_gate``, ``Shard(1)`` of ``w_out``: column- then row-parallel, as for a
    dense FFN): the etp ranks of an ep rank compute partial outputs for the same rows, added when the
    shares are gathered over tp (``parallel/tensor.py``).

    With ep = etp = 1 under tensor parallelism it holds every expert and does no exchange: it only computes
    this tp rank's share of the rows (``parallel/__init__.py`` uses it so, rather than computing every
    row on every tp rank).

    The local grouped GEMM is ``moe.experts.expert_ffn``, the function ``GroupedExperts`` itself runs,
    applied to this rank's local tensors (``DTensor.to_local``, differentiable).
    """

    # where H sits in each stacked weight and bias (``out_bias`` [E, D] has none: see ``__init__``)
    HIDDEN_DIM = {"w_in": 2, "w_gate": 2, "w_out": 1, "in_bias": 1, "gate_bias": 1}

    def __init__(self, experts: GroupedExperts, expert_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None,
                 node_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None, replicas: int = 0):
        super().__init__()
        if expert_mesh.ndim == 2 and expert_mesh.mesh_dim_names == ("ep", "etp"):
            ep_mesh, etp_mesh = expert_mesh["ep"], expert_mesh["etp"]
            if tp_mesh is None or tp_mesh.size() % etp_mesh.size():
                raise ValueError(f"expert tensor parallelism needs a tp mesh that etp={etp_mesh.size()} divides")
        elif expert_mesh.ndim == 1:
            ep_mesh, etp_mesh = expert_mesh, None
        else:
            raise ValueError(f"expert parallelism needs a 1-D ep mesh or a 2-D (ep, etp) mesh, got {expert_mesh}")
        ep, self.etp = ep_mesh.size(), etp_mesh.size() if etp_mesh is not None else 1
        if experts.num_experts % ep:
            raise ValueError(f"parallel.ep={ep} does not divide the {experts.num_experts} experts")
        self.num_experts = experts.num_experts
        self.num_local_experts = experts.num_experts // ep
        self.ep_mesh = ep_mesh
        self.group = ep_mesh.get_group()
        self.tp_mesh = tp_mesh  # tokens replicated over it: each tp rank sends only its share of the rows
        self.node_groups = node_groups  # (in-node, across-node) ep groups: the pair exchange goes in two hops
        # replica slots per rank for hot experts (``parallel.ep_replicas``, ``parallel/replica_exchange.py``); the
        # last forward's plan (its loads per ep rank without and with the replicas give ``ep/imbalance_*``)
        self.replicas = replicas
        self.last_plan: ReplicaPlan | None = None
        if self.etp > 1 and experts.out_bias is not None:
            # the etp ranks' partial outputs of a row are added over tp: each would add the down projection's bias
            raise ValueError(f"parallel.etp={self.etp} with moe.expert_proj_bias: the experts' down-projection "
                             "bias cannot be split over the hidden dim; use etp=1 (expert parallelism alone)")
        first = ep_mesh.get_local_rank() * self.num_local_experts
        etp_rank = etp_mesh.get_local_rank() if etp_mesh is not None else 0
        for name, param in experts.named_parameters():  # [E, ...], identical on every rank (same seed)
            # keep this rank's slice, copied so the full stack can be freed; no communication
            local = param.detach()[first:first + self.num_local_experts]
            placements = [Shard(0)]
            if etp_mesh is not None:
                hidden_dim = self.HIDDEN_DIM[name]
                if param.shape[hidden_dim] % self.etp:
                    raise ValueError(f"parallel.etp={self.etp} does not divide the expert hidden size "
                                     f"{param.shape[hidden_dim]}")
                width = param.shape[hidden_dim] // self.etp
                local = local.narrow(hidden_dim, etp_rank * width, width)
                placements.append(Shard(hidden_dim))
            sharded = DTensor.from_local(local.clone(), expert_mesh, placements, run_check=False)
            self.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
        self.has_gate = experts.w_gate is not None
        self.has_bias = experts.in_bias is not None
        self.clamp = experts.clamp
        self.backend = experts.backend
        # multiplies the weights' gradients: ``parallel.sharding.shard_experts`` sets it where no FSDP unit
        # reduces (and so averages) them. A property of the module, not a hook on the parameters, so it
        # holds when materialising a meta-built model swaps the parameters' data.
        self.grad_scale = 1.0
        self.compute_copies = ComputeCopies()  # of the local slices (``moe.experts.ComputeCopies``)

    takes_routing = True  # ``MoELayer`` hands it the tokens, the plan and the weights (it combines itself)

    def forward(self, tokens: Tensor, plan: DispatchPlan, weights: Tensor) -> Tensor:
        """tokens [T, D] in the experts' compute dtype, ``plan`` (``moe.dispatch.plan_dispatch``), weights [T, k]
        -> the routed experts' weighted sum [T, D], as ``MoELayer``'s permute, experts and combine give it.

        Pure expert parallelism with k > 1 sends a token once per destination rank and combines there
        (``parallel/expert_dispatch.py``). With k = 1 a token has one destination anyway, and the row exchange
        sends no codes or weights; under tensor parallelism each tp rank exchanges a contiguous share of the
        assignment rows (``parallel/tensor.py``), which pairs would cut across. Both keep the row exchange."""
        if exchanges_pairs(self.ep_mesh.size(), 1 if self.tp_mesh is None else self.tp_mesh.size(), weights.shape[1],
                           self.replicas):
            return self.pair_exchange(tokens, plan, weights)
        return self.row_exchange(tokens, plan, weights)

    def pair_exchange(self, tokens: Tensor, plan: DispatchPlan, weights: Tensor) -> Tensor:
        """``forward`` by (token, rank) pairs (``parallel/expert_dispatch.py``); pure expert parallelism only. With
        ``node_groups`` by (token, node) across nodes, then by (token, rank) inside them
        (``parallel/node_dispatch.py``)."""
        if self.node_groups is not None:
            return exchange_by_node(tokens, plan, weights, self.num_local_experts, *self.node_groups, self._local_ffn)
        return exchange_pairs(tokens, plan, weights, self.num_local_experts, self.group, self._local_ffn)

    def row_exchange(self, tokens: Tensor, plan: DispatchPlan, weights: Tensor) -> Tensor:
        """``forward`` by rows, one per kept assignment: permute, exchange, un-permute and combine at home."""
        x = permute(tokens, plan)
        if self.tp_mesh is not None:
            share, share_tokens, bounds = scatter_rows(x, plan.tokens_per_expert, self.tp_mesh, self.etp)
            out = gather_rows(self._exchange_and_compute(share, share_tokens), bounds, self.tp_mesh, self.etp)
        else:
            out = self._exchange_and_compute(x, plan.tokens_per_expert)
        return unpermute_and_combine(out, plan, weights)

    def _local_weights(self) -> dict[str, Tensor]:
        """This rank's slices of the stacked weights (and biases), by name; their gradients scaled by
        ``grad_scale``."""
        out = {}
        for name in ("w_in", "w_gate", "w_out", "in_bias", "gate_bias", "out_bias"):
            weight = getattr(self, name, None)
            if weight is not None:
                tensor = weight.to_local()
                out[name] = _ScaleGradient.apply(tensor, self.grad_scale) if self.grad_scale != 1.0 else tensor
        return out

    def _local_ffn(self, x: Tensor, tokens_per_local_expert: Tensor,
                   weights: dict[str, Tensor] | None = None) -> Tensor:
        """The grouped GEMM on rows grouped by local expert; with ``weights`` (default: ``_local_weights``) on
        other experts' (the replica slots')."""
        w = self._local_weights() if weights is None else weights
        biases = None
        if self.has_bias:
            biases = ExpertBiases(w["in_bias"], w.get("gate_bias"), w["out_bias"])
        return expert_ffn(x, tokens_per_local_expert, w["w_in"], w.get("w_gate"), w["w_out"],
                          self.compute_copies, self.backend, biases=biases, clamp=self.clamp)

    def _exchange_and_compute(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        if self.ep_mesh.size() == 1:  # expert tensor parallelism alone: every expert is here, nothing to send
            return self._local_ffn(x, tokens_per_expert)
        if self.replicas:
            return self._replicated_exchange(x, tokens_per_expert)
        plan = plan_exchange(tokens_per_expert, self.group)
        received = all_to_all_rows(x, plan.send_splits, plan.recv_splits, self.group)  # [M, D] rank-major
        grouped = received.index_select(0, plan.expert_major)  # [M, D] local-expert-major
        out = self._local_ffn(grouped, plan.tokens_per_local_expert)
        # back to rank-major by the inverse order: index_select keeps only the index for backward, where
        # index_copy would keep its whole [M, D] source
        returned = out.index_select(0, plan.rank_major)
        return all_to_all_rows(returned, plan.recv_splits, plan.send_splits, self.group)

    def _replicated_exchange(self, x: Tensor, tokens_per_expert: Tensor) -> Tensor:
        """The row exchange over every rank's own experts and replica slots (``parallel/replica_exchange.py``):
        rows regrouped by copy, the filled slots' weights fetched from their owners in the compute dtype."""
        routing = route_replicas(tokens_per_expert, self.group, self.replicas)
        self.last_plan = routing.plan
        slots, local = None, self._local_weights()
        if any(e >= 0 for filled in routing.plan.slots for e in filled):  # else no rank fetches: no collective
            dtype = compute_dtype(x)
            slots = fetch_replicas({name: self.compute_copies.get(name, weight, dtype)
                                    for name, weight in local.items()}, routing.plan, self.group)
        plan = exchange_plan(routing.send_splits, routing.recv_splits, routing.recv_counts)
        received = all_to_all_rows(x.index_select(0, routing.order), plan.send_splits, plan.recv_splits, self.group)
        grouped = received.index_select(0, plan.expert_major)  # own experts' rows, then the slots'
        counts, own = plan.tokens_per_local_expert, self.num_local_experts
        out = self._local_ffn(grouped[:routing.own_rows], counts[:own], local)
        if routing.filled:
            slot_rows = self._local_ffn(grouped[routing.own_rows:], counts[own:own + routing.filled], slots)
            out = torch.cat([out, slot_rows])
        elif slots is not None:
            out = join_backward(out, slots)
        returned = all_to_all_rows(out.index_select(0, plan.rank_major), plan.recv_splits, plan.send_splits,
                                   self.group)
        return returned.index_select(0, routing.restore)

    def extra_repr(self) -> str:
        ep, rank = self.ep_mesh.size(), self.ep_mesh.get_local_rank()
        first = rank * self.num_local_experts
        etp = f", hidden split over etp={self.etp}" if self.etp > 1 else ""
        return (f"experts {first}..{first + self.num_local_experts - 1} of {self.num_experts} "
                f"(ep rank {rank} of {ep}{etp})")


def apply_expert_parallel(model: MoETransformer, expert_mesh: DeviceMesh, tp_mesh: DeviceMesh | None = None,
                          node_groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None,
                          replicas: int = 0) -> None:
    """Replace every MoE layer's routed experts with their ep-sharded version (in place).

    ``expert_mesh`` is the 1-D ep mesh, or the 2-D (ep, etp) mesh for expert tensor parallelism. With tensor
    parallelism (``tp_mesh``) the layer's tokens are the same on every tp rank; each tp rank (each etp
    group, under expert tensor parallelism) then exchanges and computes a distinct share of the grouped
    rows (``parallel/tensor.py``).

    Call it on the full model every rank built from the same seed, before any FSDP: initialisation is
    then independent of the layout. The router and shared experts stay as they are (replicated, then
    sharded with their block by FSDP). ``node_groups`` (``ParallelGroups.expert_node_groups``, where
    ``exchanges_by_node`` holds): the pair exchange's two hops. ``replicas``: ``parallel.ep_replicas``.
    """
    for layer in model.moe_layers().values():
        layer.experts = ExpertParallelExperts(layer.experts, expert_mesh, tp_mesh, node_groups, replicas)
