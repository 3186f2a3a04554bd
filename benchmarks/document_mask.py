"""Document masking's cost against plain causal attention (``data.document_mask``, ``moe/documents.py``).

What is measured. The attention of one layer, forward and backward in fp32 on CPU at sequence 4,096 (8 heads of 64,
one sequence, 2 threads by default), on a window packed with documents of ``--doc-length`` tokens each (the last cut
by the window's end; several lengths, one table each):

- causal SDPA (``is_causal=True``): what attention costs without the mask, the reference of every ratio;
- the document mask as the model runs it: one SDPA with the block-diagonal causal boolean mask ``documents_of``
  makes (``Attention.forward`` with ``documents``), and the making of that mask and of the per-token rotary tables
  (``documents_of``, once per forward pass, shared by every layer), timed apart;
- per-document SDPA: each document's own causal SDPA on its slice, one call per document (what a variable-length
  kernel would compute, without its launch being fused): the work the mask could skip.

Why. SDPA computes every score the mask covers, masked or not: a boolean mask costs what full non-causal
attention costs, about twice the causal kernel, which skips the upper triangle. Per-document attention computes
only the diagonal blocks, sum(l_i^2)/2 scores instead of S^2/2, and pays a call per document.

Noise. Each repeat runs every variant once, in rotating order; the times are medians, the ratios are of the
medians. A measurement, never a pass/fail test.

    python -m benchmarks.document_mask [--seq 4096 --doc-length 256 1024 4096 --heads 8 --head-dim 64 --repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.window_attention import timed_step
from config.model import ModelConfig
from moe.documents import documents_of
from moe.rope import rope_tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--doc-length", type=int, nargs="+", default=[256, 1024, 4096], help="tokens per document")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, args.heads, args.seq, args.head_dim) for _ in range(3))
    print(f"seq {args.seq}, {args.heads} heads of {args.head_dim}, fp32 forward + backward, {args.threads} threads, "
          f"median of {args.repeats}")
    for length in args.doc_length:
        lengths = [length] * (args.seq // length) + ([args.seq % length] if args.seq % length else [])
        measure(args, lengths, q, k, v)


def measure(args: argparse.Namespace, lengths: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Time every variant on one window packed with documents of ``lengths``, and print its table."""
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]  # [1, S]
    cos, sin = rope_tables(ModelConfig(d_model=args.heads * args.head_dim, n_heads=args.heads, seq_len=args.seq))
    mask = documents_of(ids, cos, sin).mask
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()

    def per_document(q, k, v):
        return torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True)
                          for a, b in zip(bounds[:-1], bounds[1:], strict=True)], dim=2)

    variants = {
        "causal SDPA": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "document mask (one masked SDPA)": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
        "per-document causal SDPA": per_document,
    }
    for fn in variants.values():  # warm up
        timed_step(fn, q, k, v)
    times = {name: [] for name in variants}
    making = []
    names = list(variants)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            times[name].append(timed_step(variants[name], q, k, v))
        begin = time.perf_counter()
        documents_of(ids, cos, sin)
        making.append(time.perf_counter() - begin)
    causal = statistics.median(times["causal SDPA"])
    share = sum(n * n for n in lengths) / args.seq ** 2
    print(f"{len(lengths)} documents of {lengths[0]} tokens (sum l^2 / S^2 = {share:.3f})")
    for name in names:
        median = statistics.median(times[name])
        print(f"  {name:34s} {median * 1e3:8.1f} ms   {median / causal:5.2f} x causal")
    median = statistics.median(making)
    print(f"  {'making the mask and tables (once)':34s} {median * 1e3:8.1f} ms   {median / causal:5.2f} x causal")


if __name__ == "__main__":
    main()
