"""The step time of a training layout, as the planner (``analysis.planner``) ranks layouts by it, on a hardware preset
of ``analysis.gpu_presets.HARDWARE``: step = compute + bubble + exposed communication.

- **compute**: the training FLOPs of the busiest pipeline rank in one step (``moe.accounting``: 6 × active
  matmul parameters + attention, per token) over the global batch's tokens / (dp × cp: a context-parallel rank
  computes S/cp positions of each sequence, each attending over the whole sequence), divided over tp (every
  matmul, the routed experts' rows included, is split over tp; expert parallelism moves rows without
  changing a rank's share under balanced routing), plus the recomputed forward (a third of a block's
  FLOPs) under activation checkpointing, at ``efficiency`` × the bf16 peak (``calibrated_efficiency``), each
  block's matmuls held to the roofline of the HBM bandwidth (``roofline_slowdown``).
- **bubble**: GPipe and 1F1B idle (p − 1)/m of the compute for p stages and m micro-batches, interleaved 1F1B
  (p − 1)/(v·m) (Narayanan et al. 2021, sec. 2.2; REFERENCES.md); the extra pipeline traffic of interleaving
  (v times the stage boundaries) is in the communication model's pp term.
- **exposed communication**: the tp, cp, ep and pp traffic of ``analysis.communication`` at the bandwidth NCCL
  gets of its links (``link_time.bandwidth``: NVLink in a node, the rank's own adapter across nodes) plus
  each call's latency (NCCL's ring model, ``link_time.startup``), on the critical path (each waits for the
  layer before it); FSDP's gathers and reduce-scatters are prefetched and overlap compute (``ShardingTime``):
  the first unit's gather and the last unit's reduction show in full, the last micro-batch's gradient
  reductions (the only reduce-scatter under ``grad_reduce=step``, the last of m under ``microbatch``, and
  HSDP's all-reduce under both) hide only behind that micro-batch's backward (4 of the 6 FLOPs per parameter),
  and the traffic that overlaps compute shows where it outlasts the compute, and otherwise slows the compute
  beside it (``Hardware.overlap_slowdown``: calibrated, with the network's rate, from the ZeRO-3 rows of
  Narayanan et al. 2021 Table 2). So ``microbatch`` is never faster: it sends m − 1 more reduce-scatters, and
  wins only where ``step``'s memory does not fit.

On a CPU preset whose ranks share cores (``Hardware.sharing`` > 1, ``benchmarks/layout_ranking.py``), a
pipeline's idle ranks leave their cores to the busy ones (``bubble_seconds``), so the compute is the mean
pipeline rank's, not the busiest's (``shared_balance``), and no traffic hides behind compute
(``exposed_communication``).

The times are estimates for comparing layouts, not promises. Not modelled: kernel-launch and element-wise costs,
overlap of tp or ep traffic with compute, and routing imbalance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from analysis import gpu_presets, link_time, traffic_items
from analysis.memory_states import local_layers, rank_blocks
from analysis.traffic import predict
from config.model import LayerSpec, ModelConfig
from config.run import RunConfig
from moe.accounting import block_flops_per_token, head_flops_per_token, per_model
from moe.attention import attention_kind
from parallel.layout import Layout
from parallel.pipeline import stage_layers
from parallel.resolve import micro_batching


def node_shape(world_size: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, processes per node) for ``world_size`` ranks on nodes of ``gpus_per_node`` GPUs: full nodes where
    they divide the world, else the most processes per node that do."""
    per_node = max(n for n in range(1, min(world_size, gpus_per_node) + 1) if world_size % n == 0)
    return world_size // per_node, per_node


def stage_flops_per_token(config: RunConfig, layout: Layout) -> list[float]:
    """Training FLOPs per token of each pipeline rank's blocks (and the head on the last), recompute included.

    Under interleaving a rank holds v stages, s ≡ rank (mod pp) (``parallel/pipeline.py``): their sum.
    """
    return [sum(flops for flops, _ in rank) for rank in _rank_block_flops(config, layout)]


