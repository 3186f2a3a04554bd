"""The planner's search: every candidate setting of a config's layout on N GPUs, each bounded from below by its
compute and pipeline bubble (``candidates``) and by the least traffic its layout can have (``traffic_floor``), and
weighed in full (memory, then the step estimate: ``evaluate``) only while it can still enter the first plans
(``search``). What the candidates are, and what the step is, ``analysis.planner``'s docstring says; the command line
and the table are there too.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from dataclasses import dataclass

from analysis import memory
from analysis.gpu_presets import HARDWARE, Hardware
from analysis.memory_states import experts_own_unit, model_states
from analysis.replica_time import REPLICA_CHOICES, straggler_wait
from analysis.step_time import (
    EFFICIENCY,
    bubble_seconds,
    compute_seconds,
    exposed_communication,
    sharding_time,
    shared_balance,
    stage_traffic,
)
from analysis.traffic_items import Traffic
from config.errors import ConfigError
from config.run import RunConfig
from parallel.hardware import planned_precision
from parallel.layout import Layout, valid_layouts
from parallel.pipeline import stage_layers
from parallel.resolve import micro_batching, resolve_layout
from parallel.sharding import GRAD_REDUCE

RECOMPUTE = ("none", "moe", "full")


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
        if par.ep_replicas:
            extra.append(f"R={par.ep_replicas}")  # replica slots per ep rank
        return " ".join([degrees or "one rank", *extra])


DEGREE_KEYS = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")


def pipeline_split(plan: Plan) -> list[int]:
    """How many layers each pipeline stage of ``plan`` holds (pp · v stages; [n_layers] without a pipeline): the
    split ``parallel/pipeline.py`` makes, balanced by training FLOPs per token with the head's on the last."""
    model, par = plan.config.model, plan.config.parallel
    if plan.layout.pp == 1:
        return [model.n_layers]
    return [len(layers) for layers in stage_layers(model, plan.config.moe, plan.layout.pp * par.pp_virtual_stages)]


def split_spread(plan: Plan) -> int:
    """The most layers a stage holds less the fewest: 0 for an even split (or none)."""
    split = pipeline_split(plan)
    return max(split) - min(split)


def ranking(plan: Plan, index: int) -> tuple:
    """A plan's place among the plans: the faster first; of equal steps the more even pipeline split, then the
    less memory, then the candidate's place in the pool (``index``)."""
    return plan.step, split_spread(plan), plan.memory, index


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


def evaluate(config: RunConfig, layout: Layout, hardware: Hardware, gpus_per_node: int,
             efficiency: float = EFFICIENCY, memory_total: int | None = None, imbalance: float = 1.0,
             device_memory: float | None = None, replicas: tuple[int, ...] = REPLICA_CHOICES) -> Plan:
    """The plan of ``config`` (already set to ``layout``): memory of the busiest rank and the step estimate. Under
    expert parallelism with ``imbalance`` > 1 (the busiest ep rank's rows over the mean), the wait for that rank
    and the replica slots (``parallel.ep_replicas`` in ``replicas``, default 0, 1, 2) that make it least, among those
    whose memory fits ``device_memory`` (``analysis.replica_time.straggler_wait``): where the best R's slots do not
    fit, the best of the other R's. One R (fixed by ``--set``): that one, its slots weighed already in ``config``."""
    size, microbatches = micro_batching(config, layout.dp, layout.pp)
    if memory_total is None:
        memory_total = memory_bytes(config, layout)[0]
    while (wait := straggler_wait(config, layout, size, microbatches, hardware, gpus_per_node, efficiency,
                                  imbalance, replicas)).replicas:
        if wait.replicas == config.parallel.ep_replicas:  # R fixed by --set: config and memory_total are its own
            break
        replicated = dataclasses.replace(config, parallel=dataclasses.replace(config.parallel,
                                                                              ep_replicas=wait.replicas))
        need = memory_bytes(replicated, layout)[0]
        if device_memory is None or need <= device_memory:
            config, memory_total = replicated, need
            break
        replicas = tuple(r for r in replicas if r != wait.replicas)  # its slots do not fit: the best of the others
    balance = shared_balance(config, layout, hardware.sharing)
    compute = compute_seconds(config, layout, hardware.bf16_flops * efficiency, hardware.memory_bandwidth) * balance
    bubble = bubble_seconds(compute, layout, microbatches, config.parallel.pp_virtual_stages, hardware.sharing,
                            balance)
    exposed = exposed_communication(config, layout, compute, hardware, gpus_per_node, microbatches)
    return Plan(config, layout, memory_total, compute, bubble, {**exposed, "imbalance": wait.seconds})


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


