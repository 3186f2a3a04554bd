"""Which layout to train a config on: every valid layout of N GPUs, the ones that fit, fastest first.

    python -m analysis.planner --config mixtral-8x7b --world-size 64 [--gpu h100] [--gpus-per-node 8]
                               [--device-memory GiB] [--nvlink-gbps N] [--network-gbps N] [--peak-tflops N]
                               [--set parallel.tp=2 ...] [--top 10] [--efficiency F] [--headroom 0.1]

Each plan is printed with the command that runs it (torchrun ... train.py --config ... --set ...; ``train.py
--dry-run --world-size N`` takes its train.py part unchanged), and must fit the GPU's memory less a headroom
(``analysis.memory.DEFAULT_HEADROOM``, 10%: what the memory model does not count).

Candidates: every layout of the world size that the model allows (``parallel.layout.valid_layouts``: pp,
dp_replicate, dp_shard, cp, tp, ep, etp; the degrees a ``--set`` names are fixed), each with activation
checkpointing none, ``moe`` (where there are MoE layers) and ``full``, with both gradient-reduction settings
(``parallel.grad_reduce``: ``step`` holds unsharded gradients between micro-batches and reduces once;
``microbatch`` reduce-scatters every micro-batch and holds only shards; one candidate where they are the same:
a single micro-batch, or no FSDP shard group of several ranks), every micro-batch size dividing the per-rank
batch unless the config fixes it (``micro_batch_sizes``), and sequence parallelism whenever tp > 1 (it costs
no traffic here and saves activations). Pipelines run 1F1B, GPipe, or interleaved 1F1B (``schedules``). Each
candidate the search weighs is first held to ``train.py``'s own checks (``parallel.resolve.resolve_layout``):
one it would refuse is skipped, and the reason given if none passes.

For each, ``analysis.memory`` gives the memory of the busiest rank (a plan must fit ``--device-memory``)
and ``analysis.step_time`` its step time on the ``--gpu`` preset of ``analysis.communication.HARDWARE`` (A100 40/80
GB, H100, H800, H200, B200: datasheet bandwidths, peak, memory and HBM bandwidth, each figure's source named there;
any figure but the HBM's can be overridden): compute, pipeline bubble and exposed communication.

step = compute + bubble + exposed communication. ``search`` orders the candidates by compute + bubble, a
bound no step goes below, raises the bound of those still within reach by the least traffic their layout can
have (``traffic_floor``), and estimates memory and traffic only for those that can still enter the first
``--top``. The times are estimates for comparing layouts, not promises. Not modelled: kernel-launch
and element-wise costs, overlap of tp or ep traffic with compute, and routing imbalance.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass

from analysis import communication, memory
from analysis.memory_states import experts_own_unit, model_states
from analysis.step_time import (
    EFFICIENCY,
    bubble_seconds,
    compute_seconds,
    exposed_communication,
    node_shape,
    sharding_time,
    shared_balance,
    stage_traffic,
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
from moe.accounting import parameter_counts
from parallel.hardware import planned_precision
from parallel.layout import Layout, valid_layouts
from parallel.resolve import micro_batching, resolve_layout
from parallel.sharding import GRAD_REDUCE

RECOMPUTE = ("none", "moe", "full")
GIB = 2**30


@dataclass(frozen=True)
class Plan:
    """One candidate: its settings, the busiest rank's memory, and the step-time estimate (seconds)."""

    config: RunConfig  # the config with this plan's parallel settings
    layout: Layout
    memory: int  # bytes on the busiest rank
    compute: float
    bubble: float
    exposed: dict[str, float]  # communication on the critical path, by dimension (tp, cp, ep, pp, fsdp)

    @property
    def step(self) -> float:
        return self.compute + self.bubble + sum(self.exposed.values())

    def describe(self) -> str:
        par = self.config.parallel
        degrees = " ".join(f"{k}={getattr(self.layout, k)}" for k in DEGREE_KEYS if getattr(self.layout, k) > 1)
        extra = [f"micro={self.config.train.micro_batch_size}"] if self.config.train.micro_batch_size else []
        if par.activation_checkpointing != "none":
            extra.append(f"recompute={par.activation_checkpointing}")
        if self.layout.pp > 1 and par.pp_schedule != "1f1b":
            extra.append(f"interleaved v={par.pp_virtual_stages}" if par.pp_virtual_stages > 1 else par.pp_schedule)
        if par.sequence_parallel:
            extra.append("sp")
        if par.grad_reduce == "microbatch":
            extra.append("rs/mb")  # gradients reduce-scattered per micro-batch
        return " ".join([degrees or "one rank", *extra])


