"""What the activations and their gradients move between ranks in one optimizer step, per parallel dimension:
tp, cp, ep, pp and the multi-token-prediction modules (``analysis.traffic``'s docstring: which collectives, and why
that many).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections import defaultdict

import torch

from analysis.dispatch_reach import exchange_counts, node_exchange_counts
from analysis.memory_states import rank_blocks, root_tensors, sharded_numel
from analysis.traffic_items import Traffic, _add, _gradient_syncs, _Step, coordinates
from config.run import RunConfig
from moe.attention import GatedDeltaAttention, GroupedQueryAttention, attention_kind
from moe.dispatch import expert_capacity
from moe.hyper_connections import HyperConnection, HyperHead
from parallel.expert import exchanges_by_node, exchanges_pairs
from parallel.ranks import expert_nodes
from parallel.replication import ReplicaPlan, rows_to_copies, weight_moves
from parallel.tensor import row_bounds, share_counts


def kept_per_expert(config: RunConfig, tokens: int) -> list[int]:
    """Assignments each expert keeps from ``tokens`` tokens under balanced (round-robin) routing.

    Assignment t·k + j goes to expert (t·k + j) mod E (``moe.router.TopKRouter._round_robin``), so every
    expert gets T·k/E to within one; the capacity ``ceil(cf·k·T/E)`` then caps it (``moe/dispatch.py``).
    """
    moe = config.moe
    slots = tokens * moe.top_k
    counts = [slots // moe.num_experts + (e < slots % moe.num_experts) for e in range(moe.num_experts)]
    if moe.capacity_factor is None:
        return counts
    capacity = expert_capacity(tokens, moe.top_k, moe.num_experts, moe.capacity_factor)
    return [min(c, capacity) for c in counts]


def _moe_recompute(step: _Step) -> int:
    """1 when backward re-runs the MoE layers' forward (activation checkpointing ``full`` or ``moe``), else 0."""
    return int(step.config.parallel.activation_checkpointing in ("full", "moe"))


def tensor_parallel_traffic(step: _Step) -> list[Traffic]:
    """Activation collectives over the tp group (``analysis.traffic``'s docstring: which, and why that many): the
    attention and FFN pairs of every block, the MoE layers', the norm weights' gradients, the embedding's and the
    head's, in that order."""
    out: list[Traffic] = []
    if step.layout.tp == 1:
        return out
    model = step.config.model
    full_recompute = int(step.config.parallel.activation_checkpointing == "full")
    dense_layers = [i for i in step.layers if not model.is_moe_layer(i)]
    _tp_pair(out, step, "attention", len(step.layers), full_recompute)
    _tp_pair(out, step, "dense FFN", len(dense_layers), 0)  # early-stopping recompute ends before the FFN's output
    _tp_moe(out, step)
    _tp_norm_gradients(out, step)
    _tp_embedding_and_head(out, step)
    return out


def _tp_pair(out: list[Traffic], step: _Step, what: str, n_layers: int, recompute_out: int) -> None:
    """A column- then row-parallel pair on the stream of ``n_layers`` blocks: attention or a SwiGLU FFN (its output
    collective repeated in backward when ``recompute_out``, its input's under full recompute)."""
    model, par = step.config.model, step.config.parallel
    m, group, sp, fp32, act = step.microbatches, step.group("tp"), par.sequence_parallel, 4, step.act
    full = step.tokens * model.d_model  # elements of one [micro, S, D] stream
    runs = n_layers * m * (1 + int(par.activation_checkpointing == "full"))
    if sp:
        _add(out, "tp", "all_gather", f"{what} input sequence (forward)", runs, full * fp32, group)
        _add(out, "tp", "reduce_scatter", f"{what} output (forward)",
             n_layers * m * (1 + recompute_out), full * act, group)
        _add(out, "tp", "all_gather", f"{what} output gradient (backward)", n_layers * m, full * act, group)
    else:
        _add(out, "tp", "all_reduce", f"{what} output (forward)", n_layers * m * (1 + recompute_out),
             full * act, group)
    if what == "attention":
        _attention_input_gradients(out, step)
        return
    _add(out, "tp", "reduce_scatter" if sp else "all_reduce", f"{what} input gradient (backward)",
         n_layers * m, full * fp32, group)


