"""The planner held to the layouts large runs published: each one's rank in the planner's list, and its estimate.

    python -m analysis.published_layouts [--rows 1.7,18.4,...] [--moe]

Table 1 of Narayanan et al. 2021 (PTD-P; REFERENCES.md sec. 1.1): GPT models of 1.7B to 145.6B parameters on
32 to 1,536 A100-80GB GPUs, each with its published tensor- and pipeline-parallel degrees, the data-parallel
rest (replicas: Megatron had no sharded data parallelism then), the interleaved schedule wherever there is a
pipeline, and full activation recomputation (the paper's FLOP count, Eq. 3, includes it). Each row's model is
built here, not read from YAML: the paper's heads, hidden size and layers, vocabulary 51,200, sequence 2,048,
and a SwiGLU FFN of hidden 8h/3 (rounded to 64), which has the parameters and FLOPs of the paper's GeLU FFN of
4h (this toolkit's dense FFN is SwiGLU); the head is untied (pipelining refuses tied embeddings).

For each row (``published_row``):

- **rank**: 1 + the layouts (degrees, schedule and virtual stages; ``layout_of``) whose fastest setting
  ``analysis.layout_search.search`` estimates strictly faster than the published layout's fastest setting (any
  micro-batch size, recompute and gradient-reduction setting with the published tp, pp, replicas and schedule)
  among all that fit 80 GiB: the ranking the planner's CLI prints, each layout counted once.
- **rank without FSDP**: the same among layouts without sharded data parallelism (dp_shard = 1), the space the
  paper chose from; **among its d's splits**: among those with the published data-parallel degree d too (the
  weak-scaling experiment fixed d = 32 for the first six rows and chose how to split the rest into tp and pp).
- **TFLOP/s per GPU**: the paper's Eq. 3 FLOPs of one step over the estimated step of the published setting
  (full recompute, the fastest micro-batch size), against the published figure.

Table 2 of the same paper (``TABLE2``) measured ZeRO-3 without model parallelism, 175B and 530B GPTs on 384 to
2,240 GPUs: each row's estimate of FSDP over every GPU (``zero3_plan``) against its published TFLOP/s. Two of
the estimate's figures are calibrated once from these rows (``calibrated_network_efficiency``,
``calibrated_overlap_slowdown``), so this second table is a fit, two figures to six rows, not a test of them.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from analysis import gpu_presets, layout_search, link_time, planner, traffic_items
from analysis.traffic import predict
from config.cli import command_parser, run_command
from config.errors import ConfigError
from config.run import RunConfig, load_config
from parallel.layout import Layout

A100 = gpu_presets.HARDWARE["a100-80gb"]


@dataclass(frozen=True)
class Published:
    """One published run: the model, the GPUs, the global batch, the layout and its measured throughput."""

    name: str
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops: float  # per GPU, as published


# Narayanan et al. 2021, Table 1 (REFERENCES.md sec. 1.1), the rows up to 145.6B
TABLE1 = [Published("1.7", 24, 2304, 24, 1, 1, 32, 512, 137), Published("3.6", 32, 3072, 30, 2, 1, 64, 512, 138),
          Published("7.5", 32, 4096, 36, 4, 1, 128, 512, 142),
          Published("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135),
          Published("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138),
          Published("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140),
          Published("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148)]


def layout_of(p: layout_search.Plan) -> tuple:
    """What a layout is here: the six degrees, the pipeline schedule and its virtual stages per rank."""
    layout, par = p.layout, p.config.parallel
    return layout, par.pp_schedule, par.pp_virtual_stages


def layouts_ahead(plans: list[layout_search.Plan], step: float) -> list[layout_search.Plan]:
    """The fastest setting of each layout (``layout_of``) estimated strictly faster than ``step``, fastest first:
    a layout's other micro-batch sizes, recompute and reduction settings do not push the published one down."""
    seen, out = set(), []
    for p in plans:
        if p.step < step and layout_of(p) not in seen:
            seen.add(layout_of(p))
            out.append(p)
    return out


def gpt_config(row: Published) -> RunConfig:
    """The row's GPT in this toolkit's terms (module docstring)."""
    ffn = round(8 * row.hidden / 3 / 64) * 64
    return load_config("dense", [f"model.d_model={row.hidden}", f"model.n_heads={row.heads}",
                                 f"model.n_layers={row.layers}", f"model.ffn_hidden={ffn}", "model.vocab_size=51200",
                                 "model.seq_len=2048", f"train.global_batch_size={row.batch}",
                                 "train.precision=bf16", "model.tie_embeddings=false"])


