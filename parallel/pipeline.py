"""Pipeline parallelism: the blocks cut into stages balanced by cost, run by ``torch.distributed.pipelining``.

The ``pp × v`` stages are contiguous runs of blocks; the first also holds the token embedding,
the last the final norm, the LM head and the loss. Stage ``s`` lives on pipeline rank ``s mod pp``
(torch's "loop" placement), so with ``v > 1`` each rank holds ``v`` stages that the interleaved
schedule alternates between. With m micro-batches per step the idle "bubble" is (p−1)/m of the
step for GPipe and 1F1B and (p−1)/(v·m) interleaved (Narayanan et al. 2021, arXiv:2104.04473,
sec. 2.2.1–2.2.2): more micro-batches and more virtual stages shrink it. The split minimises the costliest
stage, in training FLOPs per token from ``moe/accounting.py``: a MoE block with top-k experts costs
more than a dense one, the head adds its vocabulary matmul to the last stage (and the multi-token-prediction
modules their blocks, projections and second pass through the head).

Each stage is the full, seeded model with what it does not run removed: other blocks deleted from
``layers`` (keyed by layer index, so names are unchanged), the embedding, or the norm and head,
replaced by ``nn.Identity``. The model's own ``forward`` then maps tokens or hidden states to hidden
states or logits, the state dicts of all stages together are the single-process model's, and every
stage is parallelized (EP, activation checkpointing, FSDP) by ``parallel.parallelize`` as the
whole model is without pipelining.

Multi-token prediction (``model.mtp_depth``, ``moe/mtp.py``) runs on the last stage, beside the head it shares.
Its modules also embed the next tokens, and the embedding lives on the first stage. Two ways to bring it there:
send Emb(t) [micro, S, D] down the pipeline beside the hidden states (and its gradient back up), through every
stage in between, once per micro-batch; or hold a copy of the embedding on the last stage, as Megatron-Core does
for tied embeddings and its MTP layers. The copy is taken: its cost is the table's model states on one rank and one
all-reduce of its gradient per optimizer step over the two ends (``ParallelGroups.pipeline_ends_group``), against
two more [micro, S, D] transfers per micro-batch and stage boundary and a second input on every stage's schedule
slot. The copy keeps the name ``tok_embeddings.weight``, so it is initialised as the original (same seed, same
name), saved once in a checkpoint (the distributed checkpoint writes a name held alike by several ranks once) and
loaded into both; the last stage gets the token ids beside the hidden states (``MoETransformer.forward``'s
``ids``). After the step's backward the two ends' gradients are summed (``PipelineModel.step``), so both hold the
one-process gradient, and the optimizer makes the same update on both; the gradient norm counts the copy once
(``PipelineModel.copies``).

Aux losses need nothing here: ``moe/losses.py`` ties them to the MoE layer's output, so a stage's
backward, started from the gradient the next stage sent, runs them too. Routing statistics are
taken by a forward hook per stage, one record per micro-batch (an activation-checkpoint recompute
re-runs blocks, not the stage, so it is not counted twice).

Gradient reduction follows the training loop too (``parallel.grad_reduce``, ``parallel.set_gradient_sync``).
torch's ``PipelineStage`` on its own turns FSDP's gradient sync and resharding after backward off for every
micro-batch's backward of an FSDP-wrapped stage and reduces once, in ``perform_reduce_grad`` after the last
(``backward_maybe_with_nosync``): always once per step, with the whole stage kept gathered from one backward
to the next, and nothing at all for FSDP units inside a stage whose root is not wrapped (the experts over
edp when tp folds into ep without data parallelism). ``_Stage`` sets the sync per micro-batch as the loop
does instead: under ``step`` on the last backward only, keeping the stage gathered until then as torch
does (the unsharded gradients are held anyway); under ``microbatch`` a reduce-scatter and a reshard after
every backward (ZeRO-3's memory); the HSDP all-reduce on the last either way. torch's
``perform_reduce_grad`` then finds nothing left to reduce.

Gradient scaling follows the training loop: the loss of each micro-batch is divided by the number
of micro-batches (``scale_grads=False``), and the injected aux losses carry the same factor
(``MoETransformer.set_aux_loss_scale``).
"""

from __future__ import annotations

import copy
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining._backward import stage_backward
from torch.distributed.tensor import DTensor