DEGREE_KEYS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")


def plan_overrides(plan: Plan, base: RunConfig) -> list[str]:
    """The ``--set`` overrides that make ``train.py`` run ``plan`` from the config ``base`` it was planned from:
    each key the plan set (degrees, recompute, sequence parallelism, gradient reduction, pipeline schedule,
    micro-batch size) whose value differs from ``base``'s. ``plan.config`` is ``base`` with exactly those keys
    changed (``with_layout``), so these overrides rebuild it."""
    keys = [f"parallel.{key}" for key in (*DEGREE_KEYS, "activation_checkpointing", "sequence_parallel",
                                           "grad_reduce", "pp_schedule", "pp_virtual_stages")]
    out = []
    for key in [*keys, "train.micro_batch_size"]:
        section, name = key.split(".")
        value = getattr(getattr(plan.config, section), name)
        if value != getattr(getattr(base, section), name):
            out.append(f"{key}={'null' if value is None else str(value).lower() if isinstance(value, bool) else value}")
    return out


def launch_command(plan: Plan, base: RunConfig, config_name: str, overrides: list[str], gpus_per_node: int) -> str:
    """The command that trains ``plan``: torchrun (standalone on one node; on several, run on each node with
    HOST, the first node's address) of ``train.py --config config_name --set ...``: the planner's own
    ``overrides`` (its ``--set``, which made ``base``) with the plan's in place of any key they share.
    ``train.py --dry-run --world-size N`` takes the part after torchrun's options unchanged."""
    chosen = plan_overrides(plan, base)
    keys = {item.partition("=")[0] for item in chosen}
    kept = [item for item in overrides if item.partition("=")[0] not in keys]
    nodes, per_node = node_shape(plan.layout.world_size, gpus_per_node)
    launcher = (["torchrun", "--standalone", f"--nproc-per-node={per_node}"] if nodes == 1 else
                ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={per_node}", "--rdzv-backend=c10d",
                 "--rdzv-endpoint=HOST:29500"])
    settings = [*kept, *chosen]
    return shlex.join([*launcher, "train.py", "--config", config_name, *(["--set", *settings] if settings else [])])


def with_layout(config: RunConfig, layout: Layout, recompute: str, grad_reduce: str = "step",
                schedule: tuple[str, int] = ("1f1b", 1), micro_batch_size: int | None = None) -> RunConfig:
    """``config`` set to train under ``layout`` (sequence parallel with tp), ``recompute``, ``grad_reduce``, the
    pipeline ``schedule`` (name, virtual stages per rank) and ``micro_batch_size`` (None: the config's)."""
    parallel = dataclasses.replace(
        config.parallel, pp=layout.pp, dp_replicate=layout.dp_replicate, dp_shard=layout.dp_shard, cp=layout.cp,
        tp=layout.tp,
        ep=layout.ep, etp=layout.etp, activation_checkpointing=recompute, sequence_parallel=layout.tp > 1,
        pp_schedule=schedule[0], pp_virtual_stages=schedule[1], grad_reduce=grad_reduce)
    if micro_batch_size is None:
        return dataclasses.replace(config, parallel=parallel)
    return dataclasses.replace(config, parallel=parallel,
                               train=dataclasses.replace(config.train, micro_batch_size=micro_batch_size))


