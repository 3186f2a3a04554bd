"""Per-rank memory of a training layout, predicted from the config alone, and its measured counterpart.

    python -m analysis.memory --config moe-8x [--set parallel.tp=2 ...] [--world-size N] [--precision bf16]
    python -m analysis.memory --config mixtral-8x7b --world-size 64 --set parallel.ep=8 --sweep-experts 8,16,32,64

What one rank holds during a step (``estimate``):

- **model states** (``analysis/memory_states.py``): fp32 master weights, fp32 gradients and AdamW's two fp32
  moments, 16 bytes per parameter (ZeRO; REFERENCES.md sec. 3.1); under Muon, one fp32 momentum buffer for
  the matrices it updates (12 bytes per parameter), each tensor divided as tp, ep, etp, FSDP
  (over dp_shard × cp, or edp for the experts) and the pipeline stages divide it; dense and routed experts apart.
- **gathered weights** (``gathered_bytes``): FSDP all-gathers a block's tp-local weights before it runs, in fp32
  or, under bf16, in bf16 (FSDP2's mixed precision; the routers' own units in fp32).
  Assumed peak: the root unit (embedding, final norm, head: never resharded) plus, in backward, the current
  and the prefetched block's weights and the current block's unsharded gradients before their reduce-scatter;
  with ``reshard_after_forward=false`` every local block stays gathered from forward to backward instead
  (and so it does under pipelining with ``parallel.grad_reduce=step``: the stage stays gathered between
  micro-batches).
- **accumulated gradients** (``accumulated_grad_bytes``): under ``parallel.grad_reduce=step`` with several
  micro-batches, each FSDP unit holds its unsharded (tp-local, fp32) gradients from the first micro-batch to
  the last one's reduce-scatter, in place of their shards; the extra over the sharded gradients. Zero under
  ``microbatch`` (ZeRO-3: reduce-scattered every micro-batch). ``held_gradient_bytes`` measures it.
- **the optimizer step**: every state (the gradients sharded again by then); fused AdamW (``training.optim``)
  updates in place and allocates nothing more, so it is never above forward and backward's peak, which
  holds the states too (the printed table shows both).
- **activations** (``analysis/memory_activations.py``): what autograd saves for backward in one micro-batch's
  forward, tensor by tensor as the modules of ``moe/`` save it (listed in each function), times the
  micro-batches in flight (``in_flight``), on this rank's S/cp positions of each sequence under context
  parallelism, whose attention saves the whole sequence's gathered keys and values and a [S/cp, S] mask per
  layer (``parallel/context.py``). Under bf16 autocast the cast copies of the weights that the
  matmuls save count here too: they live as long as the micro-batch's graph. Plus, on the last stage, one
  transient [tokens, V] fp32 buffer (the logits in forward, their gradient in backward).
- **compute copies** (``compute_copy_bytes``): in bf16 the routed experts' bf16 copies outside FSDP
  (``moe.experts.ComputeCopies``), held once from a step's first forward to its optimizer step.
- **replica slots** (``parallel.ep_replicas: R``): each MoE layer's R slots' weights fetched in the compute dtype
  and saved by their grouped GEMM (an activations part, ``replica_slot_bytes``), and in backward one layer's
  slots' weight gradients before they return to the owners (``replica_slot_gradient_bytes``): every slot
  filled, an upper bound (balanced routing fills none; the rows the slots compute count with the rank's rows).

Routing is assumed balanced: an MoE layer keeps ``min(T·k, C·E)`` assignments (capacity ``C`` from
``moe.dispatch.expert_capacity``), or ``T·k`` when dropless; imbalance moves rows between experts and
ranks, so a skewed router can need more on the busiest rank. The grouped GEMM is torch's ``grouped_mm``
(16-byte aligned dims; the padded-bmm fallback saves other tensors). Left out: the AdamW step counters
(one scalar per tensor), communication buffers, allocator fragmentation, and the CUDA context.

Against the published formula (Korthikanti et al. 2022, Eq. 1; REFERENCES.md sec. 2.1), ``sbh(34 + 5as/h)``
bytes per layer in 16-bit: that counts LayerNorm, a 4h GeLU MLP, dropout masks and the s×s attention
scores. Here the norms are RMSNorm (fp32: input and a [T] rstd; the normalised input too under sequence
parallelism), the MLP is SwiGLU (four [T, F] tensors), there is no dropout, and SDPA keeps q, k, v, its
output and a [b, heads, s] logsumexp instead of the s×s matrix, so the ``5as/h`` term is absent; the formula
is cited, not matched.

``saved_activation_bytes`` measures what the model predicts: the bytes autograd keeps after one forward.
"""