def _attention_kinds(step: _Step) -> dict[type, int]:
    """This rank's attention layers (its blocks', the multi-token-prediction modules' among them) by kind."""
    kinds: dict[type, int] = {}
    for block, count in rank_blocks(step.config.model, step.config.moe, list(step.layers)):
        kind = attention_kind(block.layer)
        kinds[kind] = kinds.get(kind, 0) + count
    return kinds


def _attention_input_gradients(out: list[Traffic], step: _Step) -> None:
    """Each attention kind's input gradient under tp, as the kind states it (``input_gradient_sums``): the block
    input's, reduced as any column-parallel input's (fp32), or, where the input's gradient is whole on every rank
    (latent attention, ``parallel/tensor.py``), the sums of the inputs each rank's heads use in part, in the
    activations' dtype (counted: under bf16 autocast the column-parallel projections reduce their input's gradient
    before it is cast back to fp32, and RoPE returns its input's dtype)."""
    model, m, group, act = step.config.model, step.microbatches, step.group("tp"), step.act
    sp = step.config.parallel.sequence_parallel
    for kind, n_layers in _attention_kinds(step).items():
        sums = kind.input_gradient_sums(model)
        if sums is None:
            _add(out, "tp", "reduce_scatter" if sp else "all_reduce", "attention input gradient (backward)",
                 n_layers * m, step.tokens * model.d_model * 4, group)
            continue
        for name, width in sums:
            _add(out, "tp", "all_reduce", f"attention {name} gradient (backward)", n_layers * m,
                 step.tokens * width * act, group)
    runs = m * (1 + int(step.config.parallel.activation_checkpointing == "full"))
    for kind, n_layers in _attention_kinds(step).items():  # what a kind sums over tp in forward, in fp32
        for name, width in kind.forward_sums(model):
            _add(out, "tp", "all_reduce", f"attention {name} (forward)", n_layers * runs, step.tokens * width * 4,
                 group)


def _tp_moe(out: list[Traffic], step: _Step) -> None:
    """The MoE layers' tp collectives: the sequence gathered before routing (and the output's gradient in backward)
    under sequence parallelism, the shared experts' output and input gradient, and the routed rows' shares
    gathered (``gather_rows``: the padded share, forward and again in backward)."""
    layout, model, par = step.layout, step.config.model, step.config.parallel
    moe_layers = [i for i in step.layers if model.is_moe_layer(i)]
    if not moe_layers:
        return
    m, group, sp, fp32, act = step.microbatches, step.group("tp"), par.sequence_parallel, 4, step.act
    full = step.tokens * model.d_model  # elements of one [micro, S, D] stream
    full_recompute = int(par.activation_checkpointing == "full")
    moe_runs = len(moe_layers) * m * (1 + _moe_recompute(step))
    if sp:
        _add(out, "tp", "all_gather", "MoE input sequence (forward)", len(moe_layers) * m * (1 + full_recompute),
             full * fp32, group)
        _add(out, "tp", "all_gather", "MoE output gradient (backward)", len(moe_layers) * m, full * act, group)
    if step.config.moe.num_shared_experts:
        _add(out, "tp", "all_reduce", "shared experts output (forward)", moe_runs, full * act, group)
        _add(out, "tp", "all_reduce", "shared experts input gradient (backward)", len(moe_layers) * m,
             full * fp32, group)
    shares = layout.tp // layout.etp
    bounds = row_bounds(sum(kept_per_expert(step.config, step.tokens)), shares)
    padded = max(b - a for a, b in zip(bounds, bounds[1:], strict=False)) * model.d_model * act
    _add(out, "tp", "all_gather", "routed rows' shares (forward)", moe_runs, padded * layout.tp, group)
    _add(out, "tp", "all_gather", "routed rows' share gradients (backward)", len(moe_layers) * m, padded * layout.tp,
         group)


