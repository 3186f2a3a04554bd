"""What the weights move between ranks in one optimizer step: FSDP2's parameter gathers, gradient reductions and
HSDP all-reduces, and Muon's gathers of whole matrices (``analysis.traffic``'s docstring: which, and why that many).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict

from analysis.memory_states import (
    Block,
    ParamTensor,
    largest_chunk,
    muon_updates,
    rank_blocks,
    root_tensors,
    sharded_numel,
    sharded_numel_of,
)
from analysis.traffic_items import Traffic, _add, _gradient_syncs, _Step
from parallel.layout import Layout
from parallel.sharding import expert_fsdp_dim, experts_replicated, experts_spread


def _fsdp_units(step: _Step) -> dict[tuple[str, int], int]:
    """This rank's FSDP units by kind ("root", "block", "experts", "router") and fp32 shard bytes: how many of each
    (``parallel/sharding.py``). Kinds with nothing to shard are left out: a single expert replica
    (``sharding.shard_experts``), or no data parallelism.

    The routed experts are a unit of their own whenever ``parallel/__init__.py`` wraps them (ep, etp or tp), and
    under bf16 each router is one too, gathered in fp32 while the rest is gathered in bf16.
    """
    config, layout = step.config, step.layout
    vp, has_moe = config.parallel.vocab_parallel, config.model.n_moe_layers > 0
    routers_apart = step.act == 2  # bf16 mixed precision: each router an fp32 unit of its own
    same: dict[tuple[str, int], int] = defaultdict(int)
    root = root_tensors(config.model, config.moe, step.first, step.last)
    if root and layout.dp_cp > 1:
        same["root", 4 * sum(sharded_numel(p, layout, config.model, vp) for p in root)] += 1
    for block, count in rank_blocks(config.model, config.moe, [*step.layers, *step.mtp]):
        for unit in _block_units(block, layout, has_moe, vp, routers_apart):
            same[unit] += count
    return same


@functools.lru_cache(maxsize=65536)
def _block_units(block: Block, layout: Layout, has_moe: bool, vp: bool,
                 routers_apart: bool) -> tuple[tuple[str, int], ...]:
    """One block's FSDP units: (kind, fp32 shard bytes) of each that has something to shard."""
    experts_apart = experts_spread(layout, has_moe)
    units: dict[str, int] = {}
    for param in block.params:
        if param.kind == "router" and routers_apart:
            kind = "router"
        else:
            kind = "experts" if experts_apart and param.expert else "block"
        units[kind] = units.get(kind, 0) + 4 * sharded_numel_of(param, layout, has_moe, vp)
    return tuple((kind, shard) for kind, shard in units.items()
                 if (experts_replicated(layout) if kind == "experts" else layout.dp_cp > 1))


def _gathers(step: _Step, kind: str) -> int:
    """All-gathers of one FSDP unit per step.

    Without pipelining a unit is gathered before each micro-batch's forward and, with
    ``reshard_after_forward``, again before its backward; the root (``reshard_after_forward=False``) only
    before the forward. Under pipelining with ``grad_reduce=step`` the stage keeps its parameters gathered from
    one backward to the next, as torch's ``PipelineStage`` does (``parallel/pipeline.py``), so in GPipe and
    1F1B order a resharding unit is gathered for each forward not right after a backward, and for the first
    backward after each forward: m + 1 times; any other unit once. Under ``microbatch`` every unit reshards
    after each backward, as without pipelining.
    """
    m, reshard = step.microbatches, step.config.parallel.reshard_after_forward and kind != "root"
    if step.layout.pp > 1 and step.config.parallel.grad_reduce == "step":
        return m + 1 if reshard else 1
    return m * (1 + reshard)


def sharding_traffic(step: _Step) -> list[Traffic]:
    """FSDP2 parameter all-gathers, gradient reduce-scatters and HSDP all-reduces of every unit this rank holds.

    Parameters are all-gathered in fp32, or in bf16 under bf16 training (FSDP's mixed precision: every unit
    but the routers'); gradients are reduced in fp32. Each parameter's shard is its sharded dim padded up to a
    multiple of the ranks (FSDP2 pads dim 0); units of the same size are listed together.
    """
    syncs = _gradient_syncs(step)
    same = _fsdp_units(step)  # (kind, fp32 shard bytes) -> units
    out: list[Traffic] = []
    for (kind, shard), units in sorted(same.items()):
        shard_group = step.group("edp" if kind == "experts" else "dp_shard_cp")
        n = len(shard_group)
        what = {"root": "root (embedding, norm, head)", "block": f"{units} block(s)", "router": f"{units} router(s)",
                "experts": f"{units} routed-expert unit(s)"}[kind]
        gathered = shard if kind == "router" else shard * step.act // 4  # in the unit's compute dtype
        _add(out, "fsdp", "all_gather", f"{what}: parameters", units * _gathers(step, kind), gathered * n,
             shard_group)
        _add(out, "fsdp", "reduce_scatter", f"{what}: gradients", units * syncs, shard * n, shard_group)
        # HSDP: FSDP sums the reduce-scattered shards of the micro-batches and all-reduces them once per step
        _add(out, "fsdp", "all_reduce", f"{what}: gradient shards over replicas (HSDP)", units, shard,
             step.group("dp_replicate"))
    return out


