"""Sparse latent attention's cost against dense latent attention as the sequence grows, at a fixed top-k.

What is measured. One training forward and backward (fp32, CPU) of a sparse latent attention layer
(``moe.attention.sparse_latent``, DeepSeek Sparse Attention: the indexer, its loss, attention over the top-k keys)
and of the same layer dense (``moe.attention.latent``, the same weights without the indexer), on one sequence of
S positions with each query keeping k keys, S from 2k up; beside them, the sparse layer's indexer alone (its keys,
scores and selection, forward only). Ratios are of medians taken in the same run, on the same host.

Why. Past the break-even length a sparse layer should cost O(S·k) for its attention where a dense one costs
O(S²/2); the indexer's scores stay O(S²) with a small constant (hi·di per pair against the main attention's
nh·(n + r + v)). What this shows today: the sparse kernel is one SDPA under each sequence's mask of selected keys
(``moe.attention.kernel``'s ``sparse``), so its attention still costs what a full (non-causal) one does, and the
indexer and its loss come on top; the sparse layer costs more than the dense one at every length, with no
break-even. A kernel that gathers each query's k keys (DeepSeek's MQA form over the latent) is what would change
that, and this benchmark is its baseline.

    python -m benchmarks.sparse_attention [--quick] [--topk 128 --heads 8 --repeats 3 --threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from config.model import ModelConfig
from moe.attention import build_attention
from moe.rope import rope_tables


def layer_config(seq: int, topk: int | None, heads: int) -> ModelConfig:
    """A DeepSeek-V3.2-shaped layer at toy width: latent attention with a query bottleneck, 4 indexer heads."""
    sparse = dict(index_topk=topk, index_n_heads=4, index_head_dim=64) if topk else {}
    return ModelConfig(d_model=512, n_heads=heads, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=64,
                       qk_rope_head_dim=32, v_head_dim=64, seq_len=seq, **sparse)


def timed(fn) -> float:
    begin = time.perf_counter()
    fn()
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topk", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="S = 2k and 4k only, one repeat")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    lengths = [2 * args.topk, 4 * args.topk] if args.quick else [2 * args.topk, 4 * args.topk, 8 * args.topk,
                                                                  16 * args.topk]
    repeats = 1 if args.quick else args.repeats
    print(f"torch {torch.__version__}, {args.threads} threads; k = {args.topk}, {args.heads} heads; "
          f"forward + backward, fp32, medians of {repeats}")
    print(f"{'S':>6} {'dense ms':>9} {'sparse ms':>10} {'indexer ms':>11} {'sparse/dense':>13}")
    for seq in lengths:
        median = measure(seq, args.topk, args.heads, repeats)
        print(f"{seq:>6} {median['dense']:>9.1f} {median['sparse']:>10.1f} {median['indexer']:>11.1f} "
              f"{median['sparse'] / median['dense']:>13.2f}")


def measure(seq: int, topk: int, heads: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of the dense layer's and the sparse layer's training step, and of the indexer alone."""
    sparse_model, dense_model = layer_config(seq, topk, heads), layer_config(seq, None, heads)
    sparse = build_attention(sparse_model, sparse_model.layer(0)).train()
    dense = build_attention(dense_model, dense_model.layer(0)).train()
    dense.load_state_dict({k: v for k, v in sparse.state_dict().items() if not k.startswith("indexer.")})
    cos, sin = (table[:seq] for table in rope_tables(sparse_model))
    x = torch.randn(1, seq, sparse_model.d_model)

    def step(layer) -> None:
        layer(x.clone().requires_grad_(), cos, sin).sum().backward()

    @torch.no_grad()
    def indexer() -> None:
        latent, _ = sparse.queries(x, cos, sin)
        scores = sparse.indexer.scores(x, latent, cos, sin, sparse.indexer.keys(x, cos, sin))
        sparse.indexer.select(scores, torch.ones(seq, seq, dtype=torch.bool).tril())

    times = {"dense": [], "sparse": [], "indexer": []}
    step(dense), step(sparse)  # warm-up
    for _ in range(repeats):
        times["dense"].append(timed(lambda: step(dense)))
        times["sparse"].append(timed(lambda: step(sparse)))
        times["indexer"].append(timed(indexer))
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}

if __name__ == "__main__":
    main()
