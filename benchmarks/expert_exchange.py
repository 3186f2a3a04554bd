"""Expert parallelism's two token exchanges side by side: one row per kept assignment, or one per (token, rank) pair.

What is measured. Two gloo ranks on the CPU (ep=2, one thread each), each with 2,048 tokens through the standard MoE
layer (d_model 512, 8 SwiGLU experts of hidden 1024, dropless, fp32), forward and backward. The same layer, with
the same weights and tokens, runs ``ExpertParallelExperts.row_exchange`` (``parallel/expert.py``) and
``pair_exchange`` (``parallel/expert_dispatch.py``), interleaved step for step, for:

- ``top-1``: k = 1 (one destination per token: pairs can only add their codes and weights)
- ``top-2``: plain top-2 of 8 experts (a token's two experts share a rank about 3 times in 7)
- ``top-2, topk_group=1``: 2 groups of 4 experts, a group per rank, one group per token (one rank per token)
- ``top-4, topk_group=1``: the same with k = 4

``bytes`` is what rank 0 puts on the link in the step's all-to-alls, as ``analysis.collective_count`` counts them
(forward and backward); ``ms`` the median step over ``--repeats`` (rank 0's); ``ratio`` pair over row, bytes and
time. gloo over loopback on a shared CPU stands in for a network here: the byte ratio is the lever on a real
link, the time ratio says whether the extra index work and the codes and weights cost more than they save where
moving bytes is cheap. A measurement, never a pass/fail test.

    python benchmarks/expert_exchange.py [--repeats N] [--tokens T]
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
from parallel.groups import Layout, ParallelGroups  # noqa: E402
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


def _process(rank: int, port: int, repeats: int, num_tokens: int) -> None:
    """One of the two ranks, joined as ``torchrun`` would join it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    init_runtime()
    try:
        _measure(rank, repeats, num_tokens)
    finally:
        shutdown_runtime()
    exit_process(0)


def _measure(rank: int, repeats: int, num_tokens: int) -> None:
    groups = ParallelGroups.build(Layout(2, dp_shard=2, ep=2), "cpu")
    tokens = torch.randn(1, num_tokens, D, generator=torch.Generator().manual_seed(rank))
    if rank == 0:
        print(f"{'routing':<22} {'exchange':<6} {'MiB':>8} {'ms':>8}   pair / row: bytes, time")
    for name, options in SETTINGS.items():
        torch.manual_seed(0)
        layer = MoELayer(D, MoEConfig(num_experts=8, expert_hidden=HIDDEN, capacity_factor=None, **options))
        initialize(layer, 0, 0.02, 0.02)
        layer.experts = experts = ExpertParallelExperts(layer.experts, groups.mesh("ep"))
        results = {}
        for exchange in ("row", "pair"):
            experts.forward = getattr(experts, f"{exchange}_exchange")
            counter = CollectiveCounter()
            with counter:
                _step(layer, tokens)
            results[exchange] = [sum(b for _, b in counter.totals().values()), []]
        for repeat in range(repeats):  # interleaved, alternating which goes first
            for exchange in ("row", "pair") if repeat % 2 == 0 else ("pair", "row"):
                experts.forward = getattr(experts, f"{exchange}_exchange")
                results[exchange][1].append(_step(layer, tokens))
        if rank == 0:
            row_bytes, row_time = results["row"][0], statistics.median(results["row"][1])
            for exchange, (sent, times) in results.items():
                ms = statistics.median(times) * 1e3
                ratio = (f"   {sent / row_bytes:.2f}, {statistics.median(times) / row_time:.2f}"
                         if exchange == "pair" else "")
                print(f"{name:<22} {exchange:<6} {sent / 2**20:>8.2f} {ms:>8.1f}{ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank")
    args = parser.parse_args()
    mp.spawn(_process, args=(free_port(), args.repeats, args.tokens), nprocs=2)


if __name__ == "__main__":
    main()
