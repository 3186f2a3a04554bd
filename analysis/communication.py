"""Collective traffic of one rank in one optimizer step: predicted from a config and a layout, and counted in a run.

``predict(config, layout, rank)`` lists what this toolkit's code sends, per parallel dimension, as
``Traffic`` items; ``analysis.collective_count.CollectiveCounter`` records the collectives a real run
issues, so the tests can hold the two against each other. The planner (``analysis/planner.py``) divides
each item's bytes by the bandwidth of the link it crosses.

Byte convention (both sides): **bus bytes**, the data one rank puts on its link under the bandwidth-optimal
(ring) algorithms, as nccl-tests defines bus bandwidth (NVIDIA nccl-tests, doc/PERFORMANCE.md): for a group
of n ranks and a buffer of S bytes (the full, unsharded buffer) all-reduce moves 2(n−1)/n·S, all-gather and
reduce-scatter (n−1)/n·S, broadcast S; an all-to-all moves exactly the rows that leave the rank for other
ranks; a point-to-point send its tensor. Time on a link is then bus bytes / the bandwidth NCCL gets of it
(``bandwidth``: NVLink inside a node, the rank's network adapter across nodes).

What the code does, read from it and confirmed by counting (tests/analysis/test_communication.py):

- tp (``parallel/tensor.py``, DTensor): forward, one all-reduce of [micro, S, D] after each row-parallel
  projection (attention ``wo``, dense FFN ``w_out``, shared experts' ``w_out`` on the [T, D] tokens);
  backward, one all-reduce per pair of the summed input gradients of its column-parallel projections
  (they share one replicated DTensor input). Sequence parallel turns each forward all-reduce into an
  all-gather before the pair and a reduce-scatter after it; in backward the reduce-scatter's gradient is
  an all-gather and the input gradients are reduce-scattered back to the slice. The MoE layer gathers the
  sequence before routing (its output keeps a slice: backward all-gathers the gradient). The routed rows'
  shares are all-gathered over tp (``gather_rows``: the padded share, forward and again in backward).
  Vocabulary parallel: the embedding's all-reduce (reduce-scatter under sequence parallelism), the head's
  input gradient all-reduce (reduce-scatter), and three all-reduces of [T] fp32 in the loss.
- ep (``parallel/expert.py``): per MoE layer and forward, an all-to-all of E int64 counts, the dispatch and
  the combine; backward repeats dispatch and combine. Rows per destination come from the balanced routing
  (``moe.force_balance``'s round robin: every expert T·k/E assignments, capped at the capacity) and, under
  tp, from this tp rank's contiguous share of the grouped rows. Without tp and with k > 1 the exchange is
  deduplicated (``parallel/expert_dispatch.py``, ``pair_exchange_traffic``): one row per (token, destination
  rank) pair each way, plus a code and a weight per assignment; pairs per destination from
  ``analysis.dispatch_reach.exchange_counts`` (the round robin's under ``moe.force_balance``, otherwise each
  token reaching the most ranks its group limit allows). Where the ep group spans nodes with several of its ranks
  in each (``predict``'s ``ranks_per_node``), the same exchange twice (``node_exchange_traffic``): over the ranks
  with this rank's in-node position, one row per (token, node), then over the node's ranks, one row per forwarded
  row and rank (``analysis.dispatch_reach.node_exchange_counts``).
- FSDP2 (``parallel/sharding.py``): per block, per routed-experts unit and for the root (embedding, norm,
  head), an all-gather of the fp32 parameter shards per micro-batch, again in backward with
  ``reshard_after_forward`` (not for the root); a reduce-scatter of the gradients once per step under
  ``parallel.grad_reduce=step`` (on the last micro-batch) or per micro-batch under ``microbatch``, and with
  dp_replicate > 1 the all-reduce of the shard over the replicas once per step under both
  (``parallel.set_gradient_sync``).
- cp (``parallel/context.py``): each rank holds S/cp positions of every sequence, so every per-token item above
  counts its S/cp. Per attention layer and micro-batch, forward, one all-gather of the keys and values over the
  cp group (k and v in one tensor, [micro, kv_heads/tp, S, 2·hd] in the compute dtype; for latent attention the
  normalised latent and the rotated shared key, [micro, S, c + r]), again under full recompute; backward, its
  reduce-scatter, the same bytes. Per MoE layer and forward (and recompute), the all-reduce of the balancing
  loss's assignment counts, [sequences, E] fp32 (one row per micro-batch with the batch-wide scope). FSDP
  shards over dp_shard × cp (its groups below are that flattened axis).
- pp (``parallel/pipeline.py``): per micro-batch a send of the fp32 hidden states [micro, S (/cp; /tp under
  sequence parallelism), D] to the next stage and of their gradient to the previous one, and the broadcast of
  the micro-batch losses (float64) from the last stage.
- multi-token prediction (``moe/mtp.py``, on the last stage): module k's block as a block of its kind on S − k
  positions, never sequence-parallel (``mtp_traffic``); under sequence parallelism an all-gather of the last hidden
  states and one of Emb(t) per micro-batch (the final norm's input gathered in place of the head's); under pp
  each micro-batch's MTP loss broadcast with its LM loss and, once per step, the all-reduce of the embedding's
  gradient between the first stage and the last stage's copy (``parallel/pipeline.py``).
- Muon (``train.optimizer=muon``, ``training/muon.py``): per optimizer step, for each matrix it updates that
  FSDP's dp_shard, tp, etp or FSDP over edp cuts, an all-gather of the fp32 update and a reduce-scatter of the
  fp32 result over each cutting axis, one after the other where two cut it (``muon_traffic``,
  ``_muon_gathers``; counted in the optimizer's own section by the tests).
- recompute: ``full`` repeats each block's forward collectives in backward, except a dense block's FFN
  output collective, which torch's early-stopping checkpoint never reaches (nothing after it is saved);
  ``moe`` repeats the MoE layer's (not its sequence gather, a hook outside the recomputed forward).

Left out, as latency-bound scalars or once-per-log-interval work (the tests measure them below 2 % of the
step): the gradient-norm all-reduces (one vector of per-parameter norms per mesh, and over pp), the
step-loss and aux-free-bias all-reduces over dp, routing statistics at log intervals, and, under sequence
parallelism without FSDP, the norm weights' gradients, which DTensor leaves partial and the gradient-norm
step makes whole (one all-reduce of [D] each; with FSDP its gradient reduction makes them whole once per
micro-batch, and that is counted); the same for the per-head query/key norms (``model.qk_norm``, [hd] each)
under any tp.

Element sizes: gradients are reduced in fp32; parameters are gathered in fp32, or under bf16 in bf16 (FSDP2's
mixed precision), but for the routers, fp32 units of their own. Under bf16 autocast the projections'
outputs, the routed rows and their gradients are bf16; norm outputs, the embedding, every input gradient of
a column-parallel projection and the hidden states between pipeline stages stay fp32 (what autocast gives,
confirmed by the bf16 test layouts).

Validated exactly (calls and bytes, every rank) on gloo by the tests for: FSDP with 1 and 2 micro-batches
and with ``reshard_after_forward`` off, HSDP, ep over dp_shard and over tp, ep × etp, etp alone, tp with
sequence and vocabulary parallelism, full and MoE recompute, capacity drops, bf16, pp with 1F1B and
interleaved 1F1B with FSDP (GPipe with FSDP matched too when checked once), multi-token prediction under ep over
dp_shard, ep over tp with sequence parallelism and pp; and with 2 micro-batches under
both ``grad_reduce`` settings for FSDP, HSDP with ep, ep over edp=2, and pp with FSDP (and under ``step`` for
tp with sequence parallelism over FSDP); and context parallelism: cp=2 with 2 micro-batches and full recompute,
latent attention in bf16, cp × tp × ep with sequence parallelism, cp × dp_shard with latent attention. The time
column is each item's latency (NCCL's ring model,
``startup``) plus its bytes over the link's bandwidth; overlap with compute is the planner's business.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from analysis.dispatch_reach import describe as describe_reach
from analysis.dispatch_reach import exchange_counts, node_exchange_counts
from analysis.memory_states import (
    Block,
    ParamTensor,
    largest_chunk,
    mtp_layers,
    muon_updates,
    rank_blocks,
    root_tensors,
    sharded_numel,
    sharded_numel_of,
)
from config.cli import (
    add_config_arguments,
    add_world_size,
    command_parser,
    load_config_from,
    run_command,
    world_size_of,
)
from config.errors import ConfigError
from config.run import RunConfig
from moe.dispatch import expert_capacity
from parallel.expert import exchanges_by_node, exchanges_pairs
from parallel.hardware import planned_precision
from parallel.layout import Layout
from parallel.pipeline import stage_layers
from parallel.ranks import axis_view, expert_nodes, groups_for
from parallel.ranks import coordinates as _coordinates
from parallel.resolve import micro_batching, resolve_layout
from parallel.sharding import expert_fsdp_dim, experts_replicated, experts_spread
from parallel.tensor import row_bounds, share_counts


@dataclass(frozen=True)
class Latency:
    """What a collective costs before its first byte counts: seconds per call, and per ring step on each link.

    A ring collective of n ranks runs 2(n − 1) steps (all-reduce) or n − 1 (all-gather, reduce-scatter), each
    waiting for the previous rank's chunk; the steps that cross to another node wait on the network
    (``startup``).
    """

    call: float  # seconds per call (launch and set-up)
    intra_step: float  # seconds per ring step inside a node
    inter_step: float  # seconds per ring step that crosses nodes


# NCCL's own cost model of a ring collective in the Simple protocol, the one it picks for the large messages of
# training (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel: baseLat Ring/Simple 8.4 us per call, hwLat
# Ring/Simple 3.4 us per step on NVLink and 9.6 us per step on the network; latency = baseLat + (nsteps −
# nInterSteps)·intra + nInterSteps·inter, nsteps 2(n − 1) for all-reduce, n − 1 for all-gather and
# reduce-scatter).
NCCL_LATENCY = Latency(8.4e-6, 3.4e-6, 9.6e-6)

# What NCCL gets of NVLink's line rate: "with the protocol overhead (~20%) NCCL can get an effective NVLink
# bandwidth of 370GB/s" of H100's 450 (S. Jeaugey, NCCL's maintainer, NVIDIA/nccl-tests issue #212, 2024).
NCCL_EFFICIENCY = 0.8

# How much slower the matmuls run while FSDP's collectives run beside them (NCCL's kernels hold SMs and HBM
# bandwidth the matmuls would use), per second of overlapped traffic. Calibrated once from the ZeRO-3 rows of
# Narayanan et al. 2021 Table 2 whose compute outlasts their traffic (175B on 384 A100s, 530B on 640):
# ``analysis.published_layouts.calibrated_overlap_slowdown``; taken for every GPU.
OVERLAP_SLOWDOWN = 0.28

# What a rank's traffic across nodes gets of its own network adapter's line rate, calibrated once from the
# ZeRO-3 rows of Narayanan et al. 2021 Table 2 (``analysis.published_layouts.calibrated_network_efficiency``:
# the mean over the four rows whose step did not shrink with more GPUs, their FSDP bytes over their step less
# NCCL's latency); nccl-tests across nodes measure the same order (86 of 96 GB/s, NVIDIA/nccl issue #1048).
NETWORK_EFFICIENCY = 0.92


@dataclass(frozen=True)
class Hardware:
    """One kind of node: link bandwidths (bytes/s, one direction, per device), dense peak FLOP/s in ``precision``
    (the datasheet's bf16 for the GPUs), memory per device, and the collectives' latencies."""

    name: str
    gpus_per_node: int
    intra_node: float
    inter_node: float
    bf16_flops: float
    memory_gib: float  # nominal (the datasheet's GB)
    memory_bandwidth: float  # HBM bytes/s (the roofline of the planner's matmuls)
    source: str
    latency: Latency = NCCL_LATENCY
    precision: str = "bf16"  # what the planner trains in here: the bytes its traffic carries
    sharing: float = 1.0  # a rank's compute alone over its share when all run: above 1 where ranks share CPU cores
    overlap_slowdown: float = OVERLAP_SLOWDOWN  # compute's slowdown per second of collectives beside it
    network_efficiency: float = NETWORK_EFFICIENCY  # the share of its adapter's line rate a rank's traffic gets
    intra_efficiency: float = NCCL_EFFICIENCY  # the share of ``intra_node`` collectives get (1: measured so)


# Datasheet figures. NVLink totals are quoted for both directions together: one direction is half. The network
# is one adapter per GPU as the vendors' 8-GPU reference systems have it (DGX A100: 200 Gb/s HDR, 25 GB/s each
# way; DGX H100/H200/B200: 400 Gb/s, 50 GB/s). Peaks are dense bf16 tensor-core FLOP/s, without sparsity. HBM
# bandwidth from the same datasheets: A100 40GB 1,555 GB/s, 80GB 2,039 GB/s; H100 and H800 SXM 3.35 TB/s; H200
# 4.8 TB/s; B200 8 TB/s (HGX B200: 64 TB/s for 8 GPUs).
HARDWARE = {
    # NVIDIA A100 Tensor Core GPU datasheet: NVLink 3 600 GB/s, bf16 312 TFLOP/s, 40 or 80 GB; DGX A100 user
    # guide: 8 single-port 200 Gb/s HDR InfiniBand adapters for the compute fabric
    "a100-40gb": Hardware("A100 SXM4 40GB, NVLink 3, HDR InfiniBand", 8, 300e9, 25e9, 312e12, 40, 1555e9,
                          "NVIDIA A100 datasheet; DGX A100 user guide"),
    "a100-80gb": Hardware("A100 SXM4 80GB, NVLink 3, HDR InfiniBand", 8, 300e9, 25e9, 312e12, 80, 2039e9,
                          "NVIDIA A100 datasheet; DGX A100 user guide"),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): NVLink 4 900 GB/s, bf16 989 TFLOP/s (1979 with sparsity),
    # 80 GB; one 400 Gb/s NDR InfiniBand adapter per GPU
    "h100": Hardware("H100 SXM5, NVLink 4, NDR InfiniBand", 8, 450e9, 50e9, 989e12, 80, 3350e9,
                     "NVIDIA H100 Tensor Core GPU datasheet"),
    # H800 SXM5: the H100's compute with NVLink cut to 400 GB/s (NVIDIA's H800 specifications); DeepSeek-V3's
    # report (arXiv:2412.19437 sec. 3.2.2) measures about 160 GB/s of NVLink and 50 GB/s of InfiniBand per GPU
    "h800": Hardware("H800 SXM5, NVLink 400 GB/s, NDR InfiniBand", 8, 200e9, 50e9, 989e12, 80, 3350e9,
                     "NVIDIA H800 specifications; DeepSeek-V3 technical report sec. 3.2.2"),
    # NVIDIA H200 Tensor Core GPU datasheet: the H100's compute and NVLink 4, 141 GB of HBM3e
    "h200": Hardware("H200 SXM, NVLink 4, NDR InfiniBand", 8, 450e9, 50e9, 989e12, 141, 4800e9,
                     "NVIDIA H200 Tensor Core GPU datasheet"),
    # NVIDIA HGX B200 / DGX B200 specifications: NVLink 5 1.8 TB/s per GPU, bf16 2.25 PFLOP/s dense (4.5 with
    # sparsity), 1,440 GB for 8 GPUs, 400 Gb/s ConnectX-7 per GPU
    "b200": Hardware("B200, NVLink 5, 400 Gb/s InfiniBand", 8, 900e9, 50e9, 2250e12, 180, 8000e9,
                     "NVIDIA HGX B200 and DGX B200 specifications"),
}


def add_hardware_arguments(parser: argparse.ArgumentParser) -> None:
    """``--gpu`` (a preset of ``HARDWARE``) and overrides of its figures, for the analysis CLIs."""
    parser.add_argument("--gpu", default="h100", choices=list(HARDWARE), help="the GPU node's preset (default h100)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the preset's, 8)")
    parser.add_argument("--nvlink-gbps", type=float, default=None, metavar="GB/S",
                        help="override: NVLink bandwidth per GPU, one direction")
    parser.add_argument("--network-gbps", type=float, default=None, metavar="GB/S",
                        help="override: network bandwidth per GPU, one direction")
    parser.add_argument("--peak-tflops", type=float, default=None, metavar="TFLOP/S",
                        help="override: dense bf16 peak per GPU")


def hardware_from_args(args: argparse.Namespace, memory_gib: float | None = None) -> Hardware:
    """The ``--gpu`` preset with the CLI's overrides (``memory_gib``: a ``--device-memory`` given)."""
    return hardware_with(args.gpu, args.gpus_per_node, args.nvlink_gbps, args.network_gbps, args.peak_tflops,
                         memory_gib)


def hardware_with(name: str, gpus_per_node: int | None = None, nvlink_gbps: float | None = None,
                  network_gbps: float | None = None, peak_tflops: float | None = None,
                  memory_gib: float | None = None) -> Hardware:
    """The preset ``name`` with any figure overridden (GB/s one direction per GPU, TFLOP/s, GiB)."""
    if name not in HARDWARE:
        raise ConfigError(f"--gpu {name!r} is not a preset; valid: {', '.join(HARDWARE)}")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node must be at least 1, got {gpus_per_node}")
    figures = {("--nvlink-gbps", "GB/s"): nvlink_gbps, ("--network-gbps", "GB/s"): network_gbps,
               ("--peak-tflops", "TFLOP/s"): peak_tflops, ("--device-memory", "GiB"): memory_gib}
    for (flag, unit), value in figures.items():
        if value is not None and not 0 < value < math.inf:  # NaN fails this too
            raise ConfigError(f"{flag} must be a positive number of {unit}, got {value}")
    overrides = {"gpus_per_node": gpus_per_node, "intra_node": nvlink_gbps and nvlink_gbps * 1e9,
                 "inter_node": network_gbps and network_gbps * 1e9, "bf16_flops": peak_tflops and peak_tflops * 1e12,
                 "memory_gib": memory_gib}
    return dataclasses.replace(HARDWARE[name], **{k: v for k, v in overrides.items() if v is not None})


@dataclass(frozen=True)
class Traffic:
    """One kind of collective traffic of one rank in one optimizer step."""

    dimension: str  # tp, ep, fsdp, pp
    collective: str  # all_reduce, all_gather, reduce_scatter, all_to_all, send, broadcast
    what: str  # where in the step, e.g. "attention wo output (forward)"
    calls: int  # per optimizer step
    bus_bytes: int  # per optimizer step, all calls (module docstring: the convention)
    group: tuple[int, ...]  # ranks of the group; for a send (this rank, the receiver)

    def link(self, gpus_per_node: int) -> str:
        """``intra`` when every rank of the group sits in one node (NVLink), else ``inter`` (the network)."""
        return "intra" if nodes_spanned(self.group, gpus_per_node) == 1 else "inter"


@functools.lru_cache(maxsize=65536)
def nodes_spanned(group: tuple[int, ...], gpus_per_node: int) -> int:
    """How many nodes of ``gpus_per_node`` ranks the group's ranks sit in (remembered: groups recur)."""
    return len({r // gpus_per_node for r in group})


def bus_bytes(collective: str, buffer_bytes: int, group_size: int) -> int:
    """Bus bytes of one collective on a ``buffer_bytes`` buffer (the full one) over ``group_size`` ranks."""
    n = group_size
    factor = {"all_reduce": (2 * (n - 1), n), "all_gather": (n - 1, n), "reduce_scatter": (n - 1, n),
              "all_to_all": (n - 1, n), "broadcast": (1, 1), "send": (1, 1)}[collective]
    return buffer_bytes * factor[0] // factor[1]


def totals(items: Iterable[Traffic]) -> dict[tuple[str, tuple[int, ...]], tuple[int, int]]:
    """(calls, bus bytes) summed by (collective, group): what a counted run can be compared on."""
    out: dict[tuple[str, tuple[int, ...]], tuple[int, int]] = {}
    for item in items:
        calls, sent = out.get((item.collective, item.group), (0, 0))
        out[item.collective, item.group] = (calls + item.calls, sent + item.bus_bytes)
    return out


# ---------------------------------------------------------------------------
# The prediction
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Step:
    """What one rank runs in one step: its layout coordinates, micro-batches, stages and element sizes."""

    config: RunConfig
    layout: Layout
    rank: int
    micro: int  # sequences per micro-batch
    microbatches: int
    layers: tuple[int, ...]  # the blocks this rank holds (all of its pipeline stages)
    first: bool  # holds the embedding
    last: bool  # holds the final norm, the head and the loss
    act: int  # bytes of an activation in compute precision (bf16 projections' outputs, routed rows)
    mtp: tuple[int, ...] = ()  # the multi-token-prediction modules it runs, as layers n_layers + k (the last stage)
    ranks_per_node: int | None = None  # where the experts' exchange crosses nodes (None: the world is one node)

    def group(self, *axes: str) -> tuple[int, ...]:
        return _group_of(self.layout, self.rank, axes)

    @property
    def tokens(self) -> int:
        """This rank's tokens of one micro-batch: its S/cp positions of each sequence."""
        return self.micro * self.config.model.seq_len // self.layout.cp


@functools.lru_cache(maxsize=65536)
def coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """``parallel.ranks.coordinates``, remembered (read, never changed, here)."""
    return _coordinates(layout, rank)


@functools.lru_cache(maxsize=65536)
def _group_of(layout: Layout, rank: int, axes: tuple[str, ...]) -> tuple[int, ...]:
    """The ranks of ``rank``'s group along ``axes`` (remembered: the planner asks for the same groups often)."""
    return tuple(next(g for g in groups_for(layout, *axis_view(*axes)) if rank in g))


def _add(out: list[Traffic], dimension: str, collective: str, what: str, calls: int, buffer: int,
         group: tuple[int, ...]) -> None:
    if calls and len(group) > 1:
        out.append(Traffic(dimension, collective, what, calls, calls * bus_bytes(collective, buffer, len(group)),
                           group))


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
    """Activation collectives over the tp group (module docstring: which, and why that many)."""
    layout, model, par = step.layout, step.config.model, step.config.parallel
    out: list[Traffic] = []
    if layout.tp == 1:
        return out
    tp, m, group = layout.tp, step.microbatches, step.group("tp")
    full = step.tokens * model.d_model  # elements of one [micro, S, D] stream
    sp, fp32, act = par.sequence_parallel, 4, step.act
    moe_layers = [i for i in step.layers if model.is_moe_layer(i)]
    dense_layers = [i for i in step.layers if not model.is_moe_layer(i)]
    full_recompute = int(par.activation_checkpointing == "full")

    def pair(what: str, n_layers: int, recompute_out: int) -> None:
        """A column- then row-parallel pair on the stream: attention or a SwiGLU FFN."""
        runs = n_layers * m * (1 + full_recompute)
        if sp:
            _add(out, "tp", "all_gather", f"{what} input sequence (forward)", runs, full * fp32, group)
            _add(out, "tp", "reduce_scatter", f"{what} output (forward)",
                 n_layers * m * (1 + recompute_out), full * act, group)
            _add(out, "tp", "all_gather", f"{what} output gradient (backward)", n_layers * m, full * act, group)
        else:
            _add(out, "tp", "all_reduce", f"{what} output (forward)", n_layers * m * (1 + recompute_out),
                 full * act, group)
        if what == "attention" and model.latent_attention:
            latent_gradients(len(step.layers))
            return
        _add(out, "tp", "reduce_scatter" if sp else "all_reduce", f"{what} input gradient (backward)",
             n_layers * m, full * fp32, group)

    def latent_gradients(n_layers: int) -> None:
        """Latent attention's input gradient (``parallel/tensor.py``): whole on every rank, so no collective at
        the block's input; instead the inputs each rank's heads use in part have their gradients summed: the
        query's (the latent [T, c'], or the block input [T, D] without a bottleneck), the key/value latent's
        [T, c] and the shared rotary key's [T, r], all in the activations' dtype (counted: under bf16 autocast the
        column-parallel projections reduce their input's gradient before it is cast back to fp32, and RoPE
        returns its input's dtype)."""
        query = model.q_lora_rank or model.d_model
        for name, width in (("query latent", query), ("key/value latent", model.kv_lora_rank),
                            ("shared rotary key", model.qk_rope_head_dim)):
            _add(out, "tp", "all_reduce", f"attention {name} gradient (backward)", n_layers * m,
                 step.tokens * width * act, group)

    pair("attention", len(step.layers), full_recompute)
    pair("dense FFN", len(dense_layers), 0)  # early-stopping recompute ends before the FFN's output
    if moe_layers:
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
        _add(out, "tp", "all_gather", "routed rows' shares (forward)", moe_runs, padded * tp, group)
        _add(out, "tp", "all_gather", "routed rows' share gradients (backward)", len(moe_layers) * m, padded * tp,
             group)
    if sp and layout.dp_cp > 1:
        # the norms' weights see a sequence slice: DTensor leaves their gradients partial, and FSDP's gradient
        # reduction makes them whole over tp first (without FSDP the gradient-norm step does, once: left out)
        norms = 2 * len(step.layers) + (step.last and not step.mtp)  # beside MTP the final norm runs whole
        syncs = _gradient_syncs(step)
        _add(out, "tp", "all_reduce", "sequence-parallel norm weights' gradients (backward)", norms * syncs,
             model.d_model * fp32, group)
    if model.qk_norm and layout.dp_cp > 1:  # the per-head q/k norms see this rank's heads: the same, [hd] each
        _add(out, "tp", "all_reduce", "query/key norm weights' gradients (backward)",
             2 * len(step.layers) * _gradient_syncs(step), model.head_size * fp32, group)
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
        if sp and step.mtp:  # their one call gathers the last hidden states and Emb(t); their gradients come back
            # as this rank's slices, with no collective
            _add(out, "tp", "all_gather", "MTP inputs: hidden states and Emb(t) (forward)", 2 * m, full * fp32,
                 group)
        if par.vocab_parallel:  # beside MTP the head takes the whole sequence (the final norm gathers it)
            _add(out, "tp", "reduce_scatter" if sp and not step.mtp else "all_reduce",
                 "head input gradient (backward)", m, full * fp32, group)
            _add(out, "tp", "all_reduce", "vocab-parallel loss: max, sum, target logit (forward)", 3 * m,
                 step.tokens * fp32, group)
    return out


def context_parallel_traffic(step: _Step) -> list[Traffic]:
    """The cp group's collectives (module docstring): keys and values gathered in every attention layer, their
    gradients reduce-scattered, and the balancing counts summed in every MoE layer."""
    layout, model, moe = step.layout, step.config.model, step.config.moe
    out: list[Traffic] = []
    if layout.cp == 1:
        return out
    group, m, seq = step.group("cp"), step.microbatches, model.seq_len
    if model.latent_attention:  # the normalised latent and the rotated shared key of every position
        gathered = step.micro * seq * (model.kv_lora_rank + model.qk_rope_head_dim) * step.act
    else:  # k and v of this tp rank's key/value heads, on the channel dim
        gathered = step.micro * (model.kv_heads // layout.tp) * seq * 2 * model.head_size * step.act
    attention_runs = len(step.layers) * m * (1 + int(step.config.parallel.activation_checkpointing == "full"))
    _add(out, "cp", "all_gather", "keys and values of the sequence (forward)", attention_runs, gathered, group)
    _add(out, "cp", "reduce_scatter", "keys' and values' gradients (backward)", len(step.layers) * m, gathered,
         group)
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
    if step.ranks_per_node and exchanges_by_node(layout, config.moe.top_k, step.ranks_per_node):
        return node_exchange_traffic(step, forwards, backwards)
    if exchanges_pairs(layout.ep, layout.tp, config.moe.top_k):
        return pair_exchange_traffic(*exchange_counts(config.moe, step.tokens, layout.ep), me, group,
                                     config.model.d_model * step.act, forwards, backwards, config.moe.num_experts)
    kept = kept_per_expert(config, step.tokens)
    sent = _exchange_rows(step, step.rank, kept)
    rows_out = sum(sent) - sent[me]
    rows_in = sum(_exchange_rows(step, q, kept)[me] for q in group if q != step.rank)
    row = config.model.d_model * step.act
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


def _gradient_syncs(step: _Step) -> int:
    """Gradient reductions (reduce-scatters) of one FSDP unit per step: one under ``parallel.grad_reduce=step``
    (on the last micro-batch), one per micro-batch under ``microbatch``; with or without pipelining."""
    return 1 if step.config.parallel.grad_reduce == "step" else step.microbatches


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


def pipeline_traffic(step: _Step) -> list[Traffic]:
    """Hidden states forward, their gradients backward, per micro-batch and stage boundary; the loss broadcast."""
    layout, config, par = step.layout, step.config, step.config.parallel
    out: list[Traffic] = []
    if layout.pp == 1:
        return out
    seq = config.model.seq_len // layout.cp // (layout.tp if par.sequence_parallel else 1)
    hidden = step.micro * seq * config.model.d_model * 4  # fp32: the residual stream
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


def predict(config: RunConfig, layout: Layout, rank: int = 0, precision: str | None = None,
            ranks_per_node: int | None = None) -> list[Traffic]:
    """Every collective ``rank`` runs in one optimizer step of ``config`` under ``layout``, per dimension.

    ``precision`` (bf16 or fp32) overrides ``train.precision``; ``auto`` counts as bf16, what it picks on GPUs.
    ``ranks_per_node``: the node size torchrun will give (``--nproc-per-node``, the run's LOCAL_WORLD_SIZE), which
    decides whether the experts' exchange goes in two hops (``parallel/node_dispatch.py``); ``parallel.ranks_per_node``
    overrides it, as it does at run time; with neither, the world is taken as one node.
    """
    micro, microbatches = micro_batching(config, layout.dp, layout.pp)
    precision = precision or config.train.precision
    if layout.pp > 1:
        ranges = stage_layers(config.model, config.moe, layout.pp * config.parallel.pp_virtual_stages)
        pp_rank = coordinates(layout, rank)["pp"]
        mine = range(pp_rank, len(ranges), layout.pp)
        layers = tuple(i for s in mine for i in ranges[s])
        first, last = 0 in mine, len(ranges) - 1 in mine
    else:
        layers, first, last = tuple(range(config.model.n_layers)), True, True
    mtp = tuple(mtp_layers(config.model)) if last else ()
    step = _Step(config, layout, rank, micro, microbatches, layers, first, last, 4 if precision == "fp32" else 2, mtp,
                 config.parallel.ranks_per_node or ranks_per_node)
    return [*tensor_parallel_traffic(step), *context_parallel_traffic(step), *expert_parallel_traffic(step),
            *mtp_traffic(step),
            *sharding_traffic(step), *pipeline_traffic(step), *muon_traffic(step)]


# ---------------------------------------------------------------------------
# Time on the links, and the command line
# ---------------------------------------------------------------------------


def bandwidth(item: Traffic, hardware: Hardware, gpus_per_node: int) -> float:
    """Bytes/s ``item`` gets from its links: NVLink at NCCL's share (``Hardware.intra_efficiency``, ``NCCL_EFFICIENCY``;
    1 for a preset whose link rate is itself measured by collectives) inside a node; across
    nodes the rank's own adapter at ``Hardware.network_efficiency`` (``NETWORK_EFFICIENCY``), for every collective.

    A ring whose group has k ranks in each node could in principle send its bytes over the k adapters of the
    node together (NCCL's channels, one per adapter), and nccl-tests reach that on idle nodes (85 to 96 GB/s
    of all-reduce bus bandwidth over nodes of 8 GPUs and 4 HDR adapters: NVIDIA/nccl-tests issue #119). The training
    steps of Narayanan et al. 2021 Table 2 did not: ZeRO-3 of a 175B model took the same 66.7 s per step on 768
    and on 1,536 A100s (and a 530B model 180 and 184 s on 1,120 and 2,240), with 8 of each node's GPUs in
    every ring. A step that does not shrink as the compute halves is bound by traffic at a fixed rate per GPU;
    its bytes (``predict``: 8 per parameter) over that time are 0.85 to 1.0 of one 25 GB/s HDR adapter per
    GPU, where the node's 8 adapters per ring at NCCL's 80% would have moved them in a sixth or a seventh of
    the time. So rings across nodes are priced at the rank's own adapter, as measured in training, not at the
    node's. (Why those rings did not use the node's adapters is not known here.)
    """
    if item.link(gpus_per_node) == "intra":
        return hardware.intra_node * hardware.intra_efficiency
    return hardware.inter_node * hardware.network_efficiency


def ring_steps(item: Traffic, gpus_per_node: int) -> tuple[int, int]:
    """(steps, of which cross nodes) of one call of ``item``, as NCCL's tuning model counts a ring's
    (``NCCL_LATENCY``): all-reduce 2(n − 1) and 2(k − 1) over k nodes, all-gather and reduce-scatter n − 1 and
    k − 1. A broadcast is a chain of n − 1 steps; a send is one step. An all-to-all posts its sends to and
    receives from all n − 1 peers before it waits for any (gloo/alltoall.cc and alltoallv.cc; PyTorch's NCCL
    all-to-all groups one send and one receive per peer), so its exchanges wait together: one step, across
    nodes if any peer is in another node."""
    n, k = len(item.group), nodes_spanned(item.group, gpus_per_node)
    if item.collective == "all_reduce":
        return 2 * (n - 1), 2 * (k - 1)
    if item.collective == "all_to_all":
        return 1, int(k > 1)
    return n - 1, k - 1  # all-gather, reduce-scatter, broadcast; a send's group is (sender, receiver)


def startup(item: Traffic, hardware: Hardware, gpus_per_node: int) -> float:
    """Seconds ``item``'s calls spend on latency: per call ``Latency.call`` plus each ring step's."""
    steps, crossing = ring_steps(item, gpus_per_node)
    lat = hardware.latency
    return item.calls * (lat.call + (steps - crossing) * lat.intra_step + crossing * lat.inter_step)


def seconds(item: Traffic, hardware: Hardware, gpus_per_node: int) -> float:
    """Time of ``item`` on its links: its latency (``startup``) and its bytes at ``bandwidth`` (no overlap with
    compute)."""
    return startup(item, hardware, gpus_per_node) + item.bus_bytes / bandwidth(item, hardware, gpus_per_node)


def format_table(items: list[Traffic], hardware: Hardware, gpus_per_node: int) -> str:
    """One line per traffic item, then the totals per dimension and per link."""
    rows = [f"{'dim':<5} {'collective':<14} {'ranks':>5} {'link':<5} {'calls':>6} {'MiB':>10} {'ms':>9}  what"]
    for item in items:
        rows.append(f"{item.dimension:<5} {item.collective:<14} {len(item.group):>5} {item.link(gpus_per_node):<5} "
                    f"{item.calls:>6} {item.bus_bytes / 2**20:>10.2f} "
                    f"{seconds(item, hardware, gpus_per_node) * 1e3:>9.3f}  {item.what}")
    rows.append("")

    def total(label: str, chosen: list[Traffic]) -> str:
        time = sum(seconds(i, hardware, gpus_per_node) for i in chosen)
        return f"{label:<26} {sum(i.bus_bytes for i in chosen) / 2**20:>10.2f} {time * 1e3:>9.3f}"

    for label, key in (("dimension", lambda i: i.dimension), ("link", lambda i: i.link(gpus_per_node))):
        for value in dict.fromkeys(map(key, items)):
            rows.append(total(f"total {label} {value}", [i for i in items if key(i) == value]))
    rows.append(total("total", items))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-communication", "Collective traffic of one rank in one optimizer step.")
    add_config_arguments(parser, set_help="override config keys, e.g. --set parallel.tp=2 parallel.ep=4")
    add_world_size(parser, default=8, help="number of ranks (GPUs)")
    parser.add_argument("--rank", type=int, default=0, help="which rank to describe (traffic can differ by rank)")
    add_hardware_arguments(parser)
    args = parser.parse_args(argv)

    def describe_traffic() -> None:
        world_size = world_size_of(args)
        config = load_config_from(args)
        layout, micro, microbatches = resolve_layout(config, world_size)
        if not 0 <= args.rank < layout.world_size:
            raise ConfigError(f"--rank {args.rank} is outside the world of {layout.world_size} ranks")
        hardware = hardware_from_args(args)
        gpus_per_node = hardware.gpus_per_node
        precision = planned_precision(config.train.precision)
        print(f"{config.name}: {layout.degrees()} on {layout.world_size} ranks, {gpus_per_node} per node; rank "
              f"{args.rank}; {microbatches} micro-batch(es) of {micro} x {config.model.seq_len} tokens; {precision}")
        print(f"bandwidth per GPU, one way: {hardware.intra_node / 1e9:.0f} GB/s in a node, "
              f"{hardware.inter_node / 1e9:.0f} GB/s between nodes ({hardware.name}; {hardware.source})")
        print(format_table(predict(config, layout, args.rank, precision, ranks_per_node=gpus_per_node), hardware,
                           gpus_per_node))
        if layout.ep > 1 and any(config.model.is_moe_layer(i) for i in range(config.model.n_layers)):
            print(describe_reach(config.moe, layout, gpus_per_node, args.rank))

    return run_command(describe_traffic)


if __name__ == "__main__":
    sys.exit(main())