def _tp_norm_gradients(out: list[Traffic], step: _Step) -> None:
    """The gradients of the replicated weights that see part of the activations (the sequence-parallel norms and
    hyper-connections a sequence slice, the per-head norms this rank's heads), which DTensor leaves partial: made
    whole over tp by FSDP's gradient reduction, or without FSDP by ``parallel.sum_partial_gradients``, all of them
    in one all-reduce per step."""
    layout, model, fp32 = step.layout, step.config.model, 4
    group, sp = step.group("tp"), step.config.parallel.sequence_parallel
    norms = 2 * len(step.layers) + (step.last and not step.mtp)  # beside MTP the final norm runs whole
    # under sp, each block's two hyper-connections' weight, bias and scales, and the final collapse's: (tensors, calls)
    hyper = (((HyperConnection.parameter_tensors(model, 0), 2 * len(step.layers)),
              (HyperHead.parameter_tensors(model), int(step.last))) if sp and model.hc_mult > 1 else ())
    if layout.dp_cp == 1:
        hyper_elements = sum(math.prod(t.shape) * calls for tensors, calls in hyper for t in tensors)
        blocks = [*step.layers, *step.mtp]  # the modules' blocks are split by heads as the layers' are
        kinds = [attention_kind(model.layer(i)) for i in blocks]
        linear = kinds.count(GatedDeltaAttention)  # its gated norm on this rank's value heads, [dv]
        elements = (sp * norms * model.d_model + hyper_elements
                    + model.qk_norm * 2 * kinds.count(GroupedQueryAttention) * model.head_size
                    + (linear and linear * model.linear_value_head_dim))
        _add(out, "tp", "all_reduce", "partial weight gradients made whole (once per step)", int(elements > 0),
             elements * fp32, group)
        return
    syncs = _gradient_syncs(step)
    if sp:  # FSDP's gradient reduction makes each whole over tp first, tensor by tensor
        _add(out, "tp", "all_reduce", "sequence-parallel norm weights' gradients (backward)", norms * syncs,
             model.d_model * fp32, group)
    for tensors, calls in hyper:
        for tensor in tensors:
            _add(out, "tp", "all_reduce", "hyper-connection weights' gradients (backward)", calls * syncs,
                 math.prod(tensor.shape) * fp32, group)
    if model.qk_norm:  # the per-head q/k norms see this rank's heads: the same, [hd] each
        _add(out, "tp", "all_reduce", "query/key norm weights' gradients (backward)",
             2 * len(step.layers) * syncs, model.head_size * fp32, group)