def _rank_block_flops(config: RunConfig, layout: Layout) -> list[list[tuple[float, int | None]]]:
    """Each pipeline rank's (training FLOPs per token, kind of block) of its blocks, recompute included, the kind as
    its index in ``block_kinds`` (a small int: the planner looks each up millions of times); the head last (kind
    None: no roofline, its matmul is the largest of the model)."""
    model, moe, recompute = config.model, config.moe, config.parallel.activation_checkpointing
    key = (layout.pp, config.parallel.pp_virtual_stages, recompute, layout.cp)
    known = per_model(_RANK_BLOCK_FLOPS, model, moe, dict)
    if key not in known:
        known[key] = _count_rank_block_flops(config, layout)
    return known[key]


_RANK_BLOCK_FLOPS: dict = {}  # a per_model store of _rank_block_flops by (pp, v, recompute, cp)


def _count_rank_block_flops(config: RunConfig, layout: Layout) -> list[list[tuple[float, int | None]]]:
    model, moe, recompute = config.model, config.moe, config.parallel.activation_checkpointing
    stages = layout.pp * config.parallel.pp_virtual_stages
    ranges = stage_layers(model, moe, stages) if layout.pp > 1 else [range(model.n_layers)]
    ranks: list[list[tuple[float, int | None]]] = [[] for _ in ranges[:layout.pp]]

    kinds = block_kinds(model)

    def block(i: int) -> tuple[float, int]:
        """Block i's FLOPs per token, its forward again where recomputed (2 of 6 FLOPs per parameter)."""
        layer = model.layer(i)
        recomputed = recompute == "full" or (recompute == "moe" and layer.is_moe)
        flops = block_flops_per_token(model, moe, layer) + attention_kind(layer).context_flops_per_token(model,
                                                                                                      layout.cp)
        return flops * (4 / 3 if recomputed else 1), kinds.index(layer)

    for index, layers in enumerate(ranges):
        ranks[index % layout.pp].extend(block(i) for i in layers)
    last = ranks[(len(ranges) - 1) % layout.pp]
    last.append((head_flops_per_token(model), None))
    d = model.d_model
    for k in range(model.mtp_depth):  # the multi-token-prediction modules, beside the head: a block of layer
        # n_layers + k's kind, and its projection and norms with the head's second pass (no roofline, as the head)
        last.append(block(model.n_layers + k))
        last.append((6.0 * (2 * d * d + 3 * d + model.vocab_size * d), None))
    return ranks


def block_kinds(model: ModelConfig) -> tuple[LayerSpec, ...]:
    """The kinds of block of the layer pattern, in the order they first appear."""
    return tuple(dict.fromkeys(model.layer_pattern))