def schedules(config: RunConfig, layout: Layout) -> list[tuple[str, int]]:
    """The pipeline schedules to try: 1F1B, GPipe, and interleaved 1F1B with v = 2, 4, 8, ... virtual stages per
    rank while every stage keeps a block (Narayanan et al. 2021 sec. 2.2.2), and every v that splits each rank's
    blocks evenly (Megatron-Core's rule for v: a divisor of layers / pp; its Mixtral 8x22B mapping runs v = 7);
    none but 1F1B without pipelining."""
    if layout.pp == 1:
        return [("1f1b", 1)]
    layers = config.model.n_layers
    virtual = {2**k for k in range(1, 8) if layout.pp * 2**k <= layers}
    virtual |= {v for v in range(2, layers // layout.pp + 1) if layers % (layout.pp * v) == 0}
    return [("1f1b", 1), ("gpipe", 1), *(("interleaved_1f1b", v) for v in sorted(virtual))]


def recompute_settings(config: RunConfig) -> tuple[str, ...]:
    """Activation checkpointing to try: none, MoE layers only (where there are MoE layers), every block."""
    return RECOMPUTE if config.model.n_moe_layers else tuple(r for r in RECOMPUTE if r != "moe")


def memory_bytes(config: RunConfig, layout: Layout, resolved: tuple[Layout, int, int] | None = None,
                 stop_above: float | None = None) -> tuple[int, int]:
    """The busiest pipeline rank's bytes (``analysis.memory``) and the micro-batches per step (``resolved``:
    ``resolve_layout``'s answer for the config, when at hand). With ``stop_above``, the first rank's bytes above
    it instead, as soon as one is found (the first stage, which holds the most micro-batches, first): enough to
    know a setting does not fit, for a fraction of the work."""
    precision = planned_precision(config.train.precision)  # the run's own rule (bf16 on a GPU for auto)
    busiest, microbatches = 0, 0
    for pp_rank in range(layout.pp):
        estimate = memory.estimate(config, layout.world_size, precision, pp_rank, resolved)
        busiest, microbatches = max(busiest, estimate.total), microbatches or estimate.microbatches
        if stop_above is not None and busiest > stop_above:
            break
    return busiest, microbatches


def evaluate(config: RunConfig, layout: Layout, hardware: communication.Hardware, gpus_per_node: int,
             efficiency: float = EFFICIENCY, memory_total: int | None = None) -> Plan:
    """The plan of ``config`` (already set to ``layout``): memory of the busiest rank and the step estimate."""
    microbatches = micro_batching(config, layout.dp, layout.pp)[1]
    if memory_total is None:
        memory_total = memory_bytes(config, layout)[0]
    balance = shared_balance(config, layout, hardware.sharing)
    compute = compute_seconds(config, layout, hardware.bf16_flops * efficiency, hardware.memory_bandwidth) * balance
    bubble = bubble_seconds(compute, layout, microbatches, config.parallel.pp_virtual_stages, hardware.sharing,
                            balance)
    exposed = exposed_communication(config, layout, compute, hardware, gpus_per_node, microbatches)
    return Plan(config, layout, memory_total, compute, bubble, exposed)


@dataclass(frozen=True)
class Candidate:
    """A setting to weigh, with a lower bound on its step: compute and bubble, no communication yet."""

    base: RunConfig  # the config planned for
    layout: Layout
    recompute: str
    grad_reduce: str
    schedule: tuple[str, int]
    micro_batch_size: int | None  # None: the config's own
    bound: float

    @property
    def setting(self) -> tuple:
        return self.layout, self.recompute, self.grad_reduce, self.schedule, self.micro_batch_size

    @functools.cached_property
    def config(self) -> RunConfig:
        """The config set to this candidate (built when weighed: most candidates are bounded out first)."""
        return with_layout(self.base, self.layout, self.recompute, self.grad_reduce, self.schedule,
                           self.micro_batch_size)


def micro_batch_sizes(config: RunConfig, layout: Layout) -> list[int | None]:
    """The micro-batch sizes to try: every divisor of the per-rank batch, unless the config fixes the size or the
    micro-batch count (None: the config's own)."""
    if config.train.micro_batch_size is not None or config.parallel.microbatches is not None:
        return [None]
    per_rank, rest = divmod(config.train.global_batch_size, layout.dp)
    if rest:
        return [None]
    small = [b for b in range(1, math.isqrt(per_rank) + 1) if per_rank % b == 0]
    return sorted({*small, *(per_rank // b for b in small)})


def fixed_layouts(config: RunConfig, world_size: int, fixed: dict[str, int]) -> list[Layout]:
    """The valid layouts of ``world_size`` for the model with the ``fixed`` degrees; ConfigError naming the values
    each fixed degree can take when none has them."""
    layouts = valid_layouts(world_size, config.model, config.moe)
    chosen = [layout for layout in layouts if all(getattr(layout, k) == v for k, v in fixed.items())]
    if not chosen and fixed:
        options = "; ".join(f"parallel.{k} in {sorted({getattr(layout, k) for layout in layouts})}" for k in fixed)
        given = " ".join(f"parallel.{k}={v}" for k, v in fixed.items())
        raise ConfigError(f"{given}: no valid layout of {world_size} GPUs for this model has "
                          f"{'that degree' if len(fixed) == 1 else 'those degrees'}; valid: {options}")
    return chosen


def none_passes(world_size: int, refusal: str | None) -> ConfigError:
    """The error when no candidate passes train.py's checks, with the first refusal: more GPUs would not help."""
    return ConfigError(f"no layout of {world_size} GPUs passes train.py's checks for this config"
                       + (f", e.g. {refusal}" if refusal else " (none is valid for the model's shapes)"))


def candidates(config: RunConfig, world_size: int, hardware: communication.Hardware, efficiency: float,
               fixed: dict[str, int] | None = None) -> list[Candidate]:
    """Every setting to rank (module docstring), cheapest bound first. Only the batch split is checked here
    (``micro_batching``); ``search`` holds each candidate it estimates to all of train.py's checks.

    The bounds' figures are computed once per distinct input: each pipeline rank's FLOPs per (pp, v,
    recompute), each block's roofline per (tp, ep, etp, tokens a micro-batch), the bound per (pp, cp, tp, ep,
    etp, v, recompute, micro-batch size), which with the world size fix dp and the micro-batches too. A bound is
    the very sum of compute and bubble that ``evaluate`` makes.
    """
    out, refusal = [], None
    peak = hardware.bf16_flops * efficiency
    bounds: dict[tuple, float] = {}  # compute + bubble
    # the config under each (recompute, schedule, micro): compute_seconds and shared_balance read the degrees from
    # the layout they are given, the rest from the config, so one config serves every layout
    settings: dict[tuple, RunConfig] = {}
    splits: dict[tuple, tuple[int, int] | str] = {}  # the batch split (or its refusal) per (dp, pp, micro)
    for layout in fixed_layouts(config, world_size, fixed or {}):
        sharded = layout.dp_shard_cp > 1 or (layout.edp > 1 and experts_own_unit(layout, config.model))
        for micro in micro_batch_sizes(config, layout):
            if (layout.dp, layout.pp, micro) not in splits:
                try:  # the batch split: the searched sizes divide the per-rank batch, the config's own may not
                    splits[layout.dp, layout.pp, micro] = micro_batching(
                        with_layout(config, layout, "none", micro_batch_size=micro), layout.dp, layout.pp)
                except ConfigError as exc:
                    splits[layout.dp, layout.pp, micro] = str(exc)
            split = splits[layout.dp, layout.pp, micro]
            if isinstance(split, str):
                refusal = refusal or split
                continue
            size, microbatches = split
            for recompute, grad_reduce, schedule in itertools.product(recompute_settings(config), GRAD_REDUCE,
                                                                      schedules(config, layout)):
                if grad_reduce != "step" and (microbatches == 1 or not sharded):
                    continue  # one micro-batch, or no FSDP shard group of several ranks: the same plan as step
                key = (layout.pp, layout.cp, layout.tp, layout.ep, layout.etp, schedule[1], recompute, size)
                if key not in bounds:
                    if (recompute, schedule, micro) not in settings:
                        settings[recompute, schedule, micro] = with_layout(config, layout, recompute,
                                                                           schedule=schedule, micro_batch_size=micro)
                    setting = settings[recompute, schedule, micro]
                    balance = shared_balance(setting, layout, hardware.sharing)
                    compute = compute_seconds(setting, layout, peak, hardware.memory_bandwidth) * balance
                    bounds[key] = compute + bubble_seconds(compute, layout, microbatches, schedule[1], hardware.sharing,
                                                           balance)
                out.append(Candidate(config, layout, recompute, grad_reduce, schedule, micro, bounds[key]))
    if not out:
        raise none_passes(world_size, refusal)
    out.sort(key=lambda c: c.bound)
    return out


def traffic_floor(config: RunConfig, layout: Layout, hardware: communication.Hardware, gpus_per_node: int,
                  every_micro_batch_size: bool = False) -> float:
    """Seconds of exposed communication (``exposed_communication``) that no setting of ``config``'s layout,
    micro-batch size and virtual stages goes below, whatever its recompute, gradient reduction and schedule
    name: ``config`` is that setting under recompute ``none`` and ``grad_reduce=step``. With
    ``every_micro_batch_size``, and ``config`` at the largest size searched (one micro-batch a step), a floor for
    every micro-batch size of the layout, of FSDP's traffic and the traffic each step carries whole
    (``carried_whole``). ``search`` raises a candidate's bound by it before it weighs the candidate's memory: the
    bound of compute and bubble alone leaves within reach every setting that its traffic sets back (a cp
    setting's bound is its twin's with cp folded into dp_shard; at 1,024 GPUs traffic is a quarter of the first
    plans' step).

    Each term is at most what the estimate counts for every one of those settings:

    - the estimate is the largest stage's sum, so at least the first stage's (rank 0's), the only one counted here;
    - tp, cp, ep and pp traffic and Muon's optimizer-step gathers wait in full (Muon's depend on none of these
      settings). Recompute only multiplies an item's calls by 1 + (its layer is
      recomputed), ``microbatch`` only the sequence-parallel norms' gradient all-reduces' calls by m
      (``communication._gradient_syncs``), neither changes a call's bytes or group, and the schedule's name
      changes no item: each item's seconds (latency and bytes per call, times the calls) are least under
      ``none`` and ``step``;
    - FSDP shows ``ShardingTime.exposed``, at least its ends + slowdown × its rest: what of the last
      micro-batch's reductions its backward does not hide is nonnegative, and max(overlapped − compute,
      slowdown × overlapped) is at least slowdown × rest. The ends are one call each of the largest gather and
      reductions, the same under both settings (a call's bytes and latency do not depend on how many there are);
      under ``microbatch`` the last micro-batch's reductions are the same (1/m of m times the reduce-scatters)
      and the rest more (m − 1 more reduce-scatters, and at least as many gathers: ``communication._gathers``).
      Recompute changes no FSDP traffic;
    - over the micro-batch sizes b of a per-rank batch B (m = B / b micro-batches): no FSDP call depends on b, the
      reductions run once under ``step`` and the gathers grow with m, so the ends stay and the rest is least at
      m = 1; what ``carried_whole`` counts is m calls of b sequences' bytes (or one call of m values), the same
      bytes at every b and the fewest calls at m = 1.
    """
    waiting, sharding = stage_traffic(config, layout, 0, hardware, gpus_per_node)
    fsdp = sharding_time(sharding, "step", microbatches=1)  # under step the count of micro-batches plays no part
    counted = sum(seconds for item, seconds in waiting if not every_micro_batch_size or carried_whole(item))
    return counted + fsdp.ends + hardware.overlap_slowdown * fsdp.rest


def carried_whole(item: communication.Traffic) -> bool:
    """Whether a step carries the same bytes in ``item`` at every micro-batch size, in a call per micro-batch or
    fewer: pp's sends of each micro-batch's hidden states (a send's bus bytes are its buffer's), its one broadcast
    of the m losses and MTP's one embedding all-reduce; cp's gathers of keys and values and the reduce-scatters of
    their gradients, whose buffers hold whole sequences (a multiple of 2 · cp positions: ``valid_layouts``), so
    their bus bytes, (cp − 1) / cp of a buffer, are exact. Not tp's and ep's rows per expert, rounded per
    micro-batch (``communication.kept_per_expert``), nor cp's balancing counts, whose bus bytes are rounded down
    per call: one micro-batch's may carry more than m smaller ones'."""
    return item.dimension == "pp" or (item.dimension == "cp" and item.collective in ("all_gather", "reduce_scatter"))


ROUNDING = 1e-9  # the share a bound with ``traffic_floor`` is lowered by: its terms are summed in another order
# than the estimate's, so without it rounding could lift it a few units in the last place above the step it bounds


def smallest_micro_batch(candidate: Candidate) -> Candidate | None:
    """The same setting with micro-batches of one sequence, when that bounds its memory from below.

    The memory model's total then never falls as the micro-batch grows: every activation grows with the
    tokens while the micro-batches held in flight stay put (one without pipelining, pp − r under 1F1B and
    interleaved 1F1B once m ≥ pp), and the weights, gathers and held gradients stay (they change only where a
    step has a single micro-batch). Not under GPipe, which holds all m: fewer, larger micro-batches hold fewer
    per-micro-batch buffers (the bf16 weight copies). None where the config fixes the size, the size is 1
    already, or the rule does not hold."""
    micro, layout = candidate.micro_batch_size, candidate.layout
    per_rank = candidate.base.train.global_batch_size // layout.dp
    if micro is None or micro == 1 or per_rank // micro == 1 or candidate.schedule[0] == "gpipe":
        return None
    if layout.pp > 1 and per_rank // micro < layout.pp:
        return None
    return dataclasses.replace(candidate, micro_batch_size=1, bound=0.0)


@dataclass
class Search:
    """What ``plan`` found: the plans that fit (fastest first), the candidates, and the closest miss."""

    plans: list[Plan]
    considered: int
    evaluated: int  # candidates train.py accepts whose memory was estimated (the rest were bounded out)
    complete: bool  # every candidate checked: ``plans`` is every plan that fits
    closest: tuple[Candidate, int] | None = None  # the least memory among those that do not fit, when none does


def search(config: RunConfig, world_size: int, device_memory: float, gpus_per_node: int = 8,
           hardware: communication.Hardware = communication.HARDWARE["h100"], efficiency: float = EFFICIENCY,
           top: int | None = None, faster_than: float | None = None, fixed: dict[str, int] | None = None) -> Search:
    """Rank the candidates: the ``top`` fastest that fit exactly (all of them by default), or every plan faster
    than ``faster_than`` seconds.

    Candidates come cheapest bound first; since a step is never below its bound, once ``top`` plans fit and the
    next bound exceeds the slowest of them (or the bound reaches ``faster_than``), no later candidate can enter.
    Once the bound can prune, a candidate's turn raises its bound by a ``traffic_floor`` (its layout's, then its
    micro-batch size's) and puts it back in line: only those still within reach are weighed, the most promising
    first. Equal steps are ranked by memory, then by the candidates' order, so the plans are the full search's
    whatever the order they were found in.
    """
    pool = candidates(config, world_size, hardware, efficiency, fixed)
    queue = [(candidate.bound, index, 0) for index, candidate in enumerate(pool)]  # sorted, so a heap already
    plans: list[tuple[Plan, int]] = []  # each with its candidate's place in the pool
    steps: list[float] = []  # a max-heap (negated) of the ``top`` fastest steps so far
    closest, evaluated, refusal, complete = None, 0, None, True
    # memory of each setting weighed (None: train.py refuses it), and whether exact (else: a rank's, above the device)
    needs: dict[tuple, tuple[int, bool] | None] = {}
    floors: dict[tuple, int] = {}  # the busiest pipeline rank's model states, per layout and virtual stages
    deferred: list[tuple[int, Candidate]] = []  # skipped by their states alone: weighed only if no plan fits
    traffic: dict[tuple, float] = {}  # ``traffic_floor`` per raise, layout, micro-batch size and virtual stages

    def raised(candidate: Candidate, level: int) -> float:
        """The candidate's bound raised by a ``traffic_floor``: at level 1 the floor of every micro-batch size of
        its layout (at the largest searched: the per-rank batch), at level 2 its own size's. The first is shared
        by several times more candidates, and bounds out most."""
        layout, micro = candidate.layout, candidate.micro_batch_size
        if level == 1 and micro is not None:
            micro = config.train.global_batch_size // layout.dp
        key = (level, layout, micro, candidate.schedule[1])
        if key not in traffic:
            least = with_layout(config, layout, "none", "step", candidate.schedule, micro)
            traffic[key] = traffic_floor(least, layout, hardware, gpus_per_node, every_micro_batch_size=level == 1)
        return (candidate.bound + traffic[key]) * (1 - ROUNDING)

    def states_floor(candidate: Candidate) -> int:
        """A lower bound of the candidate's memory that does not depend on its micro-batching, recompute or
        gradient reduction: the model states (``memory.estimate``'s total adds only nonnegative parts to them),
        which only the layout and the stage cut decide. Remembered: most settings share a layout."""
        key = (candidate.layout, candidate.schedule[1])
        if key not in floors:
            floors[key] = max(model_states(candidate.config, candidate.layout, pp_rank).total
                              for pp_rank in range(candidate.layout.pp))
        return floors[key]

    def need_of(candidate: Candidate, exact: bool = False) -> int | None:
        """The busiest rank's bytes; unless ``exact``, possibly a smaller rank's where that one does not fit."""
        known = needs.get(candidate.setting, False)
        if known is False or (known is not None and exact and not known[1]):
            try:
                resolved = resolve_layout(candidate.config, world_size)  # train.py's own checks
            except ConfigError as exc:
                needs[candidate.setting] = None
                nonlocal refusal
                refusal = refusal or str(exc)
            else:
                need = memory_bytes(candidate.config, candidate.layout, resolved, None if exact else device_memory)[0]
                needs[candidate.setting] = (need, exact or need <= device_memory)
        known = needs[candidate.setting]
        return None if known is None else known[0]

    misses: list[tuple[int, int, Candidate]] = []  # (need, pool order, candidate) of those that do not fit

    def weigh(index: int, candidate: Candidate) -> int | None:
        """The candidate's memory when train.py accepts it and its micro-batches of one may fit, else None."""
        nonlocal evaluated
        smallest = smallest_micro_batch(candidate)
        if smallest is not None and (floor := need_of(smallest)) is not None and floor > device_memory:
            return None  # its micro-batches of one do not fit: larger ones cannot (``smallest_micro_batch``)
        need = need_of(candidate)
        if need is not None:
            evaluated += 1
            if need > device_memory:
                misses.append((need, index, candidate))
        return need

    while queue:
        bound, index, level = heapq.heappop(queue)
        filled = top is not None and len(steps) == top
        if (filled and bound > -steps[0]) or (faster_than is not None and bound >= faster_than):
            complete = False
            break
        candidate = pool[index]
        if level < 2 and (filled or faster_than is not None):  # a higher bound can now keep it from being weighed
            heapq.heappush(queue, (raised(candidate, level + 1), index, level + 1))
            continue
        if states_floor(candidate) > device_memory:
            deferred.append((index, candidate))  # its weights, gradients and moments alone do not fit
            continue
        need = weigh(index, candidate)
        if need is None or need > device_memory:
            continue
        result = evaluate(candidate.config, candidate.layout, hardware, gpus_per_node, efficiency, need)
        plans.append((result, index))
        if top is not None:
            heapq.heappush(steps, -result.step)
            if len(steps) > top:
                heapq.heappop(steps)
    if not plans:  # the closest miss is the least memory of all: weigh the candidates the states floor skipped
        for index, candidate in deferred:
            weigh(index, candidate)
        if misses:  # their exact bytes: the weighing stopped at the first rank that did not fit
            exact = [(need_of(candidate, exact=True), index, candidate) for _, index, candidate in misses]
            need, _, candidate = min(exact, key=lambda miss: miss[:2])  # the first in pool order among equals
            closest = (candidate, need)
    if evaluated == 0 and complete:
        raise none_passes(world_size, refusal)
    ranked = [plan for plan, _ in sorted(plans, key=lambda found: (found[0].step, found[0].memory, found[1]))
              if faster_than is None or plan.step < faster_than]
    return Search(ranked[:top] if top is not None else ranked, len(pool), evaluated, complete,
                  closest if not plans else None)


def plan(config: RunConfig, world_size: int, device_memory: float, gpus_per_node: int = 8,
         hardware: communication.Hardware = communication.HARDWARE["h100"], efficiency: float = EFFICIENCY,
         top: int | None = None) -> tuple[list[Plan], int]:
    """The plans that fit ``device_memory`` bytes, fastest first (the ``top`` first only, when given), and how
    many candidates were considered (``search``)."""
    found = search(config, world_size, device_memory, gpus_per_node, hardware, efficiency, top)
    return found.plans, found.considered


def format_plans(config: RunConfig, found: Search, world_size: int, device_memory: float,
                 hardware: communication.Hardware, efficiency: float, top: int, usable: float | None = None,
                 command: Callable[[Plan], str] | None = None) -> str:
    """The ranking as text: a header, the table, and with ``command`` the command that runs each row. ``usable``
    is what the search allowed of ``device_memory`` (after the headroom; the whole device when None)."""
    tokens = config.train.global_batch_size * config.model.seq_len
    params = parameter_counts(config.model, config.moe)
    plans = found.plans
    limit = device_memory if usable is None else usable
    room = "" if usable is None else (f" ({usable / GIB:.1f} usable: {1 - usable / device_memory:.0%} headroom for "
                                      "the CUDA context, NCCL and allocator fragmentation, --headroom)")
    lines = [f"{config.name}: {params.total / 1e9:.2f}B parameters ({params.active / 1e9:.2f}B active), "
             f"{tokens:,} tokens per step, on {world_size} × {hardware.name}, {device_memory / GIB:.0f} GiB each"
             f"{room}, matmuls at {efficiency:.0%} of the bf16 peak",
             f"{found.considered:,} candidate settings; {found.evaluated:,} estimated in full, the rest bounded "
             f"slower than #{top} by their compute, bubble and least traffic" if not found.complete else
             f"{found.considered:,} candidate settings, {len(plans):,} fit"]
    if not plans:
        if found.closest:
            candidate, need = found.closest
            plan_text = evaluate(candidate.config, candidate.layout, hardware, hardware.gpus_per_node, efficiency,
                                 need).describe()
            than = (f"{device_memory / GIB:.0f} GiB" if usable is None else
                    f"the {usable / GIB:.1f} GiB usable of {device_memory / GIB:.0f} GiB")
            lines.append(f"none fits: the closest, {plan_text}, needs {need / GIB:.1f} GiB per GPU, "
                         f"{(need - limit) / GIB:.1f} GiB more than {than}; add GPUs, "
                         "use larger devices, or a smaller model")
        return "\n".join(lines)
    lines.append("milliseconds per optimizer step: the total, then compute, pipeline bubble and the exposed "
                 "communication of each dimension")
    muon = any(p.exposed["muon"] for p in plans[:top])  # Muon's gathers in the optimizer step, where it runs
    lines.append(f"{'#':>3} {'layout':<52} {'GiB':>6} {'step':>9} {'compute':>9} {'bubble':>8} {'tp':>8} "
                 f"{'cp':>8} {'ep':>8} {'pp':>7} {'fsdp':>8} " + (f"{'muon':>8} " if muon else "")
                 + f"{'tok/s/GPU':>10}")
    for rank, p in enumerate(plans[:top], 1):
        ms = {k: v * 1e3 for k, v in p.exposed.items()}
        lines.append(f"{rank:>3} {p.describe():<52} {p.memory / GIB:>6.1f} {p.step * 1e3:>9.2f} "
                     f"{p.compute * 1e3:>9.2f} {p.bubble * 1e3:>8.2f} {ms['tp']:>8.2f} {ms['cp']:>8.2f} "
                     f"{ms['ep']:>8.2f} {ms['pp']:>7.2f} {ms['fsdp']:>8.2f} "
                     + (f"{ms['muon']:>8.2f} " if muon else "") + f"{tokens / p.step / world_size:>10,.0f}")
    if command is not None:
        lines.append("to run a plan (add --dry-run --world-size N to train.py's part to check it first):")
        lines += [f"{rank:>3} {command(p)}" for rank, p in enumerate(plans[:top], 1)]
    return "\n".join(lines)


def fixed_degrees(overrides: list[str]) -> dict[str, int]:
    """The parallel degrees a ``--set`` fixes (``parallel.tp=2``): the planner searches only the others."""
    fixed = {}
    for item in overrides:
        key, _, value = item.partition("=")
        name = key.removeprefix("parallel.")
        if key.startswith("parallel.") and name in DEGREE_KEYS:
            fixed[name] = int(value)
    return fixed


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-plan", __doc__)
    add_config_arguments(parser, set_help="config overrides; a parallel degree set here (parallel.tp=2) is fixed, "
                                          "the rest searched")
    add_world_size(parser, required=True, help="GPUs to plan for")
    parser.add_argument("--device-memory", type=float, default=None,
                        help="GiB per GPU (default: the --gpu preset's)")
    communication.add_hardware_arguments(parser)
    parser.add_argument("--efficiency", type=float, default=EFFICIENCY,
                        help=f"fraction of the bf16 peak the matmuls reach (default {EFFICIENCY:.3f}, calibrated: "
                             "step_time.calibrated_efficiency)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--headroom", type=float, default=memory.DEFAULT_HEADROOM,
                        help=f"fraction of each GPU's memory a plan leaves free (default {memory.DEFAULT_HEADROOM}: "
                             "the CUDA context, NCCL buffers and allocator fragmentation, which the memory model "
                             "does not count)")
    args = parser.parse_args(argv)

    def plan_layouts() -> None:
        world_size = world_size_of(args)
        if not 0 < args.efficiency <= 1:  # NaN fails this too
            raise ConfigError(f"--efficiency must be in (0, 1], got {args.efficiency}")
        if args.top < 1:
            raise ConfigError(f"--top must be at least 1, got {args.top}")
        config = load_config_from(args)
        hardware = communication.hardware_from_args(args, args.device_memory)
        usable = memory.usable_bytes(hardware.memory_gib * GIB, args.headroom)
        found = search(config, world_size, usable, hardware.gpus_per_node, hardware,
                       args.efficiency, args.top, fixed=fixed_degrees(args.overrides))
        command = lambda p: launch_command(p, config, args.config, args.overrides, hardware.gpus_per_node)  # noqa: E731
        print(format_plans(config, found, world_size, hardware.memory_gib * GIB, hardware, args.efficiency,
                           args.top, usable, command))

    return run_command(plan_layouts)


if __name__ == "__main__":
    sys.exit(main())
