"""Which layout to train a config on: every valid layout of N GPUs, the ones that fit, fastest first.

    python -m analysis.planner --config mixtral-8x7b --world-size 64 [--gpu h100] [--gpus-per-node 8]
                               [--device-memory GiB] [--nvlink-gbps N] [--network-gbps N] [--peak-tflops N]
                               [--set parallel.tp=2 ...] [--top 10] [--efficiency F] [--headroom 0.1]
                               [--imbalance 1.0]

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
and ``analysis.step_time`` its step time on the ``--gpu`` preset of ``analysis.gpu_presets.HARDWARE`` (A100 40/80
GB, H100, H800, H200, B200: datasheet bandwidths, peak, memory and HBM bandwidth, each figure's source named there;
any figure but the HBM's can be overridden): compute, pipeline bubble and exposed communication.

step = compute + bubble + exposed communication. ``search`` (``analysis/layout_search.py``) orders the candidates
by compute + bubble, a bound no step goes below, raises the bound of those still within reach by the least traffic
their layout can have (``layout_search.traffic_floor``), and estimates memory and traffic only for those that can
still enter the first ``--top``. The times are estimates for comparing layouts, not promises. Not modelled:
kernel-launch and element-wise costs, overlap of tp or ep traffic with compute.

Routing imbalance is an assumption, ``--imbalance`` (the busiest ep rank's rows over the mean; default 1, the
forced-balanced routing every published throughput figure assumes; 1.3 is what ``benchmarks/ep_replication.py``
measures at ep=8 under its skewed routing, ``analysis.replica_time.IMBALANCE``): above 1, under ep each plan adds
the wait for the busiest rank (column ``imbal``), with the replica slots ``parallel.ep_replicas`` in {0, 1, 2} that
make it least once their copies are paid (``analysis.replica_time.straggler_wait``; shown as ``R=`` and set in the
plan's command), if their memory fits, else the best R that fits; ``--set parallel.ep_replicas=R`` prices that R
alone (0: without replicas). The default stays balanced because what R slots leave of the excess is
taken from one benchmark row, not worked out per model (``analysis/replica_time.py``).
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable

from analysis import memory
from analysis.gpu_presets import HARDWARE, Hardware, add_hardware_arguments, hardware_from_args
from analysis.layout_search import DEGREE_KEYS, Plan, Search, evaluate, pipeline_split, search
from analysis.replica_time import IMBALANCE, REPLICA_CHOICES
from analysis.step_time import EFFICIENCY, node_shape
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

GIB = 2**30


def plan_overrides(plan: Plan, base: RunConfig) -> list[str]:
    """The ``--set`` overrides that make ``train.py`` run ``plan`` from the config ``base`` it was planned from:
    each key the plan set (degrees, recompute, sequence parallelism, gradient reduction, pipeline schedule,
    micro-batch size) whose value differs from ``base``'s. ``plan.config`` is ``base`` with exactly those keys
    changed (``with_layout``), so these overrides rebuild it."""
    keys = [f"parallel.{key}" for key in (*DEGREE_KEYS, "activation_checkpointing", "sequence_parallel",
                                           "grad_reduce", "pp_schedule", "pp_virtual_stages", "ep_replicas")]
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


def plan(config: RunConfig, world_size: int, device_memory: float, gpus_per_node: int = 8,
         hardware: Hardware = HARDWARE["h100"], efficiency: float = EFFICIENCY,
         top: int | None = None, imbalance: float = 1.0) -> tuple[list[Plan], int]:
    """The plans that fit ``device_memory`` bytes, fastest first (the ``top`` first only, when given), and how
    many candidates were considered (``search``)."""
    found = search(config, world_size, device_memory, gpus_per_node, hardware, efficiency, top, imbalance=imbalance)
    return found.plans, found.considered


def format_plans(config: RunConfig, found: Search, world_size: int, device_memory: float,
                 hardware: Hardware, efficiency: float, top: int, usable: float | None = None,
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
                 f"{'cp':>8} {'ep':>8} {'imbal':>8} {'pp':>7} {'fsdp':>8} " + (f"{'muon':>8} " if muon else "")
                 + f"{'tok/s/GPU':>10}")
    for rank, p in enumerate(plans[:top], 1):
        ms = {k: v * 1e3 for k, v in p.exposed.items()}
        lines.append(f"{rank:>3} {p.describe():<52} {p.memory / GIB:>6.1f} {p.step * 1e3:>9.2f} "
                     f"{p.compute * 1e3:>9.2f} {p.bubble * 1e3:>8.2f} {ms['tp']:>8.2f} {ms['cp']:>8.2f} "
                     f"{ms['ep']:>8.2f} {ms.get('imbalance', 0.0):>8.2f} {ms['pp']:>7.2f} {ms['fsdp']:>8.2f} "
                     + (f"{ms['muon']:>8.2f} " if muon else "") + f"{tokens / p.step / world_size:>10,.0f}")
    piped = [(rank, p) for rank, p in enumerate(plans[:top], 1) if p.layout.pp > 1]
    if piped:
        lines.append("pipeline splits, layers per stage (balanced by training FLOPs per token, the last stage's "
                     "head included; equal steps go to the more even split):")
        lines += [f"{rank:>3} {len(pipeline_split(p))} stages: {' '.join(map(str, pipeline_split(p)))}"
                  for rank, p in piped]
    if command is not None:
        lines.append("to run a plan (add --dry-run --world-size N to train.py's part to check it first):")
        lines += [f"{rank:>3} {command(p)}" for rank, p in enumerate(plans[:top], 1)]
        lines += command_notes(config, any("HOST:" in command(p) for p in plans[:top]))
    return "\n".join(lines)


def command_notes(config: RunConfig, multinode: bool) -> list[str]:
    """What the printed commands leave to the person: the first node's address, and the data and weights."""
    notes = []
    if multinode:
        notes.append("HOST: the first node's address (hostname or IP); run the same command on every node "
                     "(scripts/launch/slurm.sbatch fills it in on Slurm)")
    source = config.data.source if not config.data.sources else "the config's mixture"
    notes.append(f"data: these train on data.source={source}, the config's (a placeholder unless you have it) from "
                 "random weights; add --set data.source=PATH for your own text, .jsonl or .parquet (docs/data.md), "
                 "and --init-from hf:DIR to fine-tune a published model's weights instead (docs/huggingface.md)")
    return notes