def block_gemms(config: RunConfig, layout: Layout, tokens: int, layer: LayerSpec) -> list[tuple[float, int, int, int]]:
    """The matmuls one rank runs in one block's forward on ``tokens`` tokens: (count, M, K, N).

    Column- and row-parallel projections split N or K over tp; the routed experts get T·k/E rows each (balanced
    routing), E/ep experts per rank, rows split over tp/etp and the hidden dim over etp (``parallel/expert.py``).
    """
    model, moe, tp = config.model, config.moe, layout.tp
    d = model.d_model
    out = attention_kind(layer).projection_gemms(model, tp, tokens)  # as the attention kind states them
    hidden = model.ffn_hidden
    if layer.is_moe:
        rows = tokens * moe.top_k * layout.ep / moe.num_experts / (tp // layout.etp)
        experts, expert_hidden = moe.num_experts // layout.ep, moe.expert_hidden // layout.etp
        out += [(1, tokens, d, moe.num_experts), (experts * (2 if moe.activation == "swiglu" else 1), rows, d,
                                                  expert_hidden), (experts, rows, expert_hidden, d)]
        hidden = moe.shared_hidden if moe.num_shared_experts else 0
    if hidden:
        out += [(2, tokens, d, hidden // tp), (1, tokens, hidden // tp, d)]
    return out


def roofline_slowdown(gemms: list[tuple[float, int, int, int]], flops: float, bandwidth: float) -> float:
    """How much longer than at ``flops`` FLOP/s the matmuls take when each also waits for its bf16 operands and
    result to cross HBM (``bandwidth`` bytes/s): Σ max(2MKN / flops, 2(MK + KN + MN) / bandwidth) over Σ 2MKN /
    flops. 1 for the large matmuls of dense models; more where a matmul is thin (few tokens per expert)."""
    work = sum(c * 2 * m * k * n for c, m, k, n in gemms)
    time = sum(c * max(2 * m * k * n / flops, 2 * (m * k + k * n + m * n) / bandwidth) for c, m, k, n in gemms)
    return time / work * flops


def compute_seconds(config: RunConfig, layout: Layout, peak: float, bandwidth: float = math.inf) -> float:
    """The busiest pipeline rank's compute time for one optimizer step at ``peak`` FLOP/s, each block's matmuls
    held to the roofline of ``bandwidth`` bytes/s of HBM (``roofline_slowdown``; none at the default)."""
    micro = micro_batching(config, layout.dp, layout.pp)[0]
    # a context-parallel rank computes its S/cp positions of each of its dp rank's sequences (each position's
    # attention over the whole sequence's keys, as one process's: the FLOPs per token are the same, but for what a
    # kind states it adds under cp: linear attention's state maps, ``context_flops_per_token``)
    tokens_per_rank = config.train.global_batch_size * config.model.seq_len / layout.dp_cp
    slowdown = block_slowdowns(config, layout, micro * config.model.seq_len // layout.cp, peak, bandwidth)
    busiest = max(sum(flops * slowdown[kind] for flops, kind in rank) for rank in _rank_block_flops(config, layout))
    return busiest * tokens_per_rank / layout.tp / peak


def block_slowdowns(config: RunConfig, layout: Layout, tokens: int, peak: float,
                    bandwidth: float) -> dict[int | None, float]:
    """``roofline_slowdown`` of each kind of block (by its index in ``block_kinds``) and the head (None: 1) on
    ``tokens`` tokens a micro-batch. Remembered per model and (tp, ep, etp, tokens, peak, bandwidth): the planner's
    candidates share a few of these among tens of thousands of settings."""
    key = (layout.tp, layout.ep, layout.etp, tokens, peak, bandwidth)
    known = per_model(_BLOCK_SLOWDOWNS, config.model, config.moe, dict)
    if key not in known:
        known[key] = {index: roofline_slowdown(block_gemms(config, layout, tokens, kind), peak, bandwidth)
                      if bandwidth < math.inf else 1.0 for index, kind in enumerate(block_kinds(config.model))}
        known[key][None] = 1.0
    return known[key]


_BLOCK_SLOWDOWNS: dict = {}  # a per_model store of block_slowdowns by (tp, ep, etp, tokens, peak, bandwidth)


def bubble_seconds(compute: float, layout: Layout, microbatches: int, virtual_stages: int = 1,
                   sharing: float = 1.0, balance: float = 1.0) -> float:
    """The pipeline's idle time: (p − 1) / m of the compute for GPipe and 1F1B, (p − 1) / (v · m) interleaved
    with v stages per rank (Narayanan et al. 2021, sec. 2.2.1 and 2.2.2).

    Where ranks share their compute (``Hardware.sharing`` > 1: processes on fewer CPU cores), a rank idle in the
    bubble leaves its share to the busy ones. ``compute`` is then the mean pipeline rank's work at the shared
    rate (``shared_balance`` of the busiest's), and the step takes the larger of it and the pipeline's critical
    path: the busiest rank's work at the unshared rate, compute / (balance · sharing) · (1 + bubble fraction)."""
    fraction = (layout.pp - 1) / (virtual_stages * microbatches)
    return compute * max(0.0, (1 + fraction) / (sharing * balance) - 1)


def shared_balance(config: RunConfig, layout: Layout, sharing: float) -> float:
    """The mean pipeline rank's training FLOPs over the busiest's where ranks share cores (``sharing`` > 1), else
    1. Sharing cores, a rank that finishes its step's work early leaves its share to the others, so the ranks
    together take their mean's time at the shared rate, not the busiest's (the last stage's head, say)."""
    if sharing <= 1 or layout.pp == 1:
        return 1.0
    ranks = stage_flops_per_token(config, layout)
    return sum(ranks) / len(ranks) / max(ranks)


def in_last_backward(item: traffic_items.Traffic, grad_reduce: str, microbatches: int) -> float:
    """The share of an FSDP collective's traffic that runs in the last micro-batch's backward, after which
    the optimizer waits for it: HSDP's all-reduce and the gradient reduce-scatter under ``grad_reduce=step``
    all of it, the reduce-scatter under ``microbatch`` its last of m rounds, the all-gathers none."""
    if item.collective == "all_reduce" or (item.collective == "reduce_scatter" and grad_reduce == "step"):
        return 1.0
    return 1 / microbatches if item.collective == "reduce_scatter" else 0.0


@dataclass(frozen=True)
class ShardingTime:
    """One stage's FSDP traffic in seconds, split by what it can hide behind (``sharding_time``)."""

    ends: float  # the first unit's all-gather and the last unit's gradient reduction: no compute beside them
    last: float  # the rest of the last micro-batch's gradient reductions: only its backward is left to hide them
    rest: float  # every other all-gather and reduction, prefetched behind the step's compute

    def exposed(self, compute: float, microbatches: int, slowdown: float) -> float:
        """Seconds the step waits beyond ``compute``: the ends; what of ``last`` its backward (2/3 of the last
        micro-batch's compute: 4 of the 6 FLOPs per parameter) does not hide; and of the O seconds that overlap
        compute, max(O − the compute they overlap, ``slowdown`` · O): two streams, traffic taking O and compute C
        that runs ``slowdown`` · the time slower while traffic runs beside it (``Hardware.overlap_slowdown``),
        take max(O, C + slowdown · O)."""
        hidden_last = min(self.last, compute / microbatches * 2 / 3)
        overlapped = hidden_last + self.rest
        return self.ends + self.last - hidden_last + max(overlapped - compute, slowdown * overlapped)


def sharding_time(timed: list[tuple[traffic_items.Traffic, float]], grad_reduce: str,
                  microbatches: int) -> ShardingTime:
    """``ShardingTime`` of a stage's FSDP items, each with its seconds on its links.

    Nothing computes before the first unit is gathered, and the optimizer waits for the last unit's reduction:
    one call of the largest all-gather, and of the largest reduce-scatter (and HSDP all-reduce), never overlap.
    Of the rest, the share in the last micro-batch's backward (``in_last_backward``) hides only behind it."""
    def largest_call(collective: str) -> float:
        return max((seconds / item.calls for item, seconds in timed if item.collective == collective), default=0.0)

    first, final = largest_call("all_gather"), largest_call("reduce_scatter") + largest_call("all_reduce")
    last = sum(seconds * in_last_backward(item, grad_reduce, microbatches) for item, seconds in timed)
    total = sum(seconds for _, seconds in timed)
    return ShardingTime(first + final, max(0.0, last - final), max(0.0, total - last - first))


def exposed_communication(config: RunConfig, layout: Layout, compute: float, hardware: gpu_presets.Hardware,
                          gpus_per_node: int, microbatches: int = 1) -> dict[str, float]:
    """Seconds of communication the step waits for, by dimension, on the slowest of the stages' first ranks.

    tp, cp, ep and pp traffic waits in full (each waits for the layer before it: cp's keys and values are gathered
    before the layer's attention, their gradients reduce-scattered before the layer below runs); FSDP's shows as
    ``ShardingTime.exposed`` behind ``compute`` (the stage's compute for the step). Where ranks share CPU cores
    (``Hardware.sharing`` > 1) nothing hides: every core computes, and the copies and ring steps of gloo's
    collectives need the same cores.
    """
    stages = []
    stride = layout.world_size // layout.pp  # pp is the outermost axis: stage s starts at rank s·stride
    if hardware.sharing > 1:
        compute = 0.0
    seen = set()
    for stage in range(layout.pp):
        if stride % gpus_per_node == 0:  # every stage's groups sit on the nodes alike: alike stages send alike
            layers, first, last = local_layers(config, layout, stage)
            kinds = tuple(rank_blocks(config.model, config.moe, layers))
            if (key := (kinds, first, last, stage == 0, stage == layout.pp - 1)) in seen:
                continue
            seen.add(key)
        waiting, sharding = stage_traffic(config, layout, stage * stride, hardware, gpus_per_node)
        by_dim = dict.fromkeys(("tp", "cp", "ep", "pp", "muon"), 0.0)
        for item, seconds in waiting:
            by_dim[item.dimension] += seconds
        by_dim["fsdp"] = sharding_time(sharding, config.parallel.grad_reduce, microbatches).exposed(
            compute, microbatches, hardware.overlap_slowdown)
        stages.append(by_dim)
    return max(stages, key=lambda by_dim: sum(by_dim.values()))


def stage_traffic(config: RunConfig, layout: Layout, rank: int, hardware: gpu_presets.Hardware,
                  gpus_per_node: int) -> tuple[list[tuple[traffic_items.Traffic, float]],
                                               list[tuple[traffic_items.Traffic, float]]]:
    """``rank``'s traffic in one step, each item with its seconds on its links: what waits in full (tp, cp, ep, pp
    and Muon's optimizer-step gathers), and FSDP's (``sharding_time`` splits it by what it can hide behind). The run
    is launched with ``gpus_per_node`` processes per node, which decides whether the experts' exchange goes in two
    hops (``parallel/node_dispatch.py``)."""
    waiting, sharding = [], []
    for item in predict(config, layout, rank, precision=hardware.precision,
                        ranks_per_node=node_shape(layout.world_size, gpus_per_node)[1]):
        (sharding if item.dimension == "fsdp" else waiting).append(
            (item, link_time.seconds(item, hardware, gpus_per_node)))
    return waiting, sharding


def calibrated_efficiency() -> float:
    """The fraction of the bf16 peak the matmuls reach, from one stated measurement, for every GPU and layout.

    Korthikanti et al. 2022, Table 4 (REFERENCES.md sec. 2.3): one layer of their 22B GPT (h = 6144, s = 2048,
    micro-batch 4, tp = 8, no recompute) runs forward and backward in 19.6 ms on an A100 (312 TFLOP/s bf16).
    Its FLOPs are 3·(24bsh² + 4bs²h) (Narayanan et al. 2021 appendix), 1/8 per rank; its four tp all-reduces of
    b·s·h bf16 take what ``analysis.communication`` charges on A100 NVLink. The rest of the 19.6 ms is the
    matmuls (and the small element-wise work between them): 56% of the peak.
    """
    h, s, b, t = 6144, 2048, 4, 8
    a100 = gpu_presets.HARDWARE["a100-80gb"]
    flops = 3 * (24 * b * s * h * h + 4 * b * s * s * h) / t
    all_reduce = traffic_items.Traffic("tp", "all_reduce", "", 4, 4 * traffic_items.bus_bytes(
        "all_reduce", b * s * h * 2, t), tuple(range(t)))
    return flops / ((19.6e-3 - link_time.seconds(all_reduce, a100, 8)) * a100.bf16_flops)


EFFICIENCY = calibrated_efficiency()
