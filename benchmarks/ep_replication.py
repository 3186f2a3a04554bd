"""Expert-parallel load imbalance before and after replicating hot experts (``parallel.ep_replicas``), from counts.

The plan (``parallel/replication.py``) is arithmetic on per-expert token counts, so large ep degrees are evaluated
here from counts alone, in one process, no collective: each of ep ranks routes its own micro-batch of tokens
through one router, the counts [ep][E] go into ``plan_replicas``, and the table gives the imbalance (the busiest
ep rank's rows over the mean) without replicas and with R slots per rank, the mean and the worst over the
micro-batches. Routings:

- ``skewed``: ``benchmarks/moe_layer.py``'s skewed tokens (a direction shared by all hidden states, of size
  ``SKEW`` against unit noise, the same on every rank, as a model's own residual direction is) through a randomly
  initialised router of DeepSeek-V3's expert count and top-k (256 experts, top-8);
- ``random``: the same router on plain Gaussian tokens (nearly balanced: the floor of what sampling alone gives).
- ``trained``: with ``--checkpoint`` (a run directory or checkpoint of a trained model, e.g. 200 steps of
  ``python train.py --config moe-8x --set train.steps=200 --run-dir DIR``, or the 64-expert model of
  docs/parallelism.md's table), that model's own routing of its own validation text (the tail of its data source,
  ``data.val_fraction``): each ep rank runs its own sequences through the model (dropless:
  ``inference.load_model``), and every MoE layer's counts are one sample, at each of the ep degrees above that
  divide its experts (moe-8x's 8: ep=8 only); the DeepSeek-V3 pricing columns do not apply to them.

It also answers whether weights should move per micro-batch (the plan from the micro-batch's own counts, what
``parallel/replica_exchange.py`` does) or once per step from the previous step's loads: ``stale`` keeps the slot
placement planned from the previous step's counts (``--step-micro-batches`` S micro-batches of one layer summed;
S = 1: the previous micro-batch) and only splits the rows of each micro-batch of the current step over it
(``stale_loads``): that is the best a placement fixed in advance can do. And it prices the copies: the bytes of the
experts the busiest sender copies per layer and micro-batch (forward; their gradients return in backward, as many)
against the dispatch's bytes, for DeepSeek-V3's shapes (d_model 7168, expert hidden 2048, bf16); and, for that layer on
H100 nodes (``analysis/replica_time.py``), the R that pays best and the routed experts' modelled time over
forced-balanced routing's (the straggler's compute plus the copies both ways).

This is a measurement, never a pass/fail test.

    python benchmarks/ep_replication.py [--tokens 4096] [--micro-batches 8] [--json PATH] [--checkpoint RUN_DIR]
                                        [--step-micro-batches 1] [--no-synthetic]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from torch import Tensor

from analysis.gpu_presets import HARDWARE
from analysis.replica_time import ReplicaOption, best_replicas, expert_seconds, layer_seconds
from analysis.step_time import EFFICIENCY
from config.model import MoEConfig
from data.cache import load_tokens
from data.sampler import eval_batches, split_tokens
from inference.load import LoadedModel, load_model
from moe.init import initialize
from moe.router import TopKRouter
from parallel.replication import ReplicaPlan, imbalance, plan_replicas, weight_moves

SKEW = 0.45  # as benchmarks/moe_layer.py's skewed tokens
D_MODEL, EXPERTS, TOP_K = 512, 256, 8  # the router's width; DeepSeek-V3's routed experts and choices
EP_DEGREES, REPLICAS = (8, 16, 64), (1, 2)
V3_D_MODEL, V3_HIDDEN, V3_BYTES = 7168, 2048, 2  # one DeepSeek-V3 expert: three [7168, 2048] matrices in bf16


def route_counts(router: TopKRouter, ep: int, tokens: int, direction: torch.Tensor | None,
                 generator: torch.Generator) -> list[list[int]]:
    """[ep][E]: each rank's own micro-batch of ``tokens`` routed, assignments per expert."""
    counts = []
    for _ in range(ep):
        x = torch.randn(tokens, D_MODEL, generator=generator)
        if direction is not None:
            x = x + SKEW * direction
        with torch.no_grad():
            ids = router(x).expert_ids
        counts.append(torch.bincount(ids.reshape(-1), minlength=EXPERTS).tolist())
    return counts