def fixed_degrees(overrides: list[str]) -> dict[str, int]:
    """The parallel degrees a ``--set`` fixes (``parallel.tp=2``): the planner searches only the others."""
    fixed = {}
    for item in overrides:
        key, _, value = item.partition("=")
        name = key.removeprefix("parallel.")
        if key.startswith("parallel.") and name in DEGREE_KEYS:
            fixed[name] = int(value)
    return fixed


def fixed_replicas(overrides: list[str]) -> tuple[int, ...]:
    """The replica slots the planner may choose: the one a ``--set parallel.ep_replicas=R`` fixes, else 0, 1, 2."""
    fixed = [int(item.partition("=")[2]) for item in overrides if item.partition("=")[0] == "parallel.ep_replicas"]
    return (fixed[-1],) if fixed else REPLICA_CHOICES


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-plan", __doc__)
    add_config_arguments(parser, set_help="config overrides; a parallel degree set here (parallel.tp=2) is fixed, "
                                          "the rest searched")
    add_world_size(parser, required=True, help="GPUs to plan for")
    parser.add_argument("--device-memory", type=float, default=None,
                        help="GiB per GPU (default: the --gpu preset's)")
    add_hardware_arguments(parser)
    parser.add_argument("--efficiency", type=float, default=EFFICIENCY,
                        help=f"fraction of the bf16 peak the matmuls reach (default {EFFICIENCY:.3f}, calibrated: "
                             "step_time.calibrated_efficiency)")
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--imbalance", type=float, default=1.0,
                        help=f"routing assumed under ep: the busiest ep rank's rows over the mean (default 1, forced "
                             f"balance; {IMBALANCE}: benchmarks/ep_replication.py's skewed routing at ep=8); above 1 "
                             "priced with the replica slots parallel.ep_replicas in {0, 1, 2} that pay best, or "
                             "with those a --set parallel.ep_replicas=R fixes")
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
        if not args.imbalance >= 1:  # NaN fails this too
            raise ConfigError(f"--imbalance must be at least 1 (the busiest rank's rows over the mean), "
                              f"got {args.imbalance}")
        config = load_config_from(args)
        hardware = hardware_from_args(args, args.device_memory)
        usable = memory.usable_bytes(hardware.memory_gib * GIB, args.headroom)
        found = search(config, world_size, usable, hardware.gpus_per_node, hardware,
                       args.efficiency, args.top, fixed=fixed_degrees(args.overrides), imbalance=args.imbalance,
                       replicas=fixed_replicas(args.overrides))
        command = lambda p: launch_command(p, config, args.config, args.overrides, hardware.gpus_per_node)  # noqa: E731
        print(format_plans(config, found, world_size, hardware.memory_gib * GIB, hardware, args.efficiency,
                           args.top, usable, command))

    return run_command(plan_layouts)


if __name__ == "__main__":
    sys.exit(main())
