"""Sliding-window attention's cost against SDPA's full causal attention (GPT-OSS's windowed layers).

What is measured. The kernel core's attention (``moe.attention.kernel.attend``) of a layer with a 128-position
window, with and without the attention sinks, forward and backward in fp32 on CPU, at sequence 4,096 (8 heads of
64, one sequence, 2 threads by default), against SDPA's full causal attention (``is_causal=True``) on the same
tensors: the cost of a full layer. Also timed: the same window as one masked SDPA over the whole causal score
matrix (what the windowed layer would cost without the blocked path), to show what the blocking saves; and a full
layer with sinks (GPT-OSS's other kind: one SDPA under the causal mask, the sink folded in).

Why. A windowed layer sees 128 keys per query; it should cost a fraction of the full layer's S/2, not the same.
The blocked path computes 2W scores per query (the W before its block and its block), so against full causal
attention the expected ratio is about 2W / (S/2) = 1/8 at W=128, S=4,096, plus the copies of the key blocks.

Noise. Each repeat runs every variant once, in rotating order; the times are medians, the ratios are of the
medians. A measurement, never a pass/fail test.

    python -m benchmarks.window_attention [--seq 4096 --window 128 --heads 8 --head-dim 64 --repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from moe.attention.kernel import attend


def timed_step(fn, q, k, v) -> float:
    """Seconds of one forward and backward of attention ``fn`` on fresh leaves of ``q``, ``k``, ``v``."""
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    begin = time.perf_counter()
    out = fn(q, k, v)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    scale, sinks = args.head_dim ** -0.5, torch.randn(args.heads)
    pos = torch.arange(args.seq)
    window_mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - args.window)
    variants = {
        "full causal SDPA": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "window, one masked SDPA": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=window_mask),
        "window (blocked)": lambda q, k, v: attend(q, k, v, scale, window=args.window),
        "window + sinks (blocked)": lambda q, k, v: attend(q, k, v, scale, window=args.window, sinks=sinks),
        "full causal + sinks (masked)": lambda q, k, v: attend(q, k, v, scale, sinks=sinks),
    }
    q, k, v = (torch.randn(1, args.heads, args.seq, args.head_dim) for _ in range(3))
    for fn in variants.values():  # warm up
        timed_step(fn, q, k, v)
    times = {name: [] for name in variants}
    names = list(variants)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            times[name].append(timed_step(variants[name], q, k, v))
    full = statistics.median(times["full causal SDPA"])
    print(f"seq {args.seq}, window {args.window}, {args.heads} heads of {args.head_dim}, fp32 forward + backward, "
          f"{args.threads} threads, median of {args.repeats}")
    for name in names:
        median = statistics.median(times[name])
        print(f"  {name:28s} {median * 1e3:8.1f} ms   {median / full:5.2f} x full causal")


if __name__ == "__main__":
    main()
