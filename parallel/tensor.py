"""Tensor parallelism: each tp rank holds a slice of every attention and feed-forward matrix.

``apply_tensor_parallel`` hands each block to DTensor's ``parallelize_module`` with Megatron's pairing
(Shoeybi et al. 2019, sec. 3): a column-parallel projection followed by a row-parallel one, so one
all-reduce per pair in forward (after the row-parallel output) and one in backward (at the
column-parallel input).

- attention: ``wq``, ``wk``, ``wv`` column-parallel, i.e. split by heads (tp divides both head counts;
  ``Attention.forward`` reshapes with ``-1`` heads, so it runs on its nh / tp local heads unchanged);
  ``wo`` row-parallel (its bias, ``model.attn_output_bias``, whole and added once after the sum, as
  ``RowwiseParallel`` does). GPT-OSS's attention sinks (one per query head) are split with their heads
  (``Shard(0)``); the sliding window needs nothing: every rank sees the whole sequence. The per-head
  query/key norms (``model.qk_norm``) stay whole on every rank and run on its local heads: DTensor's
  ``SequenceParallel`` style over the heads dim, so their weights' gradients, each rank's sum over its own
  heads, are summed over tp like the sequence-parallel norms'. Latent attention
  (``moe/attention/latent.py``) splits its per-head projections the same way and keeps its latent projections
  whole (``_latent_attention_plan``); sparse latent attention keeps its indexer whole as well and sums the indexer's
  target over the ranks' heads (``_sparse_latent_plan``). Gated DeltaNet (``moe/attention/gated_delta.py``)
  splits by key heads, each with its value heads: its projections column-parallel, its convolution's channels
  and per-head decay parameters ``Shard(0)`` with them, ``wo`` row-parallel (``_gated_delta_plan``); the
  recurrence needs no other rank's heads.
- dense SwiGLU FFN and the MoE layer's shared experts: ``w_in`` and ``w_gate`` column-parallel (split on
  the hidden dim), ``w_out`` row-parallel.
- the router stays whole on every tp rank: it must see the full hidden vector in fp32 so every tp rank
  routes identically (``moe/router.py``). So do the norms, the embedding and the head unless the options
  below split them.

Between the pairs the activations are replicated over the tp group by default. Two options shard more:

- **sequence parallelism** (``sequence_parallel``; Korthikanti et al. 2022, arXiv:2205.05198, sec. 4.2.2):
  the residual stream, the norms and DeepSeek-V4's hyper-connections (``_PerTokenSlice``) work on a 1/tp slice
  of the sequence, so the activations outside the pairs take 1/tp of the memory. Each pair's forward all-reduce
  becomes an all-gather of the sequence before it and a reduce-scatter after it: the same bytes. The MoE
  layer gathers the whole sequence before routing and keeps its slice of the output:
  routing a slice would route different token groups (capacity) and take the balancing loss over a part
  of the batch, so the model would no longer be the single-process one. The multi-token-prediction modules
  run on the whole sequence, gathered for them (``_ends_plan``).
- **vocabulary parallelism** (``vocab_parallel``; Megatron's parallel embedding and cross-entropy,
  Shoeybi et al. 2019 sec. 3): the embedding table and the LM head are split over the vocabulary, and the
  loss is computed from the vocabulary-sharded logits (``loss_parallel``) without ever gathering the
  [tokens, V] logits on one rank. ``loss_context`` gives the context that the loss and its backward must
  run in.

Without sequence parallelism the tokens entering an MoE layer are the same on every tp rank, and with it
they are too once gathered. The routed experts would compute them once per tp rank; sending them over
the expert all-to-all once per tp rank would multiply its traffic by tp. ``scatter_rows`` and
``gather_rows`` prevent both: each tp rank takes a distinct 1/tp share of the layer's grouped rows
(contiguous, so still grouped by expert), exchanges (under expert parallelism) and computes only that
share, and the shares are all-gathered over tp afterwards. The expert all-to-all then moves exactly the
kept assignments once. Under expert tensor parallelism the etp ranks (consecutive within the tp group)
hold the same share, each computing a partial sum over its slice of the experts' hidden dim; the gather
adds them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from config.errors import ConfigError
from config.model import ModelConfig
from moe.attention import (
    CompressedSparseAttention,
    GatedDeltaAttention,
    GroupedQueryAttention,
    HeavilyCompressedAttention,
    LatentAttention,
    SharedKVAttention,
    SharedSelectionAttention,
    SparseLatentAttention,
)
from moe.block import Block
from moe.transformer import MoETransformer


def check_tensor_parallel(tp: int, model: ModelConfig, sequence_parallel: bool, vocab_parallel: bool) -> None:
    """Refuse, before anything is built, an option tensor parallelism cannot apply; ConfigError names the fix."""
    for key, enabled, size, what in (("sequence_parallel", sequence_parallel, model.seq_len, "model.seq_len"),
                                     ("vocab_parallel", vocab_parallel, model.vocab_size, "model.vocab_size")):
        if not enabled:
            continue
        if tp == 1:
            raise ConfigError(f"parallel.{key}=true shards over the tensor-parallel ranks, but parallel.tp=1; "
                              f"set parallel.tp > 1 or parallel.{key}=false")
        if size % tp:
            raise ConfigError(f"parallel.{key}=true splits {what}={size} over parallel.tp={tp} ranks, which does "
                              f"not divide it; use a tp that divides {size}, or parallel.{key}=false")


def _feed_forward_plan(prefix: str, stream: Placement) -> dict:
    """A SwiGLU FFN at ``prefix`` reading and writing ``stream``: w_in, w_gate column- then w_out row-parallel."""
    return {prefix: _shared_input(stream), f"{prefix}.w_in": ColwiseParallel(), f"{prefix}.w_gate": ColwiseParallel(),
            f"{prefix}.w_out": RowwiseParallel(output_layouts=stream)}


def _shared_input(stream: Placement, num_inputs: int = 1) -> PrepareModuleInput:
    """The module's first input as one replicated DTensor, gathered whole if it comes as a sequence slice.

    Its column-parallel projections (q, k, v; gate and in) all read this one DTensor, so in backward their
    partial input gradients are added first and reduced once: one all-reduce per pair, or one
    reduce-scatter back to the sequence slice, as Megatron-LM does. Given a plain tensor each projection
    would wrap it on its own and reduce its gradient separately: three all-reduces for attention. The
    other inputs (RoPE tables) pass untouched.
    """
    rest = (None,) * (num_inputs - 1)
    return PrepareModuleInput(input_layouts=(stream, *rest), desired_input_layouts=(Replicate(), *rest))


class _SumGradient(ParallelStyle):
    """The module's output as it is in forward; in backward its gradient summed over the tp ranks (Megatron's
    "f" operator, Shoeybi et al. 2019, fig. 3): for a replicated value that each rank uses only in part."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_module, _inputs, output: Tensor) -> Tensor:
            # a gradient declared Partial, redistributed to the Replicate the value came as: an all-reduce
            replicated = DTensor.from_local(output, device_mesh, [Replicate()], run_check=False)
            return replicated.to_local(grad_placements=[Partial()])

        module.register_forward_hook(hook)
        return module


