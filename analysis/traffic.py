"""Collective traffic of one rank in one optimizer step: predicted from a config and a layout, and counted in a run.

``predict(config, layout, rank)`` lists what this toolkit's code sends, per parallel dimension, as
``Traffic`` items (``analysis.traffic_items``: the record and the byte convention, bus bytes);
``analysis.collective_count.CollectiveCounter`` records the collectives a real run issues, so the tests can hold
the two against each other. The planner (``analysis/planner.py``) divides each item's bytes by the bandwidth of
the link it crosses (``analysis.link_time``). The activations' collectives (tp, cp, ep, pp, MTP) are counted in
``analysis.traffic_activations``, the weights' (FSDP, Muon) in ``analysis.traffic_weights``.

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
  normalised latent and the rotated shared key, [micro, S, c + r]; for Gated DeltaNet linear attention, two
  gathers that do not grow with S: each of the 2·cp chunks' last kernel - 1 convolution inputs, [micro, 2·cp·(k -
  1), C] in the compute dtype, and its state map, [2·cp, micro, nv/tp, dk, dk + dv] fp32: the kind's
  ``context_gathers``), again under full recompute; backward, its reduce-scatter, the same bytes. Per MoE layer
  and forward (and recompute), the all-reduce of the balancing loss's assignment counts, [sequences, E] fp32 (one
  row per micro-batch with the batch-wide scope). FSDP shards over dp_shard × cp (its groups below are that
  flattened axis).
- pp (``parallel/pipeline.py``): per micro-batch a send of the fp32 hidden states [micro, S (/cp; /tp under
  sequence parallelism), D] to the next stage and of their gradient to the previous one, and the broadcast of
  the micro-batch losses (float64) from the last stage.
- multi-token prediction (``moe/mtp.py``, on the last stage): module k's block as a block of its kind on S − k
  positions, never sequence-parallel (``mtp_traffic``); under sequence parallelism an all-gather of Emb(t) per
  micro-batch (the final norm's input gathered in place of the head's; its whole output is the modules' input); under pp
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
step-loss and aux-free-bias all-reduces over dp, and routing statistics at log intervals.

Counted in tp's part: the gradients that DTensor leaves partial over tp, those of the replicated weights that see
part of the activations (under sequence parallelism the norms' and DeepSeek-V4's hyper-connections', a sequence
slice; under any tp the per-head query/key norms' and Gated DeltaNet's gated norm's, this rank's heads): with FSDP
its gradient reduction makes each whole (the norms', per micro-batch that it syncs); without it
``parallel.sum_partial_gradients`` makes them all whole in one all-reduce per step, before the gradient norm.

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
latent attention in bf16, cp × tp × ep with sequence parallelism, cp × dp_shard with latent attention, Qwen3-Next's
hybrid in fp32 and in bf16 under full recompute. The time
of each item (``analysis.link_time.seconds``, the time column of ``moe-communication``) is its latency (NCCL's ring
model, ``startup``) plus its bytes over the link's bandwidth; overlap with compute is the planner's business.
"""

from __future__ import annotations

from analysis.memory_states import mtp_layers
from analysis.traffic_activations import (
    context_parallel_traffic,
    expert_parallel_traffic,
    mtp_traffic,
    pipeline_traffic,
    tensor_parallel_traffic,
)
from analysis.traffic_items import Traffic, _Step, coordinates
from analysis.traffic_weights import muon_traffic, sharding_traffic
from config.run import RunConfig
from parallel.layout import Layout
from parallel.pipeline import stage_layers
from parallel.resolve import micro_batching


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