def _tp_embedding_and_head(out: list[Traffic], step: _Step) -> None:
    """The embedding's output (summed over the vocabulary slices, or its sequence scattered), the head's input and
    its gradient, the MTP modules' inputs, and the vocabulary-parallel loss."""
    model, par = step.config.model, step.config.parallel
    m, group, sp, fp32 = step.microbatches, step.group("tp"), par.sequence_parallel, 4
    full = step.tokens * model.d_model  # elements of one [micro, S, D] stream
    # the embedding's lookups: the first stage's, and the last stage's copy's for the MTP modules under pp
    lookups = int(step.first) + int(bool(step.mtp) and not step.first)
    if par.vocab_parallel:  # each rank's rows of its vocabulary slice, summed
        _add(out, "tp", "reduce_scatter" if sp else "all_reduce", "embedding output (forward)", lookups * m,
             full * fp32, group)
    if sp:
        _add(out, "tp", "all_gather", "embedding output gradient (backward)", lookups * m, full * fp32, group)
    if step.last:
        if sp:  # at the final norm's input beside MTP (which runs the norm whole), at the head's otherwise
            _add(out, "tp", "all_gather", "head input sequence (forward)", m, full * fp32, group)
        if sp and step.mtp:  # their one call gathers Emb(t) (the hidden states come whole from the final norm;
            # with hyper-connections they are the last block's fp32 streams, gathered too); the gradients come back
            # as this rank's slices, with no collective
            _add(out, "tp", "all_gather", "MTP input: Emb(t) (forward)", m, full * fp32, group)
            if model.hc_mult > 1:
                _add(out, "tp", "all_gather", "MTP input: the last block's streams (forward)", m,
                     full * model.hc_mult * fp32, group)
        if par.vocab_parallel:  # beside MTP the head takes the whole sequence (the final norm gathers it)
            _add(out, "tp", "reduce_scatter" if sp and not step.mtp else "all_reduce",
                 "head input gradient (backward)", m, full * fp32, group)
            _add(out, "tp", "all_reduce", "vocab-parallel loss: max, sum, target logit (forward)", 3 * m,
                 step.tokens * fp32, group)


def context_parallel_traffic(step: _Step) -> list[Traffic]:
    """The cp group's collectives (``analysis.traffic``'s docstring): keys and values gathered in every attention
    layer, their gradients reduce-scattered, and the balancing counts summed in every MoE layer."""
    layout, model, moe = step.layout, step.config.model, step.config.moe
    out: list[Traffic] = []
    if layout.cp == 1:
        return out
    group, m = step.group("cp"), step.microbatches
    for kind, n_layers in _attention_kinds(step).items():
        # what the kind gathers (``context_gathers``): k and v of this tp rank's key/value heads at every position;
        # the normalised latent and the rotated shared key of latent attention; linear attention's state maps and
        # convolution inputs at each chunk's end
        attention_runs = n_layers * m * (1 + int(step.config.parallel.activation_checkpointing == "full"))
        for what, per_sequence in kind.context_gathers(model, layout.tp, layout.cp, step.act):
            gathered = step.micro * per_sequence
            _add(out, "cp", "all_gather", f"{what} (forward)", attention_runs, gathered, group)
            _add(out, "cp", "reduce_scatter", f"{what}: gradients (backward)", n_layers * m, gathered, group)
    moe_layers = sum(model.is_moe_layer(i) for i in step.layers)
    sequences = step.micro if moe.aux_loss_scope == "sequence" else 1
    _add(out, "cp", "all_reduce", "balancing loss's assignment counts (forward)",
         moe_layers * m * (1 + _moe_recompute(step)), sequences * moe.num_experts * 4, group)
    return out


def _exchange_rows(step: _Step, source: int, kept: list[int]) -> list[int]:
    """Rows ``source`` sends to each of its ep group's ranks (by ep coordinate) in one dispatch."""
    layout = step.layout
    return _rows_sent(layout.tp, layout.etp, layout.ep, coordinates(layout, source)["tp"], tuple(kept))


@functools.lru_cache(maxsize=65536)
def _rows_sent(tp: int, etp: int, ep: int, tp_coordinate: int, kept: tuple[int, ...]) -> list[int]:
    """``_exchange_rows`` of a source by its tp coordinate, which alone decides its share, under the layout's tp,
    etp and ep (remembered by those alone: the planner asks for the same ones under thousands of layouts)."""
    if tp > 1:  # its contiguous share of the grouped rows (parallel.tensor.scatter_rows)
        shares, share = tp // etp, tp_coordinate // etp
        bounds = row_bounds(sum(kept), shares)
        rows = share_counts(torch.tensor(kept), bounds[share], bounds[share + 1]).tolist()
    else:
        rows = kept
    local = len(kept) // ep
    return [sum(rows[r * local:(r + 1) * local]) for r in range(ep)]


