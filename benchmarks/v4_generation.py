"""DeepSeek-V4 greedy generation with its cache against recomputing the whole sequence at every step.

What is measured. Tokens per second of greedy generation (``inference.generate.generate``) from a tiny random
DeepSeek-V4 (``moe/kv_cache.py``'s V4 state: the window's key/value head, the compressors' open windows and entries,
the indexer's keys) with the cache and with ``use_cache=False``, which runs the model over the prompt and every
token written so far at each step. The model: d_model 64, 4 layers (two sliding, then compressed sparse attention
of rate 4 keeping the indexer's top 8 and heavily compressed attention of rate 16), window 32, 4 heads of 32,
4 hyper-connected streams, a hash-routed layer then learned MoE layers of 4 experts (2 per token); fp32 on CPU.

Why. A cached step costs one position's projections and O(window + positions / rate) scores; a recomputed one
costs every position's. The ratio grows with the length; at this toy width Python's per-call overhead is a large
part of a cached step, so the ratio understates what a wide model gains.

Noise. After a short warm-up, ``--repeats`` runs of each, in alternating order; the rates are medians. On a shared
machine the ratio is indicative, not exact. A measurement, never a pass/fail test.

    python -m benchmarks.v4_generation [--prompt 64 --new-tokens 64 --threads 1 --repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from config.run import load_config
from inference.generate import generate
from moe.transformer import MoETransformer

TINY_V4 = ["model.d_model=64", "model.n_layers=4", "model.n_heads=4", "model.n_kv_heads=null", "model.head_dim=32",
           "model.rotary_dim=8", "model.q_lora_rank=32", "model.sliding_window=32",
           "model.layer_types=[sliding_attention, sliding_attention, compressed_sparse_attention, "
           "heavily_compressed_attention]", "model.mlp_layer_types=[hash_moe, moe, moe, moe]", "model.hc_mult=4",
           "model.index_topk=8", "model.index_n_heads=4", "model.index_head_dim=16",
           "model.compressed_attention.csa_rate=4", "model.compressed_attention.hca_rate=16",
           "model.compressed_attention.o_groups=2", "model.compressed_attention.o_lora_rank=16", "moe.num_experts=4",
           "moe.top_k=2", "moe.expert_hidden=64", "moe.capacity_factor=null", "moe.score_func=sqrtsoftplus",
           "moe.num_shared_experts=1"]


def tokens_per_second(model: MoETransformer, prompt: list[int], new: int, use_cache: bool) -> tuple[float, list]:
    """One greedy generation's rate, and the tokens it wrote."""
    begin = time.perf_counter()
    written = generate(model, prompt, new, temperature=0, use_cache=use_cache)
    return new / (time.perf_counter() - begin), written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=64, help="prompt positions")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    seq = args.prompt + args.new_tokens
    config = load_config("moe-8x", [*TINY_V4, f"model.seq_len={seq}"])
    model = MoETransformer(config.model, config.moe, seed=0).eval()
    prompt = torch.randint(0, config.model.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    for use_cache in (True, False):  # warm-up
        generate(model, prompt, 4, temperature=0, use_cache=use_cache)
    rates: dict[bool, list[float]] = {True: [], False: []}
    written: dict[bool, list[int]] = {}
    for repeat in range(args.repeats):
        for use_cache in ((True, False) if repeat % 2 == 0 else (False, True)):
            rate, written[use_cache] = tokens_per_second(model, prompt, args.new_tokens, use_cache)
            rates[use_cache].append(rate)
    cached, recomputed = statistics.median(rates[True]), statistics.median(rates[False])
    print(f"tiny DeepSeek-V4, prompt {args.prompt}, {args.new_tokens} new tokens greedy, fp32, "
          f"{args.threads} thread(s), median of {args.repeats}")
    print(f"  with the cache          {cached:7.1f} tokens/s")
    print(f"  recomputing (no cache)  {recomputed:7.1f} tokens/s")
    print(f"  ratio {cached / recomputed:.2f}x; the same tokens: {written[True] == written[False]}")

if __name__ == "__main__":
    main()