def candidates(config: RunConfig, world_size: int, hardware: Hardware, efficiency: float,
               fixed: dict[str, int] | None = None) -> list[Candidate]:
    """Every setting to rank (``analysis.planner``'s docstring), cheapest bound first. Only the batch split is
    checked here (``micro_batching``); ``search`` holds each candidate it estimates to all of train.py's checks.

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


def traffic_floor(config: RunConfig, layout: Layout, hardware: Hardware, gpus_per_node: int,
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
      (``traffic_items._gradient_syncs``), neither changes a call's bytes or group, and the schedule's name
      changes no item: each item's seconds (latency and bytes per call, times the calls) are least under
      ``none`` and ``step``;
    - FSDP shows ``ShardingTime.exposed``, at least its ends + slowdown × its rest: what of the last
      micro-batch's reductions its backward does not hide is nonnegative, and max(overlapped − compute,
      slowdown × overlapped) is at least slowdown × rest. The ends are one call each of the largest gather and
      reductions, the same under both settings (a call's bytes and latency do not depend on how many there are);
      under ``microbatch`` the last micro-batch's reductions are the same (1/m of m times the reduce-scatters)
      and the rest more (m − 1 more reduce-scatters, and at least as many gathers: ``traffic_weights._gathers``).
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


def carried_whole(item: Traffic) -> bool:
    """Whether a step carries the same bytes in ``item`` at every micro-batch size, in a call per micro-batch or
    fewer: pp's sends of each micro-batch's hidden states (a send's bus bytes are its buffer's), its one broadcast
    of the m losses and MTP's one embedding all-reduce; cp's gathers of keys and values and the reduce-scatters of
    their gradients, whose buffers hold whole sequences (a multiple of 2 · cp positions: ``valid_layouts``), so
    their bus bytes, (cp − 1) / cp of a buffer, are exact. Not tp's and ep's rows per expert, rounded per
    micro-batch (``traffic_activations.kept_per_expert``), nor cp's balancing counts, whose bus bytes are rounded down
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


class _Weighing:
    """What ``search`` has learnt of the candidates it weighed, remembered across them: each setting's memory (or
    train.py's refusal), the model-states floor of each layout, the ``traffic_floor`` of each raise, and the
    candidates that do not fit."""

    def __init__(self, config: RunConfig, world_size: int, device_memory: float, gpus_per_node: int,
                 hardware: Hardware) -> None:
        self.config, self.world_size, self.device_memory = config, world_size, device_memory
        self.gpus_per_node, self.hardware = gpus_per_node, hardware
        self.evaluated = 0  # candidates train.py accepts whose memory was estimated
        self.refusal: str | None = None  # the first of train.py's refusals
        # memory of each setting weighed (None: train.py refuses it), and whether exact (else: a rank's, above the
        # device)
        self.needs: dict[tuple, tuple[int, bool] | None] = {}
        self.floors: dict[tuple, int] = {}  # the busiest pipeline rank's model states, per layout and virtual stages
        # ``traffic_floor`` per raise, layout, micro-batch size and virtual stages
        self.traffic: dict[tuple, float] = {}
        self.misses: list[tuple[int, int, Candidate]] = []  # (need, pool order, candidate) of those that do not fit

    def raised(self, candidate: Candidate, level: int) -> float:
        """The candidate's bound raised by a ``traffic_floor``: at level 1 the floor of every micro-batch size of
        its layout (at the largest searched: the per-rank batch), at level 2 its own size's. The first is shared
        by several times more candidates, and bounds out most."""
        layout, micro = candidate.layout, candidate.micro_batch_size
        if level == 1 and micro is not None:
            micro = self.config.train.global_batch_size // layout.dp
        key = (level, layout, micro, candidate.schedule[1])
        if key not in self.traffic:
            least = with_layout(self.config, layout, "none", "step", candidate.schedule, micro)
            self.traffic[key] = traffic_floor(least, layout, self.hardware, self.gpus_per_node,
                                              every_micro_batch_size=level == 1)
        return (candidate.bound + self.traffic[key]) * (1 - ROUNDING)

    def states_floor(self, candidate: Candidate) -> int:
        """A lower bound of the candidate's memory that does not depend on its micro-batching, recompute or
        gradient reduction: the model states (``memory.estimate``'s total adds only nonnegative parts to them),
        which only the layout and the stage cut decide. Remembered: most settings share a layout."""
        key = (candidate.layout, candidate.schedule[1])
        if key not in self.floors:
            self.floors[key] = max(model_states(candidate.config, candidate.layout, pp_rank).total
                                   for pp_rank in range(candidate.layout.pp))
        return self.floors[key]

    def need_of(self, candidate: Candidate, exact: bool = False) -> int | None:
        """The busiest rank's bytes; unless ``exact``, possibly a smaller rank's where that one does not fit."""
        known = self.needs.get(candidate.setting, False)
        if known is False or (known is not None and exact and not known[1]):
            try:
                resolved = resolve_layout(candidate.config, self.world_size)  # train.py's own checks
            except ConfigError as exc:
                self.needs[candidate.setting] = None
                self.refusal = self.refusal or str(exc)
            else:
                need = memory_bytes(candidate.config, candidate.layout, resolved,
                                    None if exact else self.device_memory)[0]
                self.needs[candidate.setting] = (need, exact or need <= self.device_memory)
        known = self.needs[candidate.setting]
        return None if known is None else known[0]

    def weigh(self, index: int, candidate: Candidate) -> int | None:
        """The candidate's memory when train.py accepts it and its micro-batches of one may fit, else None."""
        smallest = smallest_micro_batch(candidate)
        if smallest is not None and (floor := self.need_of(smallest)) is not None and floor > self.device_memory:
            return None  # its micro-batches of one do not fit: larger ones cannot (``smallest_micro_batch``)
        need = self.need_of(candidate)
        if need is not None:
            self.evaluated += 1
            if need > self.device_memory:
                self.misses.append((need, index, candidate))
        return need

    def closest(self, deferred: list[tuple[int, Candidate]]) -> tuple[Candidate, int] | None:
        """The closest miss when no plan fits: the least memory of all, once the candidates the states floor
        skipped (``deferred``) are weighed too."""
        for index, candidate in deferred:
            self.weigh(index, candidate)
        if not self.misses:
            return None
        # their exact bytes: the weighing stopped at the first rank that did not fit
        exact = [(self.need_of(candidate, exact=True), index, candidate) for _, index, candidate in self.misses]
        need, _, candidate = min(exact, key=lambda miss: miss[:2])  # the first in pool order among equals
        return candidate, need


