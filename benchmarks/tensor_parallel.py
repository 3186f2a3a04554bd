"""What tensor parallelism's options buy: activation memory per rank, and what they cost in step time.

For a config's model (default moe-8x) and one micro-batch of ``--batch`` sequences, each variant runs on
``--tp`` gloo processes of this machine, tp=``--tp`` with everything else 1, fp32:

- ``saved MB``: the bytes autograd keeps for backward after one forward, on one rank, as
  ``analysis.memory.saved_activation_bytes`` counts them (the memory model's measured counterpart). This is the
  activation memory of the step, exact and independent of the machine's load.
- ``vs tp``: that over plain tensor parallelism's; ``vs 1 process``: over the single-process model's.
- ``logits MB``: the LM head's output on one rank (the [B, S, V] logits in fp32, or its vocabulary slice).
- ``step ms``: forward and backward, the fastest of ``--repeats`` (gloo on CPU: the collectives are
  memory copies through the loopback, so this says little about GPUs; it is here to show the options
  are not slower on the same machine).

Variants: plain tp; ``sequence_parallel``; ``vocab_parallel``; both. This is a measurement, never a
pass/fail test.

    python benchmarks/tensor_parallel.py [--config moe-8x] [--set KEY=VALUE ...] [--tp 2] [--batch 4] [--repeats 5]
                                         [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from analysis.memory import saved_activation_bytes
from config.parallel import ParallelConfig
from config.run import load_config
from moe.transformer import MoETransformer
from parallel import parallelize
from parallel.groups import ParallelGroups
from parallel.layout import Layout
from parallel.runtime import free_port
from parallel.tensor import lm_loss, loss_context

VARIANTS = {"tp": (False, False), "tp + sequence_parallel": (True, False), "tp + vocab_parallel": (False, True),
            "tp + both": (True, True)}


def measure(config_name: str, overrides: list[str], sequence_parallel: bool, vocab_parallel: bool, batch: int,
            repeats: int, world: int) -> dict:
    """One variant on this rank: saved bytes, logits bytes and the fastest forward + backward."""
    config = load_config(config_name, [*overrides, "train.precision=fp32"])
    torch.manual_seed(0)
    model = MoETransformer(config.model, config.moe)
    if world > 1:
        groups = ParallelGroups.build(Layout.resolve(world, tp=world, dp_shard=1), "cpu")
        model = parallelize(model, groups, ParallelConfig(sequence_parallel=sequence_parallel,
                                                          vocab_parallel=vocab_parallel))
    tokens = torch.randint(0, config.model.vocab_size, (batch, config.model.seq_len + 1),
                           generator=torch.Generator().manual_seed(1))
    saved = saved_activation_bytes(model, tokens[:, :-1], tokens[:, 1:], vocab_parallel)
    with loss_context(vocab_parallel):
        saved.loss.backward()
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        with loss_context(vocab_parallel):
            lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        times.append(time.perf_counter() - start)
    return {"saved_mb": saved.saved_bytes / 1e6, "logits_mb": saved.logits_bytes / 1e6, "step_ms": min(times) * 1e3}


def _worker(rank: int, world: int, port: int, args, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for name, (sequence_parallel, vocab_parallel) in VARIANTS.items():
            result = measure(args.config, args.set, sequence_parallel, vocab_parallel, args.batch, args.repeats,
                             world)
            if rank == 0:
                out[name] = result
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="moe-8x")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="sequences in the micro-batch")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()

    torch.set_num_threads(1)
    results = {"1 process": measure(args.config, args.set, False, False, args.batch, args.repeats, 1)}
    port = free_port()
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_worker, args=(args.tp, port, args, shared), nprocs=args.tp)
        results.update(dict(shared))

    single, plain = results["1 process"]["saved_mb"], results["tp"]["saved_mb"]
    print(f"{args.config} {' '.join(args.set)}, tp={args.tp}, micro-batch {args.batch} sequences, fp32; per rank:")
    print(f"{'variant':<24}{'saved MB':>10}{'vs tp':>8}{'vs 1 process':>14}{'logits MB':>11}{'step ms':>9}")
    for name, r in results.items():
        print(f"{name:<24}{r['saved_mb']:>10.1f}{r['saved_mb'] / plain:>8.2f}{r['saved_mb'] / single:>14.2f}"
              f"{r['logits_mb']:>11.1f}{r['step_ms']:>9.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "overrides": args.set, "tp": args.tp, "batch": args.batch,
                       "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