def stale_loads(placement: ReplicaPlan, counts: list[list[int]]) -> tuple[int, ...]:
    """Loads when the slots hold what ``placement`` put there and only the rows are split anew: each filled slot
    takes as many of its expert's rows as bring its owner down or itself up to the mean (rounded up), busiest owner
    first."""
    ep, local = placement.ep, placement.num_local
    expert_load = [sum(row[e] for row in counts) for e in range(ep * local)]
    loads = [sum(expert_load[r * local:(r + 1) * local]) for r in range(ep)]
    at_owner, target = list(expert_load), -(-sum(loads) // ep)
    filled = [(d, e) for d in range(ep) for e in placement.slots[d] if e >= 0]
    for dest, expert in sorted(filled, key=lambda s: -loads[s[1] // local]):
        owner = expert // local
        rows = max(0, min(loads[owner] - target, target - loads[dest], at_owner[expert]))
        at_owner[expert] -= rows
        loads[owner] -= rows
        loads[dest] += rows
    return tuple(loads)


V3_EXPERT_BYTES = 3 * V3_D_MODEL * V3_HIDDEN * V3_BYTES


def experts_sent(plan: ReplicaPlan) -> int:
    """The most experts one rank copies to other ranks' slots in one micro-batch and layer."""
    return max(len(weight_moves(plan, rank).send_local) for rank in range(plan.ep))


def v3_modelled(row: dict, tokens: int) -> tuple[int, float]:
    """DeepSeek-V3's layer on H100 nodes of 8 (``analysis/replica_time.py``): the R chosen from this row's mean
    imbalances and copies, and its routed-expert time over forced-balanced routing's. The ep group inside a node
    (ep <= 8) copies over NVLink, else over the rank's network adapter."""
    h100 = HARDWARE["h100"]
    moe = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, expert_hidden=V3_HIDDEN, activation="swiglu")
    expert_s = expert_seconds(moe, V3_D_MODEL, tokens, h100.bf16_flops * EFFICIENCY)
    bandwidth = h100.intra_node * h100.intra_efficiency if row["ep"] <= 8 else h100.inter_node * h100.network_efficiency
    options = [ReplicaOption(r, statistics.mean(row[f"R={r}"]), row[f"R={r} sent"]) for r in REPLICAS]
    option = best_replicas(statistics.mean(row["before"]), options, expert_s, V3_EXPERT_BYTES, bandwidth)
    return option.replicas, layer_seconds(option, expert_s, V3_EXPERT_BYTES, bandwidth) / expert_s


def previous_step_counts(steps: list[list[list[int]]], series: int, step: int) -> dict[int, list[list[int]]]:
    """For each sample that has a previous step in its run of ``series`` micro-batches (one layer's), that step's
    ``step`` micro-batches' counts summed: what a placement moved once per step would be planned from."""
    previous = {}
    for i in range(len(steps)):
        start = i - i % series + (i % series // step - 1) * step  # the previous step's first micro-batch
        if i % series >= step:
            previous[i] = [[sum(steps[j][r][e] for j in range(start, start + step)) for e in range(len(steps[i][r]))]
                           for r in range(len(steps[i]))]
    return previous


def summarize(routing: str, ep: int, steps: list[list[list[int]]], tokens: int, v3: bool = True,
              series: int | None = None, step: int = 1) -> dict:
    """One table row from the counts [ep][E] of each sample (a micro-batch, or a layer of one); ``v3``: price the
    copies at DeepSeek-V3's shapes (the counts are of its 256 experts, top-8). ``series``: the samples are runs of
    that many micro-batches of one layer each, and a placement is kept only within its run (default: one run);
    ``step``: micro-batches per step, the previous placement planned from the previous step's."""
    series = series or len(steps)
    previous = previous_step_counts(steps, series, step)
    row = {"routing": routing, "ep": ep, "before": [plan_replicas(c, 0).imbalance_before for c in steps]}
    dispatch = tokens * TOP_K * V3_D_MODEL * V3_BYTES  # a rank's rows out, all of them
    for r in REPLICAS:
        plans = [plan_replicas(c, r) for c in steps]
        row[f"R={r}"] = [p.imbalance_after for p in plans]
        row[f"R={r} stale"] = [imbalance(stale_loads(plan_replicas(counts, r), steps[i]))
                               for i, counts in previous.items()]
        row[f"R={r} sent"] = statistics.mean(experts_sent(p) for p in plans)
        row[f"R={r} copy/dispatch"] = row[f"R={r} sent"] * V3_EXPERT_BYTES / dispatch if v3 else None
    row["V3 R"], row["V3 time / balanced"] = v3_modelled(row, tokens) if v3 else (None, None)
    return row


def measure(routing: str, tokens: int, micro_batches: int, step: int = 1,
            ep_degrees: tuple[int, ...] = EP_DEGREES) -> list[dict]:
    generator = torch.Generator().manual_seed(0)
    router = TopKRouter(D_MODEL, MoEConfig(num_experts=EXPERTS, top_k=TOP_K))
    initialize(router, seed=0, std=0.02, out_std=0.01)
    direction = torch.randn(D_MODEL, generator=generator) if routing == "skewed" else None
    rows = []
    for ep in ep_degrees:
        steps = [route_counts(router, ep, tokens, direction, generator) for _ in range(micro_batches)]
        rows.append(summarize(routing, ep, steps, tokens, step=step))
    return rows


def trained_counts(loaded: LoadedModel, ep: int, tokens: int, micro_batches: int) -> list[list[list[int]]]:
    """A trained model's routing of its own validation text: for each MoE layer and micro-batch (layer by layer),
    [ep][E] counts, ep rank r's from its own tokens // seq_len sequences (windows spread over the validation
    split)."""
    config, model = loaded.config, loaded.model
    data = config.data
    val = split_tokens(load_tokens(data.source, data.cache_dir, config.model.vocab_size, data.tokenizer),
                       data.val_fraction, config.model.seq_len)[1]
    per_rank = max(1, tokens // config.model.seq_len)
    routers = [m.router for m in model.modules() if isinstance(getattr(m, "router", None), TopKRouter)]
    seen: list[Tensor] = []
    hooks = [r.register_forward_hook(lambda _m, _i, out: seen.append(out.expert_ids)) for r in routers]
    samples: list[list[list[list[int]]]] = [[] for _ in routers]  # [layer][micro-batch][ep][E]
    experts = config.moe.num_experts
    with torch.no_grad():
        for inputs, _ in eval_batches(val, config.model.seq_len, ep * per_rank, micro_batches):
            for layer in samples:
                layer.append([])
            for rank_inputs in inputs.split(per_rank):
                seen.clear()
                model(rank_inputs)
                for layer, ids in enumerate(seen):
                    samples[layer][-1].append(torch.bincount(ids.reshape(-1), minlength=experts).tolist())
    for hook in hooks:
        hook.remove()
    return [counts for layer in samples for counts in layer]


def trained_rows(loaded: LoadedModel, tokens: int, micro_batches: int, step: int) -> list[dict]:
    """The trained model's rows: at each ep degree of ``EP_DEGREES`` that divides its experts."""
    moe = loaded.config.moe
    name = f"trained, {moe.num_experts} experts top-{moe.top_k}"
    return [summarize(name, ep, trained_counts(loaded, ep, tokens, micro_batches), tokens, v3=False,
                      series=micro_batches, step=step)
            for ep in EP_DEGREES if moe.num_experts % ep == 0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per ep rank and micro-batch")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--checkpoint", default=None,
                        help="a trained model's run directory or checkpoint: add its routing of its validation text")
    parser.add_argument("--step-micro-batches", type=int, default=1,
                        help="micro-batches per step: the previous placement is planned from the previous step's")
    parser.add_argument("--no-synthetic", action="store_true",
                        help="leave out the skewed and random rows (with --checkpoint: the trained model's alone)")
    args = parser.parse_args()
    if not 1 <= args.step_micro_batches < args.micro_batches:
        parser.error(f"--step-micro-batches must be at least 1 and below --micro-batches ({args.micro_batches}), "
                     f"so that a step has a previous one; got {args.step_micro_batches}")
    if args.no_synthetic and not args.checkpoint:
        parser.error("--no-synthetic leaves only the trained model's rows: give --checkpoint")
    rows = [row for routing in ("skewed", "random") if not args.no_synthetic
            for row in measure(routing, args.tokens, args.micro_batches, args.step_micro_batches)]
    if args.checkpoint:
        rows += trained_rows(load_model(args.checkpoint), args.tokens, args.micro_batches, args.step_micro_batches)

    def cell(values: list[float]) -> str:
        return f"{statistics.mean(values):.3f} ({max(values):.3f})"

    def figure(value: float | int | None, spec: str = "") -> str:
        return "-" if value is None else format(value, spec)

    synthetic = "" if args.no_synthetic else f"; skewed and random: {EXPERTS} experts, top-{TOP_K}"
    print(f"imbalance (busiest ep rank's rows / mean): mean (worst) over {args.micro_batches} micro-batches of "
          f"{args.tokens} tokens per rank{synthetic}; previous placement: the previous step's of "
          f"{args.step_micro_batches} micro-batch(es)")
    if args.checkpoint:
        print(f"trained: {args.checkpoint}'s routing of its validation text, each MoE layer's micro-batches "
              "samples")
    print("| routing | ep | no replicas | R=1 | R=2 | R=1, previous placement | R=2, previous placement "
          "| copies / dispatch bytes, R=1 | R=2 | V3 on H100: R chosen | expert time / balanced |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['routing']} | {row['ep']} | {cell(row['before'])} | {cell(row['R=1'])} | {cell(row['R=2'])} "
              f"| {cell(row['R=1 stale'])} | {cell(row['R=2 stale'])} | {figure(row['R=1 copy/dispatch'], '.2f')} "
              f"| {figure(row['R=2 copy/dispatch'], '.2f')} | {figure(row['V3 R'])} "
              f"| {figure(row['V3 time / balanced'], '.3f')} |")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