def search(config: RunConfig, world_size: int, device_memory: float, gpus_per_node: int = 8,
           hardware: Hardware = HARDWARE["h100"], efficiency: float = EFFICIENCY,
           top: int | None = None, faster_than: float | None = None, fixed: dict[str, int] | None = None,
           imbalance: float = 1.0, replicas: tuple[int, ...] = REPLICA_CHOICES) -> Search:
    """Rank the candidates: the ``top`` fastest that fit exactly (all of them by default), or every plan faster
    than ``faster_than`` seconds.

    Candidates come cheapest bound first; since a step is never below its bound, once ``top`` plans fit and the
    next bound exceeds the slowest of them (or the bound reaches ``faster_than``), no later candidate can enter.
    Once the bound can prune, a candidate's turn raises its bound by a ``traffic_floor`` (its layout's, then its
    micro-batch size's) and puts it back in line: only those still within reach are weighed, the most promising
    first. Equal steps are ranked by the evenness of their pipeline split (``split_spread``), then by memory, then
    by the candidates' order, so the plans are the full search's whatever the order they were found in.
    ``imbalance``: the routing ``evaluate`` prices under ep (1.0: balanced, no replica slots), with the R among
    ``replicas`` that pays best.
    """
    pool = candidates(config, world_size, hardware, efficiency, fixed)
    queue = [(candidate.bound, index, 0) for index, candidate in enumerate(pool)]  # sorted, so a heap already
    plans: list[tuple[Plan, int]] = []  # each with its candidate's place in the pool
    steps: list[float] = []  # a max-heap (negated) of the ``top`` fastest steps so far
    deferred: list[tuple[int, Candidate]] = []  # skipped by their states alone: weighed only if no plan fits
    weighing, complete = _Weighing(config, world_size, device_memory, gpus_per_node, hardware), True
    while queue:
        bound, index, level = heapq.heappop(queue)
        filled = top is not None and len(steps) == top
        if (filled and bound > -steps[0]) or (faster_than is not None and bound >= faster_than):
            complete = False
            break
        candidate = pool[index]
        if level < 2 and (filled or faster_than is not None):  # a higher bound can now keep it from being weighed
            heapq.heappush(queue, (weighing.raised(candidate, level + 1), index, level + 1))
            continue
        if weighing.states_floor(candidate) > device_memory:
            deferred.append((index, candidate))  # its weights, gradients and moments alone do not fit
            continue
        need = weighing.weigh(index, candidate)
        if need is None or need > device_memory:
            continue
        result = evaluate(candidate.config, candidate.layout, hardware, gpus_per_node, efficiency, need, imbalance,
                          device_memory, replicas)
        plans.append((result, index))
        if top is not None:
            heapq.heappush(steps, -result.step)
            if len(steps) > top:
                heapq.heappop(steps)
    closest = weighing.closest(deferred) if not plans else None
    if weighing.evaluated == 0 and complete:
        raise none_passes(world_size, weighing.refusal)
    ranked = [plan for plan, _ in sorted(plans, key=lambda found: ranking(*found))
              if faster_than is None or plan.step < faster_than]
    return Search(ranked[:top] if top is not None else ranked, len(pool), weighing.evaluated, complete, closest)