def expert_parallel_traffic(step: _Step) -> list[Traffic]:
    """Counts, dispatch and combine all-to-alls of every MoE layer (forward, recompute, backward)."""
    layout, config = step.layout, step.config
    moe_layers = [i for i in step.layers if config.model.is_moe_layer(i)]
    out: list[Traffic] = []
    if layout.ep == 1 or not moe_layers:
        return out
    group, me = step.group("ep"), coordinates(layout, step.rank)["ep"]
    forwards = len(moe_layers) * step.microbatches * (1 + _moe_recompute(step))
    backwards = len(moe_layers) * step.microbatches
    replicas = config.parallel.ep_replicas
    if step.ranks_per_node and exchanges_by_node(layout, config.moe.top_k, step.ranks_per_node, replicas):
        return node_exchange_traffic(step, forwards, backwards)
    if exchanges_pairs(layout.ep, layout.tp, config.moe.top_k, replicas):
        return pair_exchange_traffic(*exchange_counts(config.moe, step.tokens, layout.ep), me, group,
                                     config.model.d_model * step.act, forwards, backwards, config.moe.num_experts)
    kept = kept_per_expert(config, step.tokens)
    sent = _exchange_rows(step, step.rank, kept)
    rows_out = sum(sent) - sent[me]
    rows_in = sum(_exchange_rows(step, q, kept)[me] for q in group if q != step.rank)
    row = config.model.d_model * step.act
    if replicas:  # every rank's counts, for the plan; balanced routing, the model's, fills no slot (no copies)
        _add(out, "ep", "all_gather", "every rank's tokens per expert (forward)", forwards,
             layout.ep * config.moe.num_experts * 8, group)
    else:
        _add(out, "ep", "all_to_all", "tokens per expert (forward)", forwards, config.moe.num_experts * 8, group)
    # uneven: the rows that leave (none, when this tp rank's share belongs to its own experts)
    for what, rows in (("dispatch", rows_out), ("combine", rows_in)):
        out.append(Traffic("ep", "all_to_all", f"{what} (forward)", forwards, forwards * rows * row, group))
    for what, rows in (("combine's gradient", rows_out), ("dispatch's gradient", rows_in)):
        out.append(Traffic("ep", "all_to_all", f"{what} (backward)", backwards, backwards * rows * row, group))
    return out


def node_exchange_traffic(step: _Step, forwards: int, backwards: int) -> list[Traffic]:
    """The two-hop exchange (``parallel/node_dispatch.py``): the pair exchange over this rank's across-node group
    with a node as the destination, then over its in-node group with what it forwards
    (``analysis.dispatch_reach.node_exchange_counts``)."""
    config, layout = step.config, step.layout
    nodes = expert_nodes(layout, step.ranks_per_node)
    inter = next(g for g in nodes.inter if step.rank in g)
    intra = next(g for g in nodes.intra if step.rank in g)
    node, position = inter.index(step.rank), intra.index(step.rank)
    across, within = node_exchange_counts(config.moe, step.tokens, nodes.nodes, nodes.per_node, node)
    row, node_experts = config.model.d_model * step.act, config.moe.num_experts // nodes.nodes
    return [*pair_exchange_traffic(*across, node, inter, row, forwards, backwards, config.moe.num_experts,
                                   destination="node"),
            *pair_exchange_traffic(*within, position, intra, row, forwards, backwards, node_experts)]