def _chunk(size: int, parts: int, index: int) -> int:
    """Chunk ``index`` of ``torch.chunk(size, parts)``: what FSDP leaves that rank (the last ones may be short)."""
    largest = largest_chunk(size, parts)
    return max(0, min(largest, size - index * largest))


def _muon_gathers(param: ParamTensor, step: _Step, has_moe: bool) -> list[tuple[str, list[int]]]:
    """The all-gathers Muon makes to hold ``param``'s matrices whole, in order: (mesh axis, the gathered buffer's
    shape); empty when its matrices are whole on the rank. Each reduce-scatter back mirrors one of them.

    A dense matrix is cut by FSDP's dp_shard × cp (dim 0, padded to equal chunks) and by tp (``tp_dim``); a
    routed-expert stack (dim 0 its experts, a batch) by etp and by FSDP over edp where the local experts do not
    split over edp (``expert_fsdp_dim``: a matrix dim). Cut by two axes, DTensor gathers one after the other
    (``redistribute`` cannot merge them), measured on 4 gloo ranks: along one dim (FSDP's strided shards of a
    column-parallel weight's rows) dp_shard first, the tp gather then moving the whole matrix; along two dims
    (a row-parallel weight, an expert stack under etp and edp) the inner axis first, tp or etp gathering this
    rank's FSDP chunk, then FSDP's axis the whole."""
    layout = step.layout
    shape = list(param.shape)
    if param.expert:
        shape[0] //= layout.ep  # this rank's experts; each matrix whole over ep
        etp_dim = param.expert_hidden_dim if layout.etp > 1 else None
        fsdp_dim = expert_fsdp_dim(shape[0], layout.edp, etp_dim) \
            if experts_spread(layout, has_moe) and experts_replicated(layout) else 0
        inner, inner_parts = ("etp", etp_dim), layout.etp
        outer, outer_parts = ("edp", fsdp_dim or None), layout.edp
    else:
        inner, inner_parts = ("tp", param.tp_dim if layout.tp > 1 else None), layout.tp
        outer, outer_parts = ("dp_shard_cp", 0 if layout.dp_shard_cp > 1 else None), layout.dp_shard_cp
    if outer[1] is None:
        return [(inner[0], shape)] if inner[1] is not None else []
    whole = [*shape]
    whole[outer[1]] = largest_chunk(shape[outer[1]], outer_parts) * outer_parts
    if inner[1] is None:
        return [(outer[0], whole)]
    if inner[1] == outer[1]:  # FSDP's strided shards within each tp shard: gathered first, one tp shard's rows
        rows = largest_chunk(shape[outer[1]] // inner_parts, outer_parts) * outer_parts
        return [(outer[0], [*shape[:outer[1]], rows, *shape[outer[1] + 1:]]), (inner[0], shape)]
    mine = [*shape]
    mine[outer[1]] = _chunk(shape[outer[1]], outer_parts, step.group(outer[0]).index(step.rank))
    return [(inner[0], mine), (outer[0], whole)]


def muon_traffic(step: _Step) -> list[Traffic]:
    """Muon's gathers (``training.muon.orthogonalised``): per optimizer step, for each matrix it updates that a
    mesh axis cuts, an all-gather of its fp32 update over each cutting axis's ranks and a reduce-scatter of the
    fp32 result back to the shards, the same buffers (``_muon_gathers``). None under AdamW."""
    config = step.config
    if config.train.optimizer != "muon":
        return []
    has_moe = config.model.n_moe_layers > 0
    params = [(p, 1) for p in root_tensors(config.model, config.moe, step.first, step.last)]
    params += [(p, count) for block, count in rank_blocks(config.model, config.moe, [*step.layers, *step.mtp])
               for p in block.params]
    same: dict[tuple[str, int], int] = defaultdict(int)  # (axis, gathered fp32 bytes) -> matrices
    for param, count in params:
        for axis, shape in _muon_gathers(param, step, has_moe) if muon_updates(param) else ():
            same[axis, 4 * math.prod(shape)] += count
    out: list[Traffic] = []
    for (axis, buffer), calls in sorted(same.items()):
        group = step.group(axis)
        _add(out, "muon", "all_gather", "Muon: updates gathered for Newton-Schulz", calls, buffer, group)
        _add(out, "muon", "reduce_scatter", "Muon: orthogonalised updates back to the shards", calls, buffer, group)
    return out