from __future__ import annotations

import math
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from analysis.memory_activations import (
    compute_copy_bytes,
    in_flight,
    micro_batch_activations,
    replica_slot_gradient_bytes,
)
from analysis.memory_plot import check_plot_path, save_png, sweep_figure
from analysis.memory_states import (
    FP32,
    ModelStates,
    accumulated_grad_bytes,
    gathered_bytes,
    largest_chunk,
    local_layers,
    model_states,
)
from config.cli import (
    add_config_arguments,
    add_overwrite,
    add_world_size,
    command_parser,
    load_config_from,
    run_command,
    world_size_of,
)
from config.errors import ConfigError
from config.run import RunConfig, load_config
from moe import workspace
from moe.accounting import parameter_counts
from moe.attention.kernel import attends_by_chunks
from moe.experts import ComputeCopies
from parallel.hardware import planned_precision
from parallel.layout import Layout
from parallel.resolve import resolve_layout
from parallel.tensor import lm_loss, loss_context

GIB, MIB = 2**30, 2**20
# The share of a device's memory a plan leaves free: what this model does not count but a real run holds. The
# CUDA context and NCCL's communicator buffers (about 1-2 GiB outside PyTorch's allocator) and the caching
# allocator's fragmentation (memory reserved beyond allocated, commonly 5-10% of it in training loops). A rule
# of thumb, not measured here: the planner and the dry run's verdict apply it, and say so (--headroom).
DEFAULT_HEADROOM = 0.10


def usable_bytes(device_bytes: float, headroom: float = DEFAULT_HEADROOM) -> float:
    """What a plan may use of ``device_bytes``: all but ``headroom`` (a fraction in [0, 1))."""
    if not 0 <= headroom < 1:  # NaN fails this too
        raise ConfigError(f"--headroom must be a fraction in [0, 1), got {headroom}")
    return device_bytes * (1 - headroom)


# ---------------------------------------------------------------------------
# The estimate, and the layout check it starts with
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryEstimate:
    """One rank's memory in bytes: model states, FSDP's gathered buffers, activations (× in flight), logits."""

    pp_rank: int
    states: ModelStates
    gathered: int
    accumulated_grads: int  # unsharded gradients held between micro-batches beyond the shards (grad_reduce=step)
    compute_copies: int  # the routed experts' bf16 copies, once per step (``moe.experts.ComputeCopies``)
    activations: dict[str, int]  # by part, already × in_flight
    logits_buffer: int  # last stage: one [tokens, V] fp32 buffer (logits in forward, their gradient in backward)
    cp_mask: int  # context parallelism: the forward's boolean [1, 1, S/cp, S] mask (``context_mask_bytes``)
    micro_batch_size: int
    microbatches: int
    in_flight: float
    parameters: int  # whole-model parameter count
    replica_grads: int = 0  # one MoE layer's filled replica slots' gradients in backward (``parallel.ep_replicas``)

    @property
    def activation_total(self) -> int:
        return sum(self.activations.values())

    @property
    def forward_backward(self) -> int:
        """The peak of forward and backward: states, gathered weights, gradients accumulated unsharded,
        compute copies, activations held, the logits buffer."""
        return (self.states.total + self.gathered + self.accumulated_grads + self.compute_copies
                + self.activation_total + self.logits_buffer + self.cp_mask + self.replica_grads)

    @property
    def total(self) -> int:
        """The step's peak: forward and backward's. The optimizer step holds the states alone (fused AdamW
        allocates nothing more), which forward and backward's peak includes."""
        return self.forward_backward


