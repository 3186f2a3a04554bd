"""Sparse attention's kernel cost as the sequence grows at a fixed top-k: the masked kernel against the gathered one.

What is measured. One forward and backward (fp32, CPU) of sparse attention's kernel on one sequence of S positions
where each query keeps k keys (``moe.attention.kernel``): ``sparse``, one SDPA over every head's up-projected keys
and values under the [S, S] mask of the selected keys (every score computed: O(S²)), against ``gathered``
(``moe.attention.gathered``), each query's k latents gathered and scored in latent attention's absorbed form
(O(S·k)), with the absorption's two per-head matmuls included. Tiny heads (16 heads, n 32 + r 16 channels of q·k,
v 32, latent c 64; DeepSeek-V3.2 has 128 heads, n 128 + r 64, v 128, c 512). The selection is random (each query's
k keys among those it sees), the same for both. Then, at S = ``--by-k-len``, the gathered kernel for several k: its
cost grows with k. Medians of ``--repeats`` runs after one warm-up run, in one process on one host; ratios taken in
the same run. The lightning indexer that makes the selection is not timed:
it scores every pair (hi·di per pair, O(S²) as published) and is the same for both kernels.

    python -m benchmarks.sparse_attention [--quick] [--topk 256] [--max-len 16384] [--dense-max-len 8192]
                                          [--by-k-len 4096] [--repeats 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.moe_layer_library import host
from moe.attention.gathered import gathered_attention
from moe.attention.kernel import GATHER_RATIO, attend

HEADS, NOPE, ROPE, VALUE, LATENT = 16, 32, 16, 32, 64


def selection(seq: int, topk: int) -> torch.Tensor:
    """Each query's ``topk`` keys, random among the positions it sees (repeats where it sees fewer): [1, S, k]."""
    seen = torch.arange(1, seq + 1, dtype=torch.float64)[:, None]
    return (torch.rand(seq, topk, dtype=torch.float64) * seen).long()[None]


def masked_step(seq: int, indices: torch.Tensor) -> float:
    """Seconds of one forward and backward of the ``sparse`` kernel: SDPA under the selection's [1, 1, S, S] mask
    over every head's keys and values."""
    q = torch.randn(1, HEADS, seq, NOPE + ROPE, requires_grad=True)
    k = torch.randn(1, HEADS, seq, NOPE + ROPE, requires_grad=True)
    v = torch.randn(1, HEADS, seq, VALUE, requires_grad=True)
    begin = time.perf_counter()
    mask = torch.zeros(1, seq, seq, dtype=torch.bool).scatter_(-1, indices, True).unsqueeze(1)
    attend(q, k, v, (NOPE + ROPE) ** -0.5, selected=mask).sum().backward()
    return time.perf_counter() - begin


def gathered_step(seq: int, indices: torch.Tensor) -> float:
    """Seconds of one forward and backward of the ``gathered`` kernel with the absorption's matmuls: the queries'
    content channels times the key up-projection, the output times the value up-projection."""
    q_nope = torch.randn(1, HEADS, seq, NOPE, requires_grad=True)
    q_rope = torch.randn(1, HEADS, seq, ROPE, requires_grad=True)
    latents = torch.randn(1, seq, LATENT + ROPE, requires_grad=True)
    up = torch.randn(HEADS, NOPE + VALUE, LATENT, requires_grad=True)
    valid = torch.ones(indices.shape, dtype=torch.bool)
    begin = time.perf_counter()
    absorbed = torch.cat((torch.einsum("bhsn,hnc->bhsc", q_nope, up[:, :NOPE]), q_rope), dim=-1)
    out, _ = gathered_attention(absorbed, latents, LATENT, (NOPE + ROPE) ** -0.5, indices, valid)
    torch.einsum("bhsc,hvc->bhsv", out, up[:, NOPE:]).sum().backward()
    return time.perf_counter() - begin


def median_ms(step, seq: int, topk: int, repeats: int) -> float:
    indices = selection(seq, topk)
    return statistics.median(step(seq, indices) for _ in range(repeats)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topk", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=16384)
    parser.add_argument("--dense-max-len", type=int, default=8192,
                        help="the longest S the masked kernel runs at (its [S, S] mask and scores grow as S²)")
    parser.add_argument("--by-k-len", type=int, default=4096, help="the S of the table by k")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="S up to 2,048, k 64, one repeat")
    args = parser.parse_args()
    if args.quick:
        args.topk, args.max_len, args.dense_max_len, args.by_k_len, args.repeats = 64, 2048, 2048, 1024, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"{host()}; torch {torch.__version__}, {args.threads} threads; {HEADS} heads, k = {args.topk}; "
          f"forward + backward, fp32, medians of {args.repeats}; choose_kernel gathers from S >= "
          f"{GATHER_RATIO}·k = {GATHER_RATIO * args.topk}")
    for step in (masked_step, gathered_step):  # warm-up: the first calls pay for allocation and dispatch
        median_ms(step, 2 * args.topk, args.topk, 1)
    print(f"{'S':>6} {'masked ms':>10} {'gathered ms':>12} {'masked/gathered':>16}")
    seq = 2 * args.topk
    while seq <= args.max_len:
        gathered = median_ms(gathered_step, seq, args.topk, args.repeats)
        masked = median_ms(masked_step, seq, args.topk, args.repeats) if seq <= args.dense_max_len else None
        print(f"{seq:>6} {'-' if masked is None else f'{masked:.1f}':>10} {gathered:>12.1f} "
              f"{'-' if masked is None else f'{masked / gathered:.2f}':>16}")
        seq *= 2
    print(f"\nS = {args.by_k_len}, the gathered kernel by k")
    print(f"{'k':>6} {'gathered ms':>12}")
    for topk in (args.topk // 2, args.topk, 2 * args.topk, 4 * args.topk):
        print(f"{topk:>6} {median_ms(gathered_step, args.by_k_len, topk, args.repeats):>12.1f}")


if __name__ == "__main__":
    main()
