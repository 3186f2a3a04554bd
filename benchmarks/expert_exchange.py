"""Expert parallelism's token exchanges side by side: one row per kept assignment, one per (token, rank) pair, or in
two hops across nodes, one per (token, node).

What is measured. gloo ranks on the CPU (one thread each), each with 2,048 tokens through the standard MoE layer
(d_model 512, 8 SwiGLU experts of hidden 1024, dropless, fp32), forward and backward. The same layer, with the same
weights and tokens, runs two exchanges interleaved step for step, for:

- ``top-1``: k = 1 (one destination per token: pairs can only add their codes and weights; not with two hops,
  which, like pairs, the layer runs only for k > 1)
- ``top-2``: plain top-2 of 8 experts
- ``top-2, topk_group=1``: 2 groups of 4 experts, one group per token
- ``top-4, topk_group=1``: the same with k = 4

By default 2 ranks (ep=2: a group per rank) compare ``ExpertParallelExperts.row_exchange`` (``parallel/expert.py``)
with ``pair_exchange`` (``parallel/expert_dispatch.py``). With ``--ranks-per-node N``, 2·N ranks (ep=2·N) stand for
2 nodes of N (``parallel.ranks_per_node``; a group per node, as DeepSeek-V3's node-limited routing has it) and
compare the one-hop pair exchange with the two-hop one (``parallel/node_dispatch.py``); ``across`` is what rank 0's
all-to-alls send to the other node's ranks (``CollectiveCounter.all_to_all_bytes_across_nodes``): the bytes a network
would carry.

``MiB`` is what rank 0 puts on its links in the step's all-to-alls, as ``analysis.collective_count`` counts them
(forward and backward); ``ms`` the median step over ``--repeats`` (rank 0's); ``ratio`` the second exchange over the
first: bytes (across nodes, with ``--ranks-per-node``) and time. gloo over loopback on a shared CPU stands in for
the links here: the byte ratio is the lever on a real network, the time ratio says whether the extra index work
(and, for two hops, the second exchange) costs more than it saves where moving bytes is cheap. NCCL is untested. A
measurement, never a pass/fail test.

    python benchmarks/expert_exchange.py [--repeats N] [--tokens T] [--ranks-per-node N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from analysis.collective_count import CollectiveCounter  # noqa: E402
from config.model import MoEConfig  # noqa: E402
from moe.init import initialize  # noqa: E402
from moe.layer import MoELayer  # noqa: E402
from parallel.expert import ExpertParallelExperts  # noqa: E402
from parallel.groups import ParallelGroups  # noqa: E402
from parallel.layout import Layout  # noqa: E402
from parallel.runtime import exit_process, free_port, init_runtime, shutdown_runtime  # noqa: E402

D, HIDDEN = 512, 1024
SETTINGS = {
    "top-1": dict(top_k=1),
    "top-2": dict(top_k=2),
    "top-2, topk_group=1": dict(top_k=2, score_func="sigmoid", n_group=2, topk_group=1),
    "top-4, topk_group=1": dict(top_k=4, score_func="sigmoid", n_group=2, topk_group=1),
}


def _step(layer: MoELayer, tokens: torch.Tensor) -> float:
    x = tokens.clone().requires_grad_()
    started = time.perf_counter()
    layer(x).square().mean().backward()
    return time.perf_counter() - started


def _process(rank: int, world_size: int, port: int, repeats: int, num_tokens: int, ranks_per_node: int | None) -> None:
    """One of the ranks, joined as ``torchrun`` would join it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_runtime()
    try:
        _measure(rank, world_size, repeats, num_tokens, ranks_per_node)
    finally:
        shutdown_runtime()
    exit_process(0)


def _use(experts: ExpertParallelExperts, exchange: str, node_groups) -> None:
    """Point the layer at one exchange: ``row``, ``pair`` (one hop) or ``node`` (two hops across nodes)."""
    experts.node_groups = node_groups if exchange == "node" else None
    experts.forward = experts.row_exchange if exchange == "row" else experts.pair_exchange


def _measure(rank: int, world_size: int, repeats: int, num_tokens: int, ranks_per_node: int | None) -> None:
    groups = ParallelGroups.build(Layout(world_size, dp_shard=world_size, ep=world_size), "cpu")
    node_groups = groups.expert_node_groups(ranks_per_node) if ranks_per_node else None
    first, second = ("pair", "node") if ranks_per_node else ("row", "pair")
    tokens = torch.randn(1, num_tokens, D, generator=torch.Generator().manual_seed(rank))
    if rank == 0:
        across = f" {'across':>8}" if ranks_per_node else ""
        print(f"{'routing':<22} {'exchange':<8} {'MiB':>8}{across} {'ms':>8}   {second} / {first}: bytes, time")
    for name, options in SETTINGS.items():
        if ranks_per_node and options["top_k"] == 1:  # no pairs at k = 1 (``exchanges_pairs``): nothing to compare
            continue
        torch.manual_seed(0)
        layer = MoELayer(D, MoEConfig(num_experts=8, expert_hidden=HIDDEN, capacity_factor=None, **options))
        initialize(layer, 0, 0.02, 0.02)
        layer.experts = experts = ExpertParallelExperts(layer.experts, groups.mesh("ep"))
        results = {}
        for exchange in (first, second):
            _use(experts, exchange, node_groups)
            counter = CollectiveCounter()
            with counter:
                _step(layer, tokens)
            sent = sum(b for _, b in counter.totals().values())
            results[exchange] = [sent, counter.all_to_all_bytes_across_nodes(ranks_per_node or 1), []]
        for repeat in range(repeats):  # interleaved, alternating which goes first
            for exchange in (first, second) if repeat % 2 == 0 else (second, first):
                _use(experts, exchange, node_groups)
                results[exchange][2].append(_step(layer, tokens))
        if rank == 0:
            _print(name, results, first, bool(ranks_per_node))


def _print(name: str, results: dict, first: str, across_nodes: bool) -> None:
    base = results[first][1 if across_nodes else 0], statistics.median(results[first][2])
    for exchange, (sent, across, times) in results.items():
        ms = statistics.median(times)
        ratio = (f"   {(across if across_nodes else sent) / base[0]:.2f}, {ms / base[1]:.2f}"
                 if exchange != first else "")
        across_column = f" {across / 2**20:>8.2f}" if across_nodes else ""
        print(f"{name:<22} {exchange:<8} {sent / 2**20:>8.2f}{across_column} {ms * 1e3:>8.1f}{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    parser.add_argument("--ranks-per-node", type=int, default=None, metavar="N",
                        help="compare one hop with two on 2 simulated nodes of N ranks (2·N processes)")
    args = parser.parse_args()
    world_size = 2 * args.ranks_per_node if args.ranks_per_node else 2
    mp.spawn(_process, args=(world_size, free_port(), args.repeats, args.tokens, args.ranks_per_node),
             nprocs=world_size)


if __name__ == "__main__":
    main()