def pair_exchange_traffic(pairs: list[int], assignments: list[int], me: int, group: tuple[int, ...], row: int,
                          forwards: int, backwards: int, num_experts: int,
                          sources: list[tuple[list[int], list[int]]] | None = None,
                          destination: str = "rank") -> list[Traffic]:
    """The deduplicated exchange's all-to-alls (``parallel/expert_dispatch.py``) for the rank at ep coordinate ``me``.

    ``pairs``/``assignments``: what it sends to each ep coordinate (``analysis.dispatch_reach.exchange_counts`` or
    ``routing_pairs``); ``sources``: the same for every coordinate, for what it receives (by default all alike, as
    under balanced routing). Forward: the counts ([ep, L + 1] int64), the pairs' rows, an int64 code and an fp32
    weight per assignment, and one combined row per pair received; backward: the combined rows' gradients, the
    weights' and the rows'. Each all-to-all's bytes are what leaves this rank (``row`` bytes a row). ``num_experts``:
    the experts the group's ranks hold; ``destination``: what a pair's destination is (a rank, or a node in the
    two-hop exchange's first hop).
    """
    ep = len(group)
    sources = sources or [(pairs, assignments)] * ep
    pairs_out, assignments_out = sum(pairs) - pairs[me], sum(assignments) - assignments[me]
    pairs_in = sum(p[me] for q, (p, _) in enumerate(sources) if q != me)
    assignments_in = sum(a[me] for q, (_, a) in enumerate(sources) if q != me)
    out: list[Traffic] = []
    _add(out, "ep", "all_to_all", "rows per local expert and pairs (forward)", forwards, (num_experts + ep) * 8,
         group)
    for what, calls, leaving in ((f"dispatch: a row per (token, {destination}) pair (forward)", forwards,
                                  pairs_out * row),
                                 ("dispatch: code per assignment (forward)", forwards, assignments_out * 8),
                                 ("dispatch: weight per assignment (forward)", forwards, assignments_out * 4),
                                 ("combine: a row per pair (forward)", forwards, pairs_in * row),
                                 ("combine's gradient (backward)", backwards, pairs_out * row),
                                 ("weights' gradient (backward)", backwards, assignments_in * 4),
                                 ("dispatch's gradient (backward)", backwards, pairs_in * row)):
        out.append(Traffic("ep", "all_to_all", what, calls, calls * leaving, group))
    return out


def pipeline_traffic(step: _Step) -> list[Traffic]:
    """Hidden states forward, their gradients backward, per micro-batch and stage boundary; the loss broadcast."""
    layout, config, par = step.layout, step.config, step.config.parallel
    out: list[Traffic] = []
    if layout.pp == 1:
        return out
    seq = config.model.seq_len // layout.cp // (layout.tp if par.sequence_parallel else 1)
    hidden = step.micro * seq * config.model.hc_mult * config.model.d_model * 4  # fp32: the residual stream(s)
    stages, pp_rank = layout.pp * par.pp_virtual_stages, coordinates(layout, step.rank)["pp"]
    group = step.group("pp")
    sends: dict[tuple[str, int], int] = defaultdict(int)
    for stage in range(pp_rank, stages, layout.pp):
        if stage < stages - 1:
            sends["activations (forward)", group[(stage + 1) % layout.pp]] += step.microbatches
        if stage > 0:
            sends["activation gradients (backward)", group[(stage - 1) % layout.pp]] += step.microbatches
    for (what, peer), calls in sends.items():
        _add(out, "pp", "send", what, calls, hidden, (step.rank, peer))
    mtp = config.model.mtp_depth > 0  # each micro-batch's MTP loss goes with its LM loss
    _add(out, "pp", "broadcast", "micro-batch losses from the last stage", 1, 8 * step.microbatches * (1 + mtp),
         group)
    if mtp and (step.first or step.last):
        # the embedding's gradient and the last stage's copy's summed (``PipelineModel.step``): the local shard
        embedding = next(p for p in root_tensors(config.model, config.moe, True, False) if p.kind == "embedding")
        shard = 4 * sharded_numel(embedding, layout, config.model, par.vocab_parallel)
        _add(out, "pp", "all_reduce", "embedding gradients of the first and last stage (MTP)", 1, shard,
             (group[0], group[-1]))
    return out


