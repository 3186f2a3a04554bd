"""The chunked gated delta rule (Gated DeltaNet's recurrence, ``moe/attention/delta_rule.py``) against its GEMM
floor, and the generation cache of a linear layer against a full-attention layer's as the context grows.

What is measured. (1) The rule by chunks, forward and forward + backward (the training path,
``gated_delta_rule``: backward computes the chunks again), fp32 on CPU, at Qwen3-Next's head widths (dk = dv =
128, chunks of 64) by default. Its floor: the same matmuls as bare batched calls on tensors of the same shapes
(every chunk at once, no loop over chunks, no masks, exps, padding, nor the triangular inverse's small matmuls):
what the rule's main FLOPs cost at this machine's GEMM speed. The ratio is the rule's overhead over its
arithmetic. (2) The bytes one layer's generation cache holds after prompts of growing length
(``moe.kv_cache.LayerCache``, filled by the real layers at small widths): a full-attention layer's keys and
values grow with the context, a linear layer's state and convolution inputs do not. (3) With ``--cp N``, what one
of N context-parallel ranks computes of the rule (``moe/attention/delta_rule_shards.py``: the state maps of its
two chunks, then the rule over each from the state entering it; the gather between them left out, a network's),
against 1/N of the one-process rule over the whole sequence: the price of handing the state on in parallel.

Noise. Medians of ``--repeats``; 2 threads by default on a shared machine: read the ratios within one run. A
measurement, never a pass/fail test.

    python -m benchmarks.delta_rule [--quick] [--seq 4096 --heads 8 --dim 128 --chunk 64 --repeats 3] [--cp 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from config.model import ModelConfig
from moe.attention import build_attention
from moe.attention.delta_rule import gated_delta_rule, state_map
from moe.kv_cache import LayerCache
from moe.rope import rope_tables


def rule_inputs(heads: int, seq: int, dim: int) -> list[torch.Tensor]:
    q = torch.nn.functional.normalize(torch.randn(1, heads, seq, dim), dim=-1) * dim ** -0.5
    k = torch.nn.functional.normalize(torch.randn(1, heads, seq, dim), dim=-1)
    return [q, k, torch.randn(1, heads, seq, dim), -torch.rand(1, heads, seq) * 0.1, torch.rand(1, heads, seq)]


def floor(heads: int, seq: int, dim: int, chunk: int):
    """A forward's matmuls at the rule's shapes, each one batched call over every chunk (the triangular inverse's
    own log2(C) levels of small matmuls left out: they count as overhead)."""
    n = seq // chunk
    c_d = torch.randn(heads * n, chunk, dim)
    state = torch.randn(heads * n, dim, dim)
    square = torch.randn(heads * n, chunk, chunk)

    def run():
        c_d @ c_d.mT, c_d @ c_d.mT  # k·k and q·k per chunk
        square @ c_d, square @ c_d  # u and w: the inverse applied
        c_d @ state, c_d @ state, c_d.mT @ c_d  # w·S, q·S, k^T·delta
        square @ c_d  # scores · delta
    return run


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def cp_rank_share(inputs: list[torch.Tensor], cp: int, chunk: int, repeats: int) -> tuple[float, float]:
    """Forward + backward seconds of one cp rank's part of the rule (rank 0's chunks, the first and the last: the
    others' cost the same) and of the whole sequence's rule in one process."""
    seq = inputs[0].shape[2]
    piece = seq // (2 * cp)
    own = [torch.cat((t[:, :, :piece], t[:, :, seq - piece:]), dim=2) for t in inputs]
    dk, dv = inputs[1].shape[-1], inputs[2].shape[-1]
    entering = torch.randn(1, inputs[2].shape[1], dk, dv) * 0.1  # the back chunk's start (composed maps in a run)

    def rank():
        leaves = [t.detach().requires_grad_() for t in own]
        start = entering.clone().requires_grad_()  # its gradient goes back to the earlier ranks in a run
        halves = list(zip(*(t.chunk(2, dim=2) for t in leaves), strict=True))
        maps = torch.stack([state_map(*part[1:], chunk) for part in halves])
        outs = [gated_delta_rule(*halves[0], chunk)[0], gated_delta_rule(*halves[1], chunk, start)[0]]
        (torch.cat(outs, dim=2).sum() + maps.sum()).backward()

    def whole():
        leaves = [t.detach().requires_grad_() for t in inputs]
        gated_delta_rule(*leaves, chunk)[0].sum().backward()
    return median_seconds(rank, repeats), median_seconds(whole, repeats)


def cache_bytes(cache: LayerCache) -> int:
    return sum(t.numel() * t.element_size() for t in (cache.keys, cache.values, cache.state, cache.conv_inputs)
               if t is not None)


def cache_growth(lengths: list[int]) -> None:
    model = ModelConfig(d_model=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=64, seq_len=max(lengths),
                        layer_types=["linear_attention", "full_attention"], linear_key_heads=2, linear_value_heads=4,
                        linear_key_head_dim=64, linear_value_head_dim=64)
    cos, sin = rope_tables(model)
    layers = {name: build_attention(model, model.layer(i)).eval() for i, name in enumerate(("linear", "full"))}
    print("generation cache of one layer after a prompt (d_model 256; linear: 2 key / 4 value heads of 64; "
          "full: 4 query / 2 key-value heads of 64), fp32 bytes")
    for length in lengths:
        row = []
        for name, layer in layers.items():
            cache = LayerCache()
            with torch.no_grad():
                layer(torch.randn(1, length, model.d_model), cos, sin, cache)
            row.append(f"{name} {cache_bytes(cache):>10,}")
        print(f"  {length:6d} positions: " + "   ".join(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cp", type=int, default=0, help="also time one of this many context-parallel ranks' part")
    parser.add_argument("--quick", action="store_true", help="small shapes, one repeat: seconds, for a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.seq, args.heads, args.dim, args.repeats = 512, 2, 64, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    inputs = rule_inputs(args.heads, args.seq, args.dim)

    def forward():
        with torch.no_grad():
            gated_delta_rule(*inputs, args.chunk)

    def training():
        leaves = [t.detach().requires_grad_() for t in inputs]
        out, _ = gated_delta_rule(*leaves, args.chunk)
        out.sum().backward()

    rule, train, bare = (median_seconds(fn, args.repeats) for fn in (forward, training,
                                                                     floor(args.heads, args.seq, args.dim, args.chunk)))
    print(f"gated delta rule, {args.heads} heads of {args.dim}, {args.seq} positions, chunks of {args.chunk}, fp32, "
          f"{args.threads} threads, median of {args.repeats}")
    print(f"  GEMM floor (the forward's matmuls, batched)  {bare * 1e3:9.1f} ms")
    print(f"  forward by chunks                            {rule * 1e3:9.1f} ms   {rule / bare:5.2f} x floor")
    print(f"  forward + backward (recomputed)              {train * 1e3:9.1f} ms   {train / bare:5.2f} x floor")
    if args.cp > 1:
        rank, whole = cp_rank_share(inputs, args.cp, args.chunk, args.repeats)
        share = whole / args.cp
        print(f"  one of {args.cp} cp ranks, forward + backward  {rank * 1e3:9.1f} ms   {rank / share:5.2f} x "
              f"the one-process rule / {args.cp} ({whole * 1e3:.1f} ms whole)")
    cache_growth([256, 1024] if args.quick else [256, 1024, 4096])


if __name__ == "__main__":
    main()