def estimate(config: RunConfig, world_size: int, precision: str, pp_rank: int = 0,
             resolved: tuple[Layout, int, int] | None = None, device_type: str = "cuda") -> MemoryEstimate:
    """The memory of one rank of pipeline rank ``pp_rank`` training ``config`` on ``world_size`` ranks
    (``resolved``: ``resolve_layout(config, world_size)``, when the caller has it already) of ``device_type``."""
    layout, micro, microbatches = resolved or resolve_layout(config, world_size)
    held = in_flight(config, layout, microbatches, pp_rank)
    activations = {name: round(nbytes * held) for name, nbytes in
                   micro_batch_activations(config, layout, micro, precision, pp_rank, device_type).items()}
    last = local_layers(config, layout, pp_rank)[2]
    vocab = config.model.vocab_size
    if config.parallel.vocab_parallel:
        vocab = largest_chunk(vocab, layout.tp)
    logits = micro * config.model.seq_len // layout.cp * vocab * FP32 if last else 0  # this rank's positions
    return MemoryEstimate(pp_rank, model_states(config, layout, pp_rank),
                          gathered_bytes(config, layout, pp_rank, microbatches, precision),
                          accumulated_grad_bytes(config, layout, microbatches, pp_rank),
                          compute_copy_bytes(config, layout, precision, pp_rank),
                          activations, logits, context_mask_bytes(config, layout), micro, microbatches, held,
                          parameter_counts(config.model, config.moe).total,
                          replica_slot_gradient_bytes(config, layout, precision))


def context_mask_bytes(config: RunConfig, layout: Layout) -> int:
    """The boolean mask a context-parallel rank's forward builds once ([1, 1, S/cp, S], ``moe.documents``), which
    every layer's attention reads: not a saved tensor (SDPA saves its own additive copy, counted with each layer),
    but alive until the forward returns, and through backward under full recompute, whose blocks re-run
    attention with it; so counted once, at the step's peak, beside the activations. None without cp, and none where
    whole sequences attend by chunks (no window, no sinks: ``moe.sequence_shards.SequenceShards.causal_attention``,
    whose per-chunk masks are counted with each layer)."""
    seq = config.model.seq_len
    return seq // layout.cp * seq if layout.cp > 1 and not attends_by_chunks(config.model) else 0


# ---------------------------------------------------------------------------
# The measured counterpart
# ---------------------------------------------------------------------------


def local_tensor(tensor: Tensor) -> Tensor:
    """The plain tensor holding the data: a DTensor's local shard; an in-flight collective's result buffer."""
    if isinstance(tensor, DTensor):
        tensor = tensor._local_tensor
    return tensor.elem if isinstance(tensor, AsyncCollectiveTensor) else tensor


