"""``moe-communication``: the collective traffic of one rank in one optimizer step, as a table.

    python -m analysis.communication --config NAME --world-size N [--rank R] [--set ...] [--gpu h100]
                                     [--gpus-per-node 8] [--nvlink-gbps N] [--network-gbps N]

The traffic is ``analysis.traffic.predict``'s (what each parallel dimension's collectives move, and the byte
convention), each item's time ``analysis.link_time.seconds`` on the ``--gpu`` preset's links
(``analysis.gpu_presets``), and, with expert parallelism, the ranks and nodes a token's dispatch reaches
(``analysis.dispatch_reach``).
"""

from __future__ import annotations

import sys

from analysis.dispatch_reach import describe as describe_reach
from analysis.gpu_presets import add_hardware_arguments, hardware_from_args
from analysis.link_time import format_table
from analysis.traffic import predict
from config.cli import (
    add_config_arguments,
    add_world_size,
    command_parser,
    load_config_from,
    run_command,
    world_size_of,
)
from config.errors import ConfigError
from parallel.hardware import planned_precision
from parallel.resolve import resolve_layout


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