def paper_flops(row: Published) -> float:
    """Eq. 3 of the paper: one step's FLOPs, the recomputed forward included."""
    b, s, layers, h, v = row.batch, 2048, row.layers, row.hidden, 51200
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def is_published(p: layout_search.Plan, row: Published) -> bool:
    """Whether a plan has the row's tp, pp, replicas (no FSDP shards) and, with a pipeline, the interleaved
    schedule."""
    layout = p.layout
    interleaved = layout.pp == 1 or p.config.parallel.pp_schedule == "interleaved_1f1b"
    return (layout.tp, layout.pp, layout.dp_replicate, layout.dp_shard) == (row.tp, row.pp, row.gpus // (
        row.tp * row.pp), 1) and interleaved


@dataclass(frozen=True)
class RowResult:
    row: Published
    best: layout_search.Plan  # the published layout's fastest setting
    paper_setting: layout_search.Plan  # with full recompute, as the paper ran it
    rank: int
    rank_without_fsdp: int
    rank_same_dp: int  # among the splits of the published data-parallel degree into tp and pp
    first: layout_search.Plan  # the planner's first choice
    considered: int
    setting_rank: int  # 1 + the settings (not layouts) estimated faster


def published_row(row: Published, hardware: gpu_presets.Hardware = A100) -> RowResult:
    config = gpt_config(row)
    memory = hardware.memory_gib * planner.GIB
    fixed = dict(tp=row.tp, pp=row.pp, dp_replicate=row.gpus // (row.tp * row.pp), dp_shard=1)
    mine = [p for p in layout_search.search(config, row.gpus, memory, hardware.gpus_per_node, hardware,
                                            fixed=fixed).plans if is_published(p, row)]
    if not mine:
        raise ValueError(f"the published layout of the {row.name}B row does not fit {hardware.memory_gib} GiB here")
    best = mine[0]
    paper_setting = next(p for p in mine if p.config.parallel.activation_checkpointing == "full")
    faster = layout_search.search(config, row.gpus, memory, hardware.gpus_per_node, hardware, faster_than=best.step)
    ahead = layouts_ahead(faster.plans, best.step)
    first = ahead[0] if ahead else best
    replicas = row.gpus // (row.tp * row.pp)
    return RowResult(row, best, paper_setting, 1 + len(ahead), 1 + sum(p.layout.dp_shard == 1 for p in ahead),
                     1 + sum((p.layout.dp_shard, p.layout.dp_replicate) == (1, replicas) for p in ahead), first,
                     faster.considered, 1 + sum(p.step < best.step for p in faster.plans))


# Narayanan et al. 2021, Table 2 (REFERENCES.md sec. 1.4): DeepSpeed's ZeRO-3 without model parallelism on
# A100-80GB, one micro-batch of batch / GPUs sequences per step (4, 2, 1; the paper's micro-batch column). 175B is
# the 145.6B row's width and heads with 96 layers, 530B is h = 20,480, 105 layers, 128 heads.
TABLE2 = [Published("175", 96, 12288, 96, 1, 1, 384, 1536, 144), Published("175", 96, 12288, 96, 1, 1, 768, 1536, 88),
          Published("175", 96, 12288, 96, 1, 1, 1536, 1536, 44),
          Published("530", 128, 20480, 105, 1, 1, 640, 2560, 138),
          Published("530", 128, 20480, 105, 1, 1, 1120, 2240, 98),
          Published("530", 128, 20480, 105, 1, 1, 2240, 2240, 48)]


def published_step(row: Published) -> float:
    """The row's measured seconds per step: its Eq. 3 FLOPs over the published TFLOP/s of all its GPUs."""
    return paper_flops(row) / (row.gpus * row.tflops * 1e12)


def zero3_plan(row: Published, hardware: gpu_presets.Hardware = A100) -> layout_search.Plan:
    """The planner's estimate of a Table 2 row as the paper ran it: FSDP over every GPU, full recompute, one
    micro-batch per step."""
    layout = Layout.resolve(row.gpus, dp_shard=row.gpus)
    config = layout_search.with_layout(gpt_config(row), layout, "full", micro_batch_size=row.batch // row.gpus)
    return layout_search.evaluate(config, layout, hardware, hardware.gpus_per_node)


def fsdp_items(plan: layout_search.Plan, hardware: gpu_presets.Hardware = A100) -> list[traffic_items.Traffic]:
    """The FSDP traffic of ``plan``'s first rank (``analysis.traffic.predict``) in ``hardware``'s precision."""
    return [item for item in predict(plan.config, plan.layout, 0, hardware.precision)
            if item.dimension == "fsdp"]


def communication_bound(row: Published, rows: list[Published] = TABLE2) -> bool:
    """Whether the row is one whose step did not shrink with more GPUs: each model's rows but its smallest."""
    return row.gpus > min(r.gpus for r in rows if r.name == row.name)


def calibrated_network_efficiency(rows: list[Published] = TABLE2, hardware: gpu_presets.Hardware = A100) -> float:
    """The share of its adapter's line rate a rank's traffic across nodes gets (``gpu_presets.NETWORK_EFFICIENCY``),
    from the communication-bound ``rows`` of Table 2: there the step is its FSDP traffic (``predict``'s bus bytes of
    one rank, 8 per parameter: bf16 gathers in forward and backward, fp32 gradient reduce-scatters), so each row's
    bytes over its published step less NCCL's latency (``link_time.startup``) is the rate; their mean."""
    rates = []
    for row in rows:
        if communication_bound(row, rows):
            plan = zero3_plan(row, hardware)
            items = fsdp_items(plan, hardware)
            latency = sum(link_time.startup(i, hardware, hardware.gpus_per_node) for i in items)
            rates.append(sum(i.bus_bytes for i in items) / (published_step(row) - latency) / hardware.inter_node)
    return sum(rates) / len(rates)


def calibrated_overlap_slowdown(rows: list[Published] = TABLE2, hardware: gpu_presets.Hardware = A100) -> float:
    """``gpu_presets.OVERLAP_SLOWDOWN`` from the ``rows`` of Table 2 whose compute outlasts their traffic (each
    model's smallest; the traffic at ``hardware``'s network efficiency): the published step less the estimate
    without slowdown, over the overlapped traffic's seconds (the estimate's growth from slowdown 0 to 1, linear
    in between while compute outlasts the traffic); their mean."""
    slowdowns = []
    for row in rows:
        if not communication_bound(row, rows):
            free, full = (zero3_plan(row, dataclasses.replace(hardware, overlap_slowdown=slowdown)).step
                          for slowdown in (0.0, 1.0))
            slowdowns.append((published_step(row) - free) / (full - free))
    return sum(slowdowns) / len(slowdowns)


def format_zero3_rows(plans: list[tuple[Published, layout_search.Plan]]) -> str:
    lines = ["| params (B) | GPUs | batch (micro) | est. compute s | est. FSDP traffic s | est. step s | "
             "published step s | est. TFLOP/s | published | error | fits 80 GiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row, p in plans:
        estimate = paper_flops(row) / (p.step * row.gpus) / 1e12
        fits = "yes" if p.memory <= A100.memory_gib * planner.GIB else f"no ({p.memory / planner.GIB:.0f} GiB)"
        traffic = sum(link_time.seconds(i, A100, A100.gpus_per_node) for i in fsdp_items(p))
        lines.append(f"| {row.name} | {row.gpus} | {row.batch} ({row.batch // row.gpus}) | {p.compute:.1f} | "
                     f"{traffic:.1f} | {p.step:.1f} | {published_step(row):.1f} | {estimate:.0f} | "
                     f"{row.tflops:.0f} | {(estimate - row.tflops) / row.tflops:+.0%} | "
                     f"{fits} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class PublishedMoE:
    """A published MoE mapping: the config, GPUs, global batch and its tp, pp, ep, etp and virtual stages."""

    name: str
    config: str
    overrides: tuple[str, ...]
    gpu: str
    gpus: int
    batch: int
    tp: int
    pp: int
    ep: int
    etp: int
    v: int
    source: str


# Megatron-Core's MoE README (megatron/core/transformer/moe/README.md, "Reference Best Parallel Mapping", MCore
# v0.8, 8×H100 nodes, dropless, all-to-all, bf16, micro-batch 1, sequence 4096, distributed optimizer); expert
# tensor parallelism defaults to tp there. Mixtral 8x22B's shape: mistralai/Mixtral-8x22B-v0.1's config.json
# (hidden 6144, 56 layers, 48 heads, 8 key-value heads, expert hidden 16384, vocabulary 32768).
MOE = [PublishedMoE("Mixtral 8x7B", "mixtral-8x7b", (), "h100", 64, 256, 1, 4, 8, 1, 8,
                    "Megatron-Core MoE README"),
       PublishedMoE("Mixtral 8x22B", "mixtral-8x7b", ("model.d_model=6144", "model.n_layers=56", "model.n_heads=48",
                                                      "model.n_kv_heads=8", "model.ffn_hidden=16384",
                                                      "moe.expert_hidden=16384", "model.vocab_size=32768"),
                    "h100", 128, 256, 4, 8, 2, 4, 7, "Megatron-Core MoE README")]


@dataclass(frozen=True)
class MoEResult:
    row: PublishedMoE
    best: layout_search.Plan
    rank: int
    first: layout_search.Plan
    considered: int
    setting_rank: int


def published_moe_row(row: PublishedMoE) -> MoEResult:
    """The rank of the mapping's fastest setting (its tp, pp, ep, etp and v; any split of its data-parallel ranks
    into replicas and FSDP shards: Megatron's distributed optimizer shards only the optimizer, which this
    toolkit does not offer) among every plan that fits."""
    hardware = gpu_presets.HARDWARE[row.gpu]
    config = load_config(row.config, [*row.overrides, f"train.global_batch_size={row.batch}"])
    memory = hardware.memory_gib * planner.GIB
    fixed = dict(tp=row.tp, pp=row.pp, ep=row.ep, etp=row.etp)
    mine = [p for p in layout_search.search(config, row.gpus, memory, hardware.gpus_per_node, hardware,
                                            fixed=fixed).plans
            if p.config.parallel.pp_virtual_stages == row.v]
    if not mine:
        raise ValueError(f"the published mapping of {row.name} does not fit {hardware.memory_gib} GiB here")
    faster = layout_search.search(config, row.gpus, memory, hardware.gpus_per_node, hardware, faster_than=mine[0].step)
    ahead = layouts_ahead(faster.plans, mine[0].step)
    return MoEResult(row, mine[0], 1 + len(ahead), ahead[0] if ahead else mine[0], faster.considered,
                     1 + sum(p.step < mine[0].step for p in faster.plans))


def format_moe_rows(results: list[MoEResult]) -> str:
    lines = ["| model | GPUs | published tp, pp, ep, etp, v | rank (settings) | fastest published setting | "
             "planner's first |",
             "|---|---|---|---|---|---|"]
    for r in results:
        row = r.row
        lines.append(f"| {row.name} | {row.gpus} × {row.gpu} | {row.tp}, {row.pp}, {row.ep}, {row.etp}, {row.v} | "
                     f"{r.rank} ({r.setting_rank} of {r.considered:,}) | {r.best.describe()} | {r.first.describe()} |")
    return "\n".join(lines)


def format_rows(results: list[RowResult]) -> str:
    lines = ["| params (B) | GPUs | published tp, pp | rank (settings) | without FSDP | among its d's splits | "
             "fastest published setting | est. TFLOP/s (full recompute) | published | error | planner's first |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        row = r.row
        estimate = paper_flops(row) / (r.paper_setting.step * row.gpus) / 1e12
        lines.append(f"| {row.name} | {row.gpus} | {row.tp}, {row.pp} | {r.rank} ({r.setting_rank} of "
                     f"{r.considered:,}) | {r.rank_without_fsdp} | {r.rank_same_dp} | {r.best.describe()} | "
                     f"{estimate:.0f} | {row.tflops:.0f} | {(estimate - row.tflops) / row.tflops:+.0%} | "
                     f"{r.first.describe()} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-published-layouts", __doc__)
    parser.add_argument("--rows", default=",".join(r.name for r in TABLE1),
                        help="which Table 1 rows, by parameters in billions")
    parser.add_argument("--moe", action="store_true", help="also rank the published MoE mappings (MOE)")
    args = parser.parse_args(argv)
    return run_command(lambda: _compare(args))


def _compare(args) -> None:
    """``main``'s work: the chosen rows of each table, planned and printed beside the published figures."""
    names = args.rows.split(",")
    unknown = [n for n in names if n not in {r.name for r in TABLE1}]
    if unknown:
        raise ConfigError(f"--rows {','.join(unknown)}: not a row; valid: {','.join(r.name for r in TABLE1)}")
    print(format_rows([published_row(r) for r in TABLE1 if r.name in names]))
    print()
    print(format_zero3_rows([(r, zero3_plan(r)) for r in TABLE2]))
    if args.moe:
        print()
        print(format_moe_rows([published_moe_row(r) for r in MOE]))


if __name__ == "__main__":
    sys.exit(main())