class _PerTokenSlice(ParallelStyle):
    """Replicated weights acting on each token alone, run on this rank's sequence slice: the hyper-connections
    (``moe/hyper_connections.py``) under sequence parallelism. As ``SequenceParallel`` does for the norms, its
    parameters become replicated DTensors and its first input the slice as a DTensor sharded on dim 1, so its
    weights' gradients, each rank's tokens' part, come out partial and are summed over tp (by FSDP's gradient
    reduction, or by DTensor where next used); plain tensors would keep each rank's part alone. Its outputs (a
    tuple for the collapse) leave as this rank's plain slices; no collective runs in forward or backward."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate(_name: str, owner: nn.Module, mesh: DeviceMesh) -> None:
            for name, param in list(owner.named_parameters(recurse=False)):
                owner.register_parameter(name, nn.Parameter(DTensor.from_local(param, mesh, run_check=False)))

        def slice_in(_module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return DTensor.from_local(inputs[0], mesh, [Shard(1)], run_check=False), *inputs[1:]

        def slices_out(_module: nn.Module, outputs, _mesh: DeviceMesh):
            return tuple(o.to_local() for o in outputs) if isinstance(outputs, tuple) else outputs.to_local()

        return distribute_module(module, device_mesh, replicate, slice_in, slices_out)


def _latent_attention_plan(block: Block, stream: Placement) -> dict:
    """Latent attention split by heads: ``wq``/``wq_b`` and ``wkv_b`` column-, ``wo`` row-parallel.

    The latent projections (``wq_a``, ``wkv_a``) and their norms stay whole: every head reads their whole
    output, and they are small (c' + c + r rows against nh·(n + r) and nh·(n + v)). The block's input reaches
    them as a plain tensor, whole on every rank (gathered first under sequence parallelism); its gradient is
    whole there too because each input a rank uses in part has its gradient summed over tp on the way back:
    the two latents' at the column-parallel ``wq_b``/``wkv_b`` inputs, the shared rotary key's by
    ``shared_rope_key``. So three small all-reduces ([T, c'], [T, c], [T, r]) replace the one of [T, D] at the
    input of grouped-query attention; the replicated weights' gradients are then whole on every rank.
    """
    gathered = PrepareModuleInput(input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None),
                                  use_local_output=True)
    plan = {"attn": gathered, "attn.wkv_b": ColwiseParallel(), "attn.shared_rope_key": _SumGradient(),
            "attn.wo": RowwiseParallel(output_layouts=stream)}
    plan["attn.wq" if block.attn.wq is not None else "attn.wq_b"] = ColwiseParallel()
    return plan


def _grouped_query_plan(block: Block, stream: Placement) -> dict:
    """Grouped-query attention split by heads: ``wq``, ``wk``, ``wv`` column-, ``wo`` row-parallel; the per-head
    q/k norms see this rank's heads, a shard of dim 2 of [B, S, heads, hd]."""
    plan = {"attn": _shared_input(stream, num_inputs=3), "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=stream)}
    if block.attn.wg is not None:
        plan["attn.wg"] = ColwiseParallel()
    if block.attn.q_norm is not None:
        plan.update({"attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                     "attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)})
    return plan


class _SumOutput(ParallelStyle):
    """The module's output summed over the tp ranks in forward (an all-reduce), for a value made without gradient
    from each rank's heads: sparse attention's (and V4's compressed sparse attention's) sum of the attention
    probabilities over the heads, the indexer's target, which every rank then holds whole."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(_module, _inputs, output: Tensor) -> Tensor:
            partial = DTensor.from_local(output, device_mesh, [Partial()], run_check=False)
            return partial.redistribute(device_mesh, [Replicate()]).to_local()

        module.register_forward_hook(hook)
        return module


def _sparse_latent_plan(block: Block, stream: Placement) -> dict:
    """Sparse latent attention: latent attention's split, the indexer whole on every rank (its inputs, the block
    input and the query latent, are whole there, so every rank selects the same keys and computes the same loss,
    its gradients whole), and the indexer's target summed over the ranks' heads (``head_sum``); on the gathered
    kernel, which reads the latent itself rather than through ``wkv_b``, the latent's gradient (``shared_latent``)."""
    return _latent_attention_plan(block, stream) | {"attn.head_sum": _SumOutput(), "attn.shared_latent": _SumGradient()}


def _gated_delta_plan(block: Block, stream: Placement) -> dict:
    """Gated DeltaNet split by key heads, each with its value heads: the projections to q, k, v, z, beta and a
    column-, ``wo`` row-parallel; the gated norm (one weight shared by the heads) on this rank's value heads, a
    shard of dim 2 of [B, S, heads, dv]. The convolution (per channel) and the decay parameters (per value head)
    are split with them by ``apply_tensor_parallel``; the recurrence runs on each rank's heads alone."""
    return {"attn": _shared_input(stream, num_inputs=3),
            **{f"attn.{name}": ColwiseParallel() for name in ("wq", "wk", "wv", "wz", "wb", "wa")},
            "attn.out_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
            "attn.wo": RowwiseParallel(output_layouts=stream)}


def _shared_kv_plan(block: Block, stream: Placement) -> dict:
    """DeepSeek-V4's attention split by heads, whole groups of them: ``q_b_proj`` column-parallel, the grouped
    ``o_a_proj`` split by rows with its groups (``HEAD_PARAMETERS``), ``o_b_proj`` row-parallel. The query latent's
    projection and norm, the one key/value head, the compressors and the indexer stay whole: every head reads their
    whole output, so the block input comes whole (gathered under sequence parallelism) and keeps a whole gradient,
    the query latent's summed at ``q_b_proj``'s input and the shared keys' and entries' at ``shared_keys``; the
    indexer, on whole inputs, selects the same entries on every rank."""
    gathered = PrepareModuleInput(input_layouts=(stream, None, None), desired_input_layouts=(Replicate(), None, None),
                                  use_local_output=True)
    return {"attn": gathered, "attn.q_b_proj": ColwiseParallel(), "attn.shared_keys": _SumGradient(),
            "attn.o_b_proj": RowwiseParallel(output_layouts=stream)}


def _compressed_sparse_plan(block: Block, stream: Placement) -> dict:
    """DeepSeek-V4's compressed sparse attention: the split of ``_shared_kv_plan``, and its indexer's target, the
    attention probabilities of the entries summed over the heads, summed over the ranks' heads (``head_sum``)."""
    return _shared_kv_plan(block, stream) | {"attn.head_sum": _SumOutput()}


# each attention kind's split over the tp ranks (a new kind adds its plan here)
ATTENTION_PLANS = {GroupedQueryAttention: _grouped_query_plan, LatentAttention: _latent_attention_plan,
                   SparseLatentAttention: _sparse_latent_plan, GatedDeltaAttention: _gated_delta_plan,
                   SharedKVAttention: _shared_kv_plan, HeavilyCompressedAttention: _shared_kv_plan,
                   CompressedSparseAttention: _compressed_sparse_plan, SharedSelectionAttention: _sparse_latent_plan}
# parameters of a kind that are not a Linear's, split with its heads on dim 0 (``apply_tensor_parallel``)
HEAD_PARAMETERS = ("sinks", "conv_q", "conv_k", "conv_v", "decay_bias", "log_decay_rate", "o_a_proj.weight")


def _block_plan(block: Block, sequence_parallel: bool) -> dict:
    """How one block's modules are split; ``sequence_parallel``: the residual stream is a sequence slice."""
    stream = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout over tp
    plan = ATTENTION_PLANS[type(block.attn)](block, stream)
    if block.ffn is not None:
        plan.update(_feed_forward_plan("ffn", stream))
    elif block.moe.shared_experts is not None:  # inside the MoE layer, which sees the whole sequence
        plan.update(_feed_forward_plan("moe.shared_experts", Replicate()))
    if sequence_parallel:
        plan.update({"attn_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        if block.attn_hc is not None:  # the hyper-connections on the slice of the streams, [B, S / tp, n, D]
            plan.update({"attn_hc": _PerTokenSlice(), "ffn_hc": _PerTokenSlice()})
        if block.moe is not None:  # route the whole sequence, as one process does; keep this rank's slice of the output
            plan["moe"] = PrepareModuleInputOutput(
                input_layouts=Shard(1), desired_input_layouts=Replicate(), use_local_input=True,
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True)
    return plan


def _ends_plan(model: MoETransformer, sequence_parallel: bool, vocab_parallel: bool) -> dict:
    """Embedding, final norm and head; a pipeline stage without them has ``nn.Identity`` in their place.

    Under sequence parallelism the multi-token-prediction modules run on the whole sequence, replicated over tp
    as without the option: module k shifts the hidden states and embeddings by k positions and works on S - k
    of them, which a slice of S / tp positions per rank could not cut evenly. Their one call (``mtp``) takes the
    final norm's whole output and gathers the embedding's, and its backward keeps this rank's slice of the
    embedding's gradient (whole and the same on every rank, as the replicated modules' are). The shared head then
    gets whole sequences from both callers: the final norm gathers its input and runs whole (its weight's
    gradient then is whole on every rank too), and the head is a plain replicated projection.
    """
    stream = Shard(1) if sequence_parallel else Replicate()
    whole_head = sequence_parallel and model.mtp is not None
    plan = {}
    if sequence_parallel and model.hc_head is not None:  # the streams' final collapse, on their slice
        plan["hc_head"] = _PerTokenSlice()
    if whole_head:
        # the final norm's output comes whole (it gathers its input, below), the last block's streams (with
        # hyper-connections) and the embedding's output as slices
        hidden = Replicate() if model.hc_head is None else Shard(1)
        plan["mtp"] = PrepareModuleInput(input_layouts=(hidden, Shard(1), None, None, None, None),
                                         desired_input_layouts=(Replicate(), Replicate(), None, None, None, None),
                                         use_local_output=True)
    if isinstance(model.tok_embeddings, nn.Embedding):
        if vocab_parallel:  # each rank looks up the tokens of its vocabulary slice; the partial rows are summed
            plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=stream)
        elif sequence_parallel:
            plan["tok_embeddings"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=stream)
    if isinstance(model.output, nn.Linear):
        if whole_head:
            plan["norm"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                              use_local_output=True)
        elif sequence_parallel:
            plan["norm"] = SequenceParallel()
        head_input = Replicate() if whole_head else stream  # the whole sequence from both callers, or the stream
        if vocab_parallel and model.config.tie_embeddings:
            # the head's weight is the embedding's, already split over the vocabulary: a replicated input
            # times it gives vocabulary-sharded logits by itself
            plan["output"] = PrepareModuleInput(input_layouts=head_input, desired_input_layouts=Replicate())
        elif vocab_parallel:
            plan["output"] = ColwiseParallel(input_layouts=head_input, output_layouts=Shard(-1),
                                             use_local_output=False)
        elif sequence_parallel and not whole_head:  # the whole head, on the whole sequence
            plan["output"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                                use_local_output=True)
    return plan


def apply_tensor_parallel(model: MoETransformer, tp_mesh: DeviceMesh, sequence_parallel: bool = False,
                          vocab_parallel: bool = False) -> None:
    """Shard every block's attention, dense FFN and shared experts over ``tp_mesh`` (in place).

    The sharded weights become DTensors on the tp mesh with the single-process names and global shapes, so
    FSDP2 composes with them (2-D: dp shards of tp shards) and the state dict is the unsharded one. With
    ``vocab_parallel`` the model returns its logits as a DTensor sharded over the vocabulary (last dim); the
    loss and its backward then run in ``loss_context(True)``.
    """
    mtp_blocks = {id(module.block) for module in model.mtp or []}
    for block in model.blocks():  # the multi-token-prediction modules' too, on the whole sequence (``_ends_plan``):
        # their input is replicated, their projection and norms stay whole
        parallelize_module(block, tp_mesh, _block_plan(block, sequence_parallel and id(block) not in mtp_blocks))
        for name in HEAD_PARAMETERS:  # GPT-OSS's sinks, Gated DeltaNet's convolution and decay, V4's o_a_proj
            owner_name, _, leaf = name.rpartition(".")
            owner = getattr(block.attn, owner_name, None) if owner_name else block.attn
            if owner is not None and getattr(owner, leaf, None) is not None:
                value = getattr(owner, leaf).data
                setattr(owner, leaf, nn.Parameter(distribute_tensor(value, tp_mesh, [Shard(0)])))
    ends = _ends_plan(model, sequence_parallel, vocab_parallel)
    if ends:
        parallelize_module(model, tp_mesh, ends)
    if vocab_parallel and model.config.tie_embeddings:  # the embedding got a new (DTensor) parameter: re-tie
        model.output.weight = model.tok_embeddings.weight
    elif vocab_parallel and isinstance(model.tok_embeddings, nn.Embedding):
        model.tok_embeddings.__class__ = SplitEmbedding  # same parameters and hooks; its gradient kept split


class SplitEmbedding(nn.Embedding):
    """A vocabulary-split embedding (``vocab_parallel``, untied) whose weight's gradient stays as split as the weight.

    DTensor differentiates the split lookup into the whole table's gradient on every tp rank (``Replicate``: [V, D]
    fp32 where the weight holds V/tp rows; measured on torch 2.13), which would then stay for the step and go whole
    into the gradient norm, the optimizer and, under pipelining with multi-token prediction, the embedding's
    all-reduce between the two ends. ``_OwnRowsGradient`` cuts it to this rank's rows as it leaves the lookup:
    from ``Replicate`` to ``Shard`` is a local slice, no communication. Tied to the head the gradient is the head's,
    already split. A subclass (set on the instance) rather than a parameter hook, which would not survive the
    parameters' materialisation (``parallel.materialize``).
    """

    def forward(self, input: Tensor) -> Tensor:
        return F.embedding(input, _OwnRowsGradient.apply(self.weight), self.padding_idx, self.max_norm,
                           self.norm_type, self.scale_grad_by_freq, self.sparse)


class _OwnRowsGradient(torch.autograd.Function):
    """The identity on a DTensor weight; its gradient redistributed to the weight's placements."""

    @staticmethod
    def forward(ctx, weight: Tensor) -> Tensor:
        ctx.mesh, ctx.placements = weight.device_mesh, weight.placements
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        if isinstance(grad, DTensor) and grad.placements != ctx.placements:
            return grad.redistribute(ctx.mesh, ctx.placements)
        return grad


def loss_context(vocab_parallel: bool) -> AbstractContextManager:
    """Where the loss of vocabulary-sharded logits, and its backward, must run: torch's ``loss_parallel``.

    Cross-entropy then works on each rank's vocabulary slice, with a max and a sum of the [tokens] values
    all-reduced over tp instead of the [tokens, V] logits gathered.
    """
    return loss_parallel() if vocab_parallel else nullcontext()


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
        # a copy, not a view: the experts save their input for backward, and a view would keep all N rows
        return x[bounds[share]:bounds[share + 1]].clone()

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


IGNORED = -100  # a target that is no token: padding the loss skips (``F.cross_entropy``'s ignore_index)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Mean next-token cross-entropy (or with ``reduction="sum"`` the sum): logits [B, S, V], targets [B, S];
    targets of ``IGNORED`` (padding) count for nothing.

    Vocabulary-parallel logits (a DTensor sharded over V) need ``parallel.tensor.loss_context`` around this
    and the backward; the loss, replicated over tp, comes back as a plain tensor.
    """
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORED,
                           reduction=reduction)
    return loss.full_tensor() if isinstance(loss, DTensor) else loss