from config.errors import ConfigError
from config.model import ModelConfig, MoEConfig
from config.parallel import ParallelConfig
from moe.accounting import block_flops_per_token, head_flops_per_token, mtp_flops_per_token, per_model
from moe.attention.indexer import IndexedAttention
from moe.layer import MoELayer, RoutingStats
from moe.transformer import MoETransformer
from parallel import parallelize, set_gradient_sync
from parallel.groups import ParallelGroups
from parallel.tensor import loss_context

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def balanced_split(layer_costs: Sequence[float], num_stages: int, first_extra: float = 0.0,
                   last_extra: float = 0.0) -> list[range]:
    """Cut layers into ``num_stages`` contiguous non-empty runs minimising the costliest stage.

    A stage's cost is the sum of its layers' costs, plus ``first_extra`` for the first stage and
    ``last_extra`` for the last. Dynamic programming over (stage, end layer), O(stages · layers²);
    ties go to the earliest cut.
    """
    n = len(layer_costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} non-empty stages")
    prefix = [0.0, *itertools.accumulate(layer_costs)]

    def cost(stage: int, start: int, end: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    # best[s][e]: the smallest bottleneck of stages 0..s covering layers [0, e); cut[s][e]: where stage s starts
    best = [[float("inf")] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for end in range(1, n + 1):
        best[0][end] = cost(0, 0, end)
    for stage in range(1, num_stages):
        for end in range(stage + 1, n + 1):
            for start in range(stage, end):
                candidate = max(best[stage - 1][start], cost(stage, start, end))
                if candidate < best[stage][end]:
                    best[stage][end], cut[stage][end] = candidate, start
    bounds, end = [], n
    for stage in range(num_stages - 1, 0, -1):
        bounds.append(range(cut[stage][end], end))
        end = cut[stage][end]
    bounds.append(range(0, end))
    return bounds[::-1]


def stage_layers(model: ModelConfig, moe: MoEConfig, num_stages: int) -> list[range]:
    """The layer indices of each of ``num_stages`` stages, balanced by training FLOPs per token (the last stage's
    head and multi-token-prediction modules weighing on it)."""
    last_extra = head_flops_per_token(model) + mtp_flops_per_token(model, moe)
    return list(_balanced_split_cached(_layer_costs(model, moe), num_stages, last_extra))


def _layer_costs(model: ModelConfig, moe: MoEConfig) -> tuple[float, ...]:
    """Each block's training FLOPs per token, remembered per model (the planner asks once per candidate)."""
    return per_model(_COSTS, model, moe, lambda: tuple(block_flops_per_token(model, moe, model.layer(i))
                                                         for i in range(model.n_layers)))


_COSTS: dict = {}  # a per_model store


@functools.lru_cache(maxsize=1024)
def _balanced_split_cached(costs: tuple[float, ...], num_stages: int, last_extra: float) -> tuple[range, ...]:
    """``balanced_split`` remembered by its inputs: the planner asks for the same cut of one model many times."""
    return tuple(balanced_split(costs, num_stages, last_extra=last_extra))


def check_pipeline(pp: int, model: ModelConfig, schedule: str, virtual_stages: int, microbatches: int) -> None:
    """Refuse, before any process group exists, a pipeline the schedules cannot run.

    ``microbatches`` is the number of micro-batches per optimizer step on one pipeline
    (``parallel.resolve.micro_batching``). The micro-batch rules are torch's: 1F1B needs at least one
    micro-batch per stage to fill the pipe; interleaved 1F1B runs rounds of ``pp`` micro-batches and
    needs their count to split evenly into ``max(1, microbatches // pp)`` rounds.
    """
    if schedule not in SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={schedule!r} is not a schedule; valid: {', '.join(SCHEDULES)}")
    if pp == 1:
        if virtual_stages > 1:
            raise ConfigError(f"parallel.pp_virtual_stages={virtual_stages} needs pipeline parallelism "
                              "(parallel.pp > 1); set it to 1")
        return
    stages = pp * virtual_stages
    if stages > model.n_layers:
        fits = [v for v in range(1, virtual_stages) if pp * v <= model.n_layers]
        fix = (f"parallel.pp_virtual_stages={fits[-1]}" if fits
               else f"parallel.pp={model.n_layers} or fewer")
        raise ConfigError(f"parallel.pp={pp} × parallel.pp_virtual_stages={virtual_stages} = {stages} pipeline "
                          f"stages, more than model.n_layers={model.n_layers}: every stage needs a block; "
                          f"use {fix}")
    if model.tie_embeddings:
        raise ConfigError("model.tie_embeddings=true shares the embedding with the LM head, which pipeline "
                          "parallelism puts on different stages; set model.tie_embeddings=false or parallel.pp=1")
    if virtual_stages > 1 and schedule != "interleaved_1f1b":
        raise ConfigError(f"parallel.pp_virtual_stages={virtual_stages} needs parallel.pp_schedule="
                          f"interleaved_1f1b ({schedule} runs one stage per rank); or set it to 1")
    if schedule == "1f1b" and microbatches < pp:
        raise ConfigError(f"parallel.pp_schedule=1f1b needs at least parallel.pp={pp} micro-batches per step, "
                          f"got {microbatches}; set parallel.microbatches={pp} (or a smaller train.micro_batch_size)")
    if schedule == "interleaved_1f1b":
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ConfigError(f"parallel.pp_schedule=interleaved_1f1b runs {microbatches} micro-batches in rounds "
                              f"of parallel.pp={pp}, which needs a multiple of {pp} (or fewer than {pp}); "
                              f"got {microbatches}: set parallel.microbatches to a multiple of {pp}")


def cut_stage(model: MoETransformer, layers: range, first: bool, last: bool) -> MoETransformer:
    """A copy of ``model`` that holds only blocks ``layers`` (and the embedding / norm and head if first / last).

    The multi-token-prediction modules go with the head to the last stage, which keeps a copy of the embedding for
    them (module docstring). Parameter names stay those of the full model. Only what the stage keeps is copied:
    the other parts are swapped out of ``model`` for the copy and put back after, so building a stage costs its
    own size, not the whole model's.
    """
    parts = {"layers": nn.ModuleDict({name: block for name, block in model.layers.items() if int(name) in layers})}
    if not first and not (last and model.mtp is not None):
        parts["tok_embeddings"] = nn.Identity()  # hidden states come in instead of tokens
    if not last:
        parts["norm"], parts["output"] = nn.Identity(), nn.Identity()  # hidden states go out instead of logits
        parts["mtp"] = None
        parts["hc_head"] = None  # with hyper-connections the streams go out as they are, [B, S, n, D]
    whole = {name: getattr(model, name) for name in parts}
    try:
        for name, part in parts.items():
            setattr(model, name, part)
        return copy.deepcopy(model)
    finally:
        for name, part in whole.items():
            setattr(model, name, part)


class _Stage(PipelineStage):
    """torch's ``PipelineStage`` with FSDP's gradient sync per micro-batch set by ``grad_reduce`` (module docstring)."""

    grad_reduce = "step"  # set by ``PipelineModel.step`` for the step it runs

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full":  # split backward (zero-bubble schedules, none of ours): torch's own
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        set_gradient_sync(self.submod, self.grad_reduce, last_backward)
        for module in self.submod.modules():
            if isinstance(module, FSDPModule):
                module.set_reshard_after_backward(last_backward or self.grad_reduce == "microbatch", recurse=False)
        grads = stage_backward(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"], bwd_kwargs["input_values"])
        return grads, None


def _stage_forward(forward: Callable, autocast: Callable[[], AbstractContextManager], takes_ids: bool) -> Callable:
    """The stage's forward under ``autocast``. The schedule hands every stage the same keyword arguments; the token
    ids (``ids``) are for the stage that runs the multi-token-prediction modules and for those after the first
    with hash-routed MoE layers: the first stage reads the tokens as its input already."""
    def run(*args, **kwargs):
        if not takes_ids:
            kwargs.pop("ids", None)
        with autocast():
            return forward(*args, **kwargs)
    return run


class PipelineModel:
    """This rank's stages of the model and the schedule that runs them.

    It answers what the training loop asks of a model (``parameters``, ``state_dict``,
    ``moe_layers``, ``set_aux_loss_scale``, ``train``/``eval``), over all local stages and with
    the full model's names, and runs a step with ``step`` instead of forward and backward.
    """

    def __init__(self, stages: list[MoETransformer], pipeline_stages: list[_Stage], schedule,
                 pp_group: dist.ProcessGroup, microbatches: int, is_first: bool, is_last: bool,
                 stage_layers: list[range], vocab_parallel: bool = False, mtp: bool = False,
                 ends_group: dist.ProcessGroup | None = None, hashed: bool = False):
        self.stages, self.pipeline_stages, self.schedule, self.pp_group = stages, pipeline_stages, schedule, pp_group
        self.vocab_parallel = vocab_parallel  # the last stage's loss and its backward run in loss_context
        self.stage_layers = stage_layers  # every stage's blocks, on all ranks (stage s on pp rank s mod pp)
        self.microbatches, self.is_first, self.is_last = microbatches, is_first, is_last
        # multi-token prediction: the first and last stages' ranks sum their embeddings' gradients over ends_group
        self.mtp, self.ends_group = mtp, ends_group
        self.hashed = hashed  # hash-routed MoE layers: the stages after the first take the token ids too
        self.last_mtp_loss: Tensor | None = None  # the latest step's mean MTP loss, on every rank (``step``)
        self._routing: list[list[dict[int, RoutingStats]]] = [[] for _ in stages]
        self._mtp: list[Tensor] = []  # each training micro-batch's MTP losses [D], on the last stage
        # the indexer loss of each of this rank's layers with an indexer in each training micro-batch
        self.last_indexer_loss: Tensor | None = None  # their mean over every stage's (``step``)
        self._indexer: list[Tensor] = []
        for records, stage in zip(self._routing, stages, strict=True):
            stage.register_forward_hook(self._recorder(records, self._mtp, self._indexer))

    @staticmethod
    def _recorder(records: list[dict[int, RoutingStats]], mtp: list[Tensor], indexer: list[Tensor]) -> Callable:
        """A forward hook that keeps the stage's routing statistics (and MTP and indexer losses) of each training
        micro-batch."""
        def record(module: MoETransformer, args, output) -> None:
            if module.training:
                records.append(module.routing_stats())
                if module.mtp is not None:
                    mtp.append(module.last_mtp_losses)
                indexer.extend(block.attn.last_indexer_loss for block in module.blocks()
                               if isinstance(block.attn, IndexedAttention) and block.attn.last_indexer_loss is not None)
        return record

    def describe(self) -> str:
        """One line for the start-up log: the schedule and which blocks each stage runs."""
        pp = dist.get_world_size(self.pp_group)
        stages = ", ".join(f"{s}: layers {r.start}-{r.stop - 1} (rank {s % pp})" if len(r) > 1
                           else f"{s}: layer {r.start} (rank {s % pp})" for s, r in enumerate(self.stage_layers))
        return (f"pipeline: {type(self.schedule).__name__}, {self.microbatches} micro-batches per step; "
                f"stages {stages}")

    def parameters(self) -> Iterator[nn.Parameter]:
        for stage in self.stages:
            yield from stage.parameters()

    def copies(self) -> list[nn.Parameter]:
        """Parameters that are copies of another stage's (the last stage's embedding, held for multi-token
        prediction): updated like the original, but counted once in the gradient norm (``clip_grad_norm_``)."""
        if not self.mtp or self.is_first:
            return []
        return [stage.tok_embeddings.weight for stage in self.stages if isinstance(stage.tok_embeddings, nn.Embedding)]

    def _sum_embedding_gradients(self) -> None:
        """The first stage's embedding gradient plus the last stage's copy's, on both (one all-reduce over the two
        ends; each gradient already reduced over data parallelism, so both sum the same shard)."""
        for stage in self.stages:
            if isinstance(stage.tok_embeddings, nn.Embedding):
                grad = stage.tok_embeddings.weight.grad
                dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.ends_group)

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for stage in self.stages:
            yield from stage.named_parameters()

    def modules(self) -> Iterator[nn.Module]:
        for stage in self.stages:
            yield from stage.modules()

    def state_dict(self) -> dict[str, Tensor]:
        """This rank's part of the model's state dict (its stages'), under the full model's names."""
        return {k: v for stage in self.stages for k, v in stage.state_dict().items()}

    def moe_layers(self) -> dict[int, MoELayer]:
        return {i: layer for stage in self.stages for i, layer in stage.moe_layers().items()}

    def set_aux_loss_scale(self, scale: float) -> None:
        for stage in self.stages:
            stage.set_aux_loss_scale(scale)

    def train(self, mode: bool = True) -> PipelineModel:
        for stage in self.stages:
            stage.train(mode)
        return self

    def eval(self) -> PipelineModel:
        return self.train(False)

    def _run(self, inputs: Tensor, targets: Tensor, backward: bool, documents: Tensor | None = None) -> Tensor:
        """Run the schedule on this rank's batch; the per-micro-batch losses (each / micro-batches), on every rank.

        Only the first stage reads the inputs and only the last the targets; the losses are
        computed on the last stage and broadcast over the pipeline group. ``documents`` (the batch's document ids,
        ``MoETransformer.forward``) reach every stage: the schedule cuts keyword arguments into micro-batches and
        passes them to each stage's forward, beside the hidden states it receives.
        """
        args = (inputs,) if self.is_first else ()
        target = targets if self.is_last else None
        losses: list[Tensor] = []
        run = self.schedule.step if backward else self.schedule.eval
        by_name = {} if documents is None else {"documents": documents}
        if self.mtp or self.hashed:  # the last stage (MTP's embedding) and hash-routed layers take the token ids
            by_name["ids"] = inputs
        mtp = backward and self.mtp  # in training it runs the MTP modules on the token ids
        with loss_context(self.vocab_parallel):
            run(*args, target=target, losses=losses if self.is_last else None, return_outputs=False, **by_name)
        # each micro-batch's loss, and with MTP beside it the mean of its modules' losses: one broadcast
        columns = 2 if mtp else 1
        out = torch.zeros(self.microbatches, columns, dtype=torch.float64, device=inputs.device)
        if self.is_last:
            out[:, 0] = torch.stack([loss.detach() for loss in losses])
            if mtp:
                out[:, 1] = torch.stack([modules.mean() for modules in self._mtp])
        dist.broadcast(out, group=self.pp_group, group_src=dist.get_world_size(self.pp_group) - 1)
        if mtp:
            self.last_mtp_loss = out[:, 1].mean().cpu()
        return out[:, 0].cpu()

    def step(self, inputs: Tensor, targets: Tensor, grad_reduce: str = "step",
             documents: Tensor | None = None) -> tuple[Tensor, list[dict[int, RoutingStats]]]:
        """Forward and backward over this rank's batch [B, S] (and its document ids [B, S], if masked) in
        micro-batches.

        Returns (mean LM loss of the batch, routing statistics of each micro-batch for this rank's
        MoE layers). Gradients are left in the parameters for the optimizer, reduced over the
        data-parallel ranks once in the step or per micro-batch as ``grad_reduce`` says.
        """
        for stage in self.pipeline_stages:
            stage.grad_reduce = grad_reduce
        for records in [*self._routing, self._mtp, self._indexer]:
            records.clear()
        losses = self._run(inputs, targets, backward=True, documents=documents)
        if self.mtp:
            self._sum_embedding_gradients()
        if self.stages[0].config.lightning_indexer:
            self._gather_indexer_loss(inputs.device)
        routing = [{i: s for records in self._routing for i, s in records[m].items()}
                   for m in range(self.microbatches)]
        return losses.sum(), routing

    def _gather_indexer_loss(self, device: torch.device) -> None:
        """The step's mean indexer loss over every stage's layers with an indexer and micro-batches (one all-reduce
        of a sum and a count over the pipeline group), in ``last_indexer_loss``: on the device, read by the host only
        when logged."""
        zero = torch.zeros((), dtype=torch.float64, device=device)
        total = torch.stack((sum((loss.double() for loss in self._indexer), zero), zero + len(self._indexer)))
        dist.all_reduce(total, group=self.pp_group)
        self.last_indexer_loss = total[0] / total[1]

    def eval_losses(self, batches: Sequence[tuple[Tensor, Tensor, Tensor | None]]) -> Tensor:
        """Mean LM loss of each of ``batches`` (inputs, targets, document ids or None; forward only), on every rank
        of the pipeline.

        Each batch is one micro-batch; they run ``microbatches`` at a time, the last group
        padded by repeating its last batch and the padding's losses left out.
        """
        per_batch = []
        for start in range(0, len(batches), self.microbatches):
            group = list(batches[start:start + self.microbatches])
            real = len(group)
            group += [group[-1]] * (self.microbatches - real)
            inputs, targets, documents = ([batch[i] for batch in group] for i in range(3))
            documents = None if documents[0] is None else torch.cat(documents)
            per_batch.append(self._run(torch.cat(inputs), torch.cat(targets), backward=False,
                                       documents=documents)[:real] * self.microbatches)
        return torch.cat(per_batch)


def build_pipeline(model: MoETransformer, moe: MoEConfig, groups: ParallelGroups, device: torch.device,
                   parallel: ParallelConfig, microbatches: int, micro_batch_size: int,
                   loss_fn: Callable[[Tensor, Tensor], Tensor],
                   autocast: Callable[[], AbstractContextManager],
                   param_dtype: torch.dtype | None = None) -> PipelineModel:
    """Cut ``model`` (the whole model of ``moe``'s experts, on meta or the same on every rank) into this rank's stages.

    The stages run on ``device``; a meta-built model's stages stay on meta until ``parallel.materialize``
    gives each of them its shards. ``parallel`` gives the schedule and virtual stages, and each stage is
    parallelized with it as the whole model would be (``parallelize``).

    ``loss_fn(logits, targets)`` is the mean LM loss of one micro-batch of ``micro_batch_size``
    sequences; ``autocast`` wraps each stage's forward (compute precision), as it wraps the
    model's forward without pipelining. Under context parallelism the stages pass each other this cp rank's
    positions of each sequence, and under ``parallel.sequence_parallel`` this tp rank's slice of those.
    """
    schedule, virtual_stages = parallel.pp_schedule, parallel.pp_virtual_stages
    sequence_parallel, vocab_parallel = parallel.sequence_parallel, parallel.vocab_parallel
    config, layout = model.config, groups.layout
    check_pipeline(layout.pp, config, schedule, virtual_stages, microbatches)
    num_stages = layout.pp * virtual_stages
    ranges = stage_layers(config, moe, num_stages)
    pp_rank = groups.coords()["pp"]
    seq = config.seq_len // layout.cp  # a context-parallel rank's positions of a sequence
    # each position's state between stages: [D], or with hyper-connections its n streams [n, D]
    width = (config.d_model,) if config.hc_mult == 1 else (config.hc_mult, config.d_model)
    stream_seq = seq // layout.tp if sequence_parallel else seq  # positions of the hidden states between stages

    stages, pipeline_stages = [], []
    for index in range(pp_rank, num_stages, layout.pp):
        first, last = index == 0, index == num_stages - 1
        stage = parallelize(cut_stage(model, ranges[index], first, last), groups, parallel, param_dtype)
        stage.forward = _stage_forward(stage.forward, autocast,
                                       takes_ids=not first and ((last and stage.mtp is not None) or stage.hashed))
        # shapes given up front (static metadata), so torch does not run a trial step to infer them
        inputs = (torch.empty(micro_batch_size, seq, dtype=torch.long, device="meta") if first
                  else torch.empty(micro_batch_size, stream_seq, *width, device="meta", requires_grad=True))
        outputs = (torch.empty(micro_batch_size, seq, config.vocab_size, device="meta", requires_grad=True) if last
                   else torch.empty(micro_batch_size, stream_seq, *width, device="meta", requires_grad=True))
        stages.append(stage)
        pipeline_stages.append(_Stage(stage, index, num_stages, device, input_args=inputs,
                                      output_args=outputs, group=groups.group("pp")))

    def micro_batch_loss(logits: Tensor, targets: Tensor) -> Tensor:
        return loss_fn(logits, targets) / microbatches

    schedule_class = SCHEDULES[schedule]
    runner = (schedule_class(pipeline_stages, microbatches, loss_fn=micro_batch_loss, scale_grads=False)
              if schedule == "interleaved_1f1b"
              else schedule_class(pipeline_stages[0], microbatches, loss_fn=micro_batch_loss, scale_grads=False))
    ends = groups.pipeline_ends_group() if model.mtp is not None else None
    return PipelineModel(stages, pipeline_stages, runner, groups.group("pp"), microbatches, is_first=pp_rank == 0,
                         is_last=pp_rank == layout.pp - 1, stage_layers=ranges, vocab_parallel=vocab_parallel,
                         mtp=model.mtp is not None, ends_group=ends, hashed=model.hashed)