def held_gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of gradients this rank holds now, once per storage: what ``ModelStates.grads`` plus
    ``accumulated_grad_bytes`` predict between micro-batches.

    The parameters' own (sharded) ``.grad``s, and what FSDP2 keeps inside its units: the ``.grad`` of each
    unsharded parameter (accumulating while gradient sync is off), its reduce-dtype accumulator, and HSDP's
    sum of reduce-scattered shards awaiting the all-reduce over the replicas.
    """
    storages: dict[int, int] = {}

    def add(tensor: Tensor | None) -> None:
        if tensor is not None:
            storage = local_tensor(tensor).untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()

    for param in model.parameters():
        add(param.grad)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                add(group._partial_reduce_output)
                for fsdp_param in group.fsdp_params:
                    unsharded = getattr(fsdp_param, "_unsharded_param", None)  # absent before the first gather
                    add(unsharded.grad if unsharded is not None else None)
                    add(fsdp_param.unsharded_accumulated_grad)
    return sum(nbytes for ptr, nbytes in storages.items() if ptr)


@dataclass(frozen=True)
class SavedActivations:
    saved_bytes: int  # bytes autograd holds for backward after the forward (parameters and buffers excluded)
    logits_bytes: int  # this rank's logits (its vocabulary slice under vocab_parallel)
    loss: Tensor  # the forward's loss, to run backward on


def saved_activation_bytes(model: torch.nn.Module, inputs: Tensor, targets: Tensor,
                           vocab_parallel: bool = False) -> SavedActivations:
    """Run one forward and the LM loss; count the bytes autograd keeps for backward on this rank, and the
    experts' compute copies the forward made (``moe.experts.ComputeCopies``: held whether saved or not).

    Every tensor a ``saved_tensors_hooks`` pack hook sees counts if the graph still holds it at the end of the
    forward (a dropped branch frees its tensors, whose addresses may be reused), once per storage, at the
    storage's size then (FSDP frees resharded weights by shrinking their storage to nothing). The hook stores
    a detached alias and watches it by weak reference: storing the tensor itself would tie a node's own saved
    output (softmax's, logsumexp's) to the node in a cycle that outlives a dropped branch, which autograd
    without hooks avoids. So the loss supports one backward, not double backward. The model's parameters and
    buffers, taken after the forward (FSDP's gathered root stays gathered), are model state and left out.
    Autocast, if wanted, is the caller's context.
    """
    packed = []

    def pack(tensor: Tensor) -> Tensor:
        alias = tensor.detach()
        packed.append(weakref.ref(alias))
        return alias

    # kept buffers bypassed (``moe.workspace``): a tensor on a larger kept storage would count at the storage's size
    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), loss_context(vocab_parallel),
          workspace.bypassed()):
        logits = model(inputs)
        loss = lm_loss(logits, targets)
    state = {local_tensor(t).untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    storages = {}
    held = [ref() for ref in packed] + [copy for module in model.modules()
                                        if isinstance(copies := getattr(module, "compute_copies", None), ComputeCopies)
                                        for copy in copies.tensors()]
    for tensor in held:
        if tensor is not None:
            storage = local_tensor(tensor).untyped_storage()
            if storage.data_ptr() not in state:
                storages[storage.data_ptr()] = storage.nbytes()
    return SavedActivations(sum(storages.values()), local_tensor(logits).nbytes, loss)


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def format_estimates(config: RunConfig, layout: Layout, precision: str, estimates: list[MemoryEstimate],
                     device_gib: float) -> str:
    """A table, one column per pipeline rank: model states, gathered weights, activations by part, total, fit."""
    first = estimates[0]
    seq = config.model.seq_len
    lines = [f"{config.name}: {layout.world_size} rank(s), {layout.degrees()} (edp={layout.edp}); {precision} compute; "
             f"micro-batch {first.micro_batch_size} × {seq} tokens"
             + (f" ({seq // layout.cp} of each on a rank: cp={layout.cp})" if layout.cp > 1 else "")
             + f", {first.microbatches} per step, gradients "
             f"reduced per {'optimizer step' if config.parallel.grad_reduce == 'step' else 'micro-batch'}",
             f"model: {_count(first.parameters)} parameters; per rank, fp32 master weights + fp32 gradients "
             + ("+ AdamW moments (16 bytes/parameter)" if config.train.optimizer == "adamw" else
                "+ Muon's momentum for the matrices it updates (12 bytes/parameter), AdamW's moments for the rest "
                "(16)")]
    header = [f"pp rank {e.pp_rank}" for e in estimates] if layout.pp > 1 else ["per rank"]
    rows: list[tuple[str, list[int]]] = [
        ("weights: dense", [e.states.weights_dense for e in estimates]),
        ("weights: routed experts", [e.states.weights_experts for e in estimates]),
        ("gradients", [e.states.grads for e in estimates]),
        ("AdamW moments" if config.train.optimizer == "adamw" else "optimizer state (Muon, AdamW)",
         [e.states.optimizer for e in estimates]),
        ("FSDP gathered weights", [e.gathered for e in estimates]),
        ("unsharded gradients held", [e.accumulated_grads for e in estimates]),
        ("experts' bf16 compute copies", [e.compute_copies for e in estimates]),
    ]
    parts = list(dict.fromkeys(name for e in estimates for name in e.activations))
    rows += [(f"activations: {name}", [e.activations.get(name, 0) for e in estimates]) for name in parts]
    rows += [("logits buffer", [e.logits_buffer for e in estimates])]
    if layout.cp > 1:
        rows += [("context-parallel mask", [e.cp_mask for e in estimates])]
    if config.parallel.ep_replicas and layout.ep > 1:
        rows += [("replica slots' gradients (one layer)", [e.replica_grads for e in estimates])]
    width = max(len(name) for name, _ in rows) + 2
    lines.append(" " * width + "".join(f"{h:>14}" for h in header))
    for name, values in rows:
        lines.append(f"{name:<{width}}" + "".join(f"{_size(v):>14}" for v in values))
    lines.append(f"{'  micro-batches held':<{width}}" + "".join(f"{e.in_flight:>14g}" for e in estimates))
    lines.append(f"{'forward and backward':<{width}}" + "".join(f"{_size(e.forward_backward):>14}" for e in estimates))
    lines.append(f"{'optimizer step':<{width}}"
                 + "".join(f"{_size(e.states.total):>14}" for e in estimates))
    lines.append(f"{'total (the larger)':<{width}}" + "".join(f"{_size(e.total):>14}" for e in estimates))
    worst = max(e.total for e in estimates)
    verdict = "fits" if worst <= device_gib * GIB else "does NOT fit"
    lines.append(f"largest rank {_size(worst)}: {verdict} in {device_gib:g} GiB "
                 f"({100 * worst / (device_gib * GIB):.0f}% of it)")
    return "\n".join(lines)


def sweep_experts(config_name: str, overrides: list[str], world_size: int, precision: str,
                  expert_counts: list[int]) -> list[tuple[int, MemoryEstimate]]:
    """The largest pipeline rank's estimate as ``moe.num_experts`` grows, everything else (layout included) fixed.

    With top_k and expert_hidden fixed, each token's compute and the activations stay put (only the
    router's [T, E] scores grow) while the expert weights, gradients and moments grow with E / ep.
    """
    out = []
    for experts in expert_counts:
        config = load_config(config_name, [*overrides, f"moe.num_experts={experts}"])
        pp = Layout.resolve(world_size, **config.parallel.degrees()).pp
        worst = max((estimate(config, world_size, precision, r) for r in range(pp)), key=lambda e: e.total)
        out.append((experts, worst))
    return out


def sweep_components(e: MemoryEstimate) -> dict[str, int]:
    """The sweep's split of one rank's peak, in bytes, summing to ``e.total``: bf16 weight copies are weights in
    size but held per micro-batch like activations, so they are a component of their own."""
    autocast_copies = e.activations.get("bf16 weight copies", 0)
    return {"model states": e.states.total, "FSDP gathered": e.gathered, "unsharded grads held": e.accumulated_grads,
            "bf16 weight copies": autocast_copies + e.compute_copies,
            "activations (+ logits)": e.activation_total - autocast_copies + e.logits_buffer + e.cp_mask}


def format_sweep(rows: list[tuple[int, MemoryEstimate]], device_gib: float) -> str:
    """One line per expert count, ``sweep_components``' columns."""
    lines = ["experts  parameters  model states  FSDP gathered    unsharded  bf16 weight  activations        total  "
             "activ.  fits",
             "           (model)     (per rank)     (per rank)  grads held       copies  (+ logits)   (per rank)   "
             "share"]
    for experts, e in rows:
        parts = list(sweep_components(e).values())
        fits = "yes" if e.total <= device_gib * GIB else "no"
        lines.append(f"{experts:>7}  {_count(e.parameters):>10}  {_size(parts[0]):>12}  {_size(parts[1]):>13}  "
                     f"{_size(parts[2]):>11}  {_size(parts[3]):>11}  {_size(parts[4]):>11}  "
                     f"{_size(e.total):>11}  {100 * parts[4] / e.total:>5.0f}%  {fits:>4}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-memory", "Per-rank training memory of a config and layout.")
    add_config_arguments(parser, set_help="override config keys, e.g. --set parallel.tp=2 parallel.ep=4")
    add_world_size(parser, default=1, help="ranks in the job (default 1)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                        help="compute precision (default: train.precision; auto means bf16, as on a GPU)")
    parser.add_argument("--device-memory", type=float, default=80.0, metavar="GIB",
                        help="memory of one device, GiB (default 80)")
    parser.add_argument("--sweep-experts", default=None, metavar="E1,E2,...",
                        help="print how the footprint shifts from activations to weights as moe.num_experts grows")
    parser.add_argument("--plot", type=Path, default=None, metavar="FILE.png",
                        help="with --sweep-experts: also draw the sweep, one stacked bar per expert count and a "
                             "colour per component (needs matplotlib)")
    add_overwrite(parser)
    args = parser.parse_args(argv)
    return run_command(lambda: _estimate_command(args))


def _estimate_command(args) -> None:
    """``main``'s work: the estimate, or the sweep over expert counts, printed."""
    if not 0 < args.device_memory < math.inf:  # NaN fails this too
        raise ConfigError(f"--device-memory must be a positive number of GiB, got {args.device_memory}")
    world_size_of(args)
    if args.plot is not None:
        if not args.sweep_experts:
            raise ConfigError("--plot draws the expert sweep: give --sweep-experts E1,E2,... with it")
        check_plot_path(args.plot, args.overwrite)
    config = load_config_from(args)
    precision = args.precision or planned_precision(config.train.precision)
    if args.sweep_experts:
        try:
            counts = [int(e) for e in args.sweep_experts.split(",")]
        except ValueError:
            counts = []
        if not counts or min(counts) < 1:
            raise ConfigError(f"--sweep-experts {args.sweep_experts!r}: give positive expert counts separated "
                              "by commas, e.g. 8,16,64")
        for experts in counts:  # each count's layout passes train.py's checks, as the single estimate does
            resolve_layout(load_config(args.config, [*args.overrides, f"moe.num_experts={experts}"]),
                           args.world_size)
        rows = sweep_experts(args.config, args.overrides, args.world_size, precision, counts)
        layout = Layout.resolve(args.world_size, **config.parallel.degrees())
        print(f"{config.name}: {args.world_size} rank(s), {layout.degrees()}; {precision}; the largest "
              f"pipeline rank as moe.num_experts grows (layout, top_k and expert_hidden fixed)")
        print(format_sweep(rows, args.device_memory))
        if args.plot is not None:
            title = f"{config.name} on {args.world_size} rank(s) in {precision}: memory per rank\n{layout.degrees()}"
            save_png(sweep_figure([(experts, sweep_components(e)) for experts, e in rows], args.device_memory,
                                  title), args.plot)
            print(f"figure: {args.plot}")
        return
    layout = resolve_layout(config, args.world_size)[0]
    estimates = [estimate(config, args.world_size, precision, r) for r in range(layout.pp)]
    print(format_estimates(config, layout, precision, estimates, args.device_memory))


if __name__ == "__main__":
    sys.exit(main())