def mtp_traffic(step: _Step) -> list[Traffic]:
    """The tp and ep traffic of the multi-token-prediction modules this rank runs (``moe/mtp.py``; their FSDP units
    and Muon's matrices are counted with the blocks', the embedding copy's all-reduce with the pipeline's).

    Module k's block runs on S − k positions of the whole sequence, without sequence parallelism
    (``parallel.tensor._ends_plan``): its traffic is that of a block of its kind on that sequence, with the
    options the layout gives the others. Under vocabulary parallelism its S − k − 1 scored positions go through
    the vocabulary-split head and loss as the main ones do: the head input's gradient all-reduced (the input is
    whole, with or without sequence parallelism) and the loss's three all-reduces.
    """
    out: list[Traffic] = []
    config, n_layers = step.config, step.config.model.n_layers
    for i in step.mtp:
        k = i - n_layers + 1
        shorter = dataclasses.replace(config, model=dataclasses.replace(config.model, seq_len=config.model.seq_len - k),
                                      parallel=dataclasses.replace(config.parallel, sequence_parallel=False))
        module = dataclasses.replace(step, config=shorter, layers=(i,), first=False, last=False, mtp=())
        for item in [*tensor_parallel_traffic(module), *expert_parallel_traffic(module)]:
            out.append(dataclasses.replace(item, what=f"MTP module {k}: {item.what}"))
        if config.parallel.vocab_parallel and step.layout.tp > 1:
            scored, group = step.micro * (config.model.seq_len - k - 1), step.group("tp")
            _add(out, "tp", "all_reduce", f"MTP module {k}: head input gradient (backward)", step.microbatches,
                 scored * config.model.d_model * 4, group)
            _add(out, "tp", "all_reduce", f"MTP module {k}: vocab-parallel loss: max, sum, target logit (forward)",
                 3 * step.microbatches, scored * 4, group)
    return out


def replicated_exchange_traffic(plan: ReplicaPlan, counts: list[list[int]], me: int, group: tuple[int, ...],
                                row: int, expert_bytes: int) -> list[Traffic]:
    """One MoE layer's forward and backward under ``parallel.ep_replicas`` for a given routing (``counts[r][e]``:
    rows ep rank r sends expert e; ``plan``: ``parallel.replication.plan_replicas`` of them), as the rank at ep
    coordinate ``me`` runs it (``parallel/replica_exchange.py``): the counts' all-gather, one all-to-all of the experts
    this rank's own experts copied to other ranks' slots and one of their gradients back to it (``expert_bytes``: one
    expert's stacked weights and biases, in the compute dtype), and the rows' dispatch and combine by copy (``row``
    bytes a row), each again in backward."""
    ep, width = plan.ep, plan.copies_per_rank
    sent = [[0] * ep for _ in range(ep)]  # rows rank r sends rank d's copies
    for source, runs in enumerate(rows_to_copies(plan, counts)):
        for virtual, rows in runs:
            sent[source][virtual // width] += rows
    rows_out = sum(sent[me]) - sent[me][me]
    rows_in = sum(sent[r][me] for r in range(ep)) - sent[me][me]
    out: list[Traffic] = []
    _add(out, "ep", "all_gather", "every rank's tokens per expert (forward)", 1, ep * len(counts[0]) * 8, group)
    if any(e >= 0 for slots in plan.slots for e in slots):
        moves = weight_moves(plan, me)
        out.append(Traffic("ep", "all_to_all", "experts to the slots (forward)", 1,
                           sum(moves.send_splits) * expert_bytes, group))
        out.append(Traffic("ep", "all_to_all", "the slots' gradients to the owners (backward)", 1,
                           sum(moves.recv_splits) * expert_bytes, group))
    for what, rows in (("dispatch (forward)", rows_out), ("combine (forward)", rows_in),
                       ("combine's gradient (backward)", rows_out), ("dispatch's gradient (backward)", rows_in)):
        out.append(Traffic("ep", "all_to_all", what, 1, rows * row, group))
    return out
