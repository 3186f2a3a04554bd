"""MoE layer overhead: forward + backward of ``MoELayer`` against its expert-math floor.

What is measured. The standard layer (E=8 experts, top-2, d_model=512, SwiGLU
experts of hidden 1024, 4096 tokens as [4, 1024, 512], 2 threads) runs forward
and backward in fp32, and in bf16 mixed precision (``torch.autocast`` on CPU,
fp32 master weights; the experts compute with bf16 copies of their weights made once per
optimizer step, ``moe.experts.ComputeCopies``), dropless and with capacity factor 1.25. In the same
process, interleaved step for step with it, runs the *floor*: the expert math
alone, i.e. the three grouped GEMMs of the SwiGLU experts and the activation
between them, forward and backward, on tokens that are already grouped, with the
group sizes the layer really produced (the kept sizes, after drops, under a
capacity factor). In bf16 the floor takes bf16 tokens and bf16 weights directly.
The floor has no router, no permutation, no combine, no casts, no balancing
losses and no statistics.

Why. ``layer / floor`` is what routing, dispatch, combine, casts and the balancing
losses cost on top of the expert math; the goal is at most 1.20 in both
precisions. Absolute speed depends on the machine, the ratio much less. bf16 is
the hard case: on CPUs with AVX512-BF16 its GEMMs are ~4x faster than fp32, so
the memory-bound rest no longer hides behind them.

The stricter floor (``strict`` column, a fraction: strict floor time over layer time, higher is better). The
bare grouped GEMMs alone, forward and backward, on uniform groups of T·k/E rows (1,024 per expert in the
standard layer), with no activation: the gate and up projections' outputs are roots of backward with gradients
of their own, the up projection's output feeds the down projection directly. It is the same for every routing
and capacity (no padding, no skew, no activation, no kept-size bookkeeping), so it is how other projects' MoE
layers are compared on one scale (issue 31: Megatron-Core's and DeepSpeed's reach 0.80 of it in fp32 here). It
is timed in the same interleaved loop as the layer and the floor.

Casts. The timed steps are micro-batches of one optimizer step: in bf16 they reuse the experts' copies,
as training does between optimizer steps. What remaking the copies costs, once per step, is timed apart
and printed as ``cast``, a percentage of the layer step (a step of m micro-batches pays it once).

Routing. ``random``: a freshly initialised router on Gaussian tokens, i.e. what
that router really picks (nearly balanced). ``skewed``: the same router on tokens
sharing a mean direction, as real residual streams do, which concentrates load the
way a real router's is concentrated (max/mean around 1.7). ``balanced``:
``MoEConfig.force_balance`` (round robin). The ``imbal`` column is max / mean
assignments per expert as the router chose them (before drops); ``kept`` is the
fraction of assignments the capacity left to the experts.

Noise. On a shared machine a step can stall at any time. Each repeat runs a layer
step and a floor step back to back (alternating which goes first); ``ratio`` is
the median of the per-repeat ratios, the times are medians, and ``best`` is the
fastest layer step over the fastest floor step, the estimate least disturbed by
other processes. This is a measurement, never a pass/fail test.

GPU (``--device cuda``, run by ``scripts/gpu_check.sh``): bf16 only, the standard layer and a
Mixtral-shaped one (d_model 4096, expert hidden 14336, 8 experts, top-2, 8192 tokens), each with the torch
backend and, where it is installed, megablocks' grouped GEMM (``moe.backend``), against the floor computed
with the same backend. Steps are timed between device synchronisations. ``TFLOP/s`` is the expert math's
FLOPs (18·rows·D·H for SwiGLU: three GEMMs forward, twice that backward) over the layer step, and ``peak``
its fraction of the GPU's dense bf16 datasheet figure (``parallel.hardware.datasheet_bf16_peak``).

GPT-OSS (``--gpt-oss``): the standard layer again with router and expert biases and the clamped SwiGLU, its floor
the clamped SwiGLU's expert math without bias adds (what fused biases would cost); its ratio beside the standard
layer's is what the unfused bias passes and the biased router add.

    python benchmarks/moe_layer.py [--device cpu|cuda] [--repeats N] [--precision fp32|bf16|both] [--quick]
                                   [--gpt-oss] [--json PATH]
    python benchmarks/moe_layer.py --library [--processes N] [--tuned-allocator]   (benchmarks/moe_layer_library.py)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository's packages

from benchmarks.moe_layer_cases import (  # noqa: E402
    GPT_OSS,
    MIXTRAL,
    STANDARD,
    Shape,
    make_layer,
    make_strict_floor_step,
)
from benchmarks.moe_layer_library import measure, print_results  # noqa: E402
from moe.dispatch import expert_capacity  # noqa: E402
from moe.experts import gated_activation, grouped_matmul, megablocks_unavailable  # noqa: E402
from moe.layer import MoELayer  # noqa: E402
from parallel.hardware import datasheet_bf16_peak, keep_freed_memory  # noqa: E402

THREADS = 2
ROUTINGS = ("random", "skewed", "balanced")
CAPACITY_FACTORS = {"dropless": None, "cf1.25": 1.25}
DEFAULT_REPEATS = {"fp32": 7, "bf16": 21}  # bf16 steps are ~4x cheaper and its ratio is the close one
SKEW = 0.45  # size of the shared direction in ``skewed`` tokens, relative to their unit-variance noise


@dataclass
class Result:
    shape: str
    backend: str
    precision: str
    mode: str
    routing: str
    imbalance: float  # max / mean assignments per expert, as routed (before drops)
    kept_fraction: float  # kept / routed assignments
    layer_s: float  # median forward + backward of MoELayer
    floor_s: float  # median forward + backward of the expert math alone
    ratio: float  # median of per-repeat layer / floor
    strict_s: float  # median forward + backward of the bare grouped GEMMs, uniform groups, no activation
    strict_fraction: float  # median of per-repeat strict floor / layer (the stricter floor's view; higher is better)
    best_ratio: float  # fastest layer step / fastest floor step: the least disturbed estimate
    tokens_per_s: float  # tokens / layer_s
    cast_s: float  # median time to remake the experts' bf16 copies (once per optimizer step); 0 in fp32
    tflops: float  # the expert math's FLOPs per second of layer step
    peak_fraction: float | None  # of the GPU's dense bf16 datasheet peak; None on a CPU or an unknown GPU


def make_tokens(shape: Shape, routing: str, device: torch.device) -> torch.Tensor:
    """[B, S, D] layer inputs; ``skewed`` ones share a direction, as real hidden states do."""
    x = torch.randn(shape.batch, shape.seq, shape.d_model, device=device)
    if routing == "skewed":
        x = x + SKEW * torch.randn(shape.d_model, device=device)
    return x


def autocast(precision: str, device: torch.device):
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_layer_step(layer: MoELayer, x: torch.Tensor, precision: str) -> Callable[[], None]:
    """Forward + backward of the whole layer, as in training (fp32 gradient from the residual stream)."""
    x = x.detach().requires_grad_(True)
    grad = torch.randn_like(x)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with autocast(precision, x.device):
            out = layer(x)
        out.backward(grad)

    return step


def make_floor_step(layer: MoELayer, group_sizes: torch.Tensor, precision: str) -> Callable[[], None]:
    """Forward + backward of the SwiGLU expert math alone, on already-grouped tokens, with the layer's backend.

    For GPT-OSS's experts the activation is the clamped SwiGLU and there are no bias adds: a bias fused into the
    GEMM's epilogue or the activation costs no pass of its own, so ``layer / floor`` shows what the layer's
    separate bias passes (``moe.experts._add_row_bias``) cost beside what the standard layer's ratio shows."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    experts = layer.experts
    w_in, w_gate, w_out = (w.detach().to(dtype).requires_grad_(True)
                           for w in (experts.w_in, experts.w_gate, experts.w_out))
    rows, device = int(group_sizes.sum()), w_in.device
    backend = layer.config.backend
    group_sizes = group_sizes.cpu() if backend == "megablocks" else group_sizes.to(device)  # as expert_ffn passes them
    x = torch.randn(rows, w_in.shape[1], dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(rows, w_in.shape[1], dtype=dtype, device=device)

    def step() -> None:
        for leaf in (x, w_in, w_gate, w_out):
            leaf.grad = None
        gate, up = grouped_matmul(x, w_gate, group_sizes, backend), grouped_matmul(x, w_in, group_sizes, backend)
        hidden = gated_activation(gate, up, experts.clamp)
        grouped_matmul(hidden, w_out, group_sizes, backend).backward(grad)

    return step


def timed(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds ``fn`` takes, its device work included (synchronised before and after on a GPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def copy_refresh_time(layer: MoELayer, precision: str, repeats: int, device: torch.device) -> float:
    """Median time to cast the experts' weights to bf16, what ``ComputeCopies`` does once per step."""
    if precision != "bf16":
        return 0.0
    weights = [p.detach() for p in layer.experts.parameters()]
    return statistics.median(timed(lambda: [w.to(torch.bfloat16) for w in weights], device) for _ in range(repeats))


def time_interleaved(steps: list[Callable[[], None]], repeats: int, warmup: int, device: torch.device
                     ) -> list[list[float]]:
    """Per-repeat times of each step, run back to back, reversing their order every other repeat."""
    for _ in range(warmup):
        for step in steps:
            step()
    times = [[] for _ in steps]
    for repeat in range(repeats):
        order = list(range(len(steps)))
        for i in order[::-1] if repeat % 2 else order:
            times[i].append(timed(steps[i], device))
    return times


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return datasheet_bf16_peak(name)


def run_case(shape: Shape, backend: str, precision: str, mode: str, routing: str, repeats: int,
             device: torch.device, warmup: int = 1) -> Result:
    torch.manual_seed(0)
    capacity_factor = CAPACITY_FACTORS[mode]
    layer = make_layer(shape, capacity_factor, routing, backend, device)
    x = make_tokens(shape, routing, device)
    with torch.no_grad(), autocast(precision, device):
        layer(x)
    routed = layer.last_stats.tokens_per_expert.cpu()
    group_sizes = routed
    if capacity_factor is not None:
        group_sizes = routed.clamp(max=expert_capacity(shape.tokens, shape.top_k, shape.num_experts, capacity_factor))

    steps = [make_layer_step(layer, x, precision), make_floor_step(layer, group_sizes, precision)]
    if not shape.gpt_oss:  # the bare GEMMs are the same for GPT-OSS's layer: its strict column would repeat
        steps.append(make_strict_floor_step(layer, shape, precision))
    layer_times, floor_times, *strict_times = time_interleaved(steps, repeats, warmup, device)
    strict_times = strict_times[0] if strict_times else [float("nan")] * repeats
    layer_s = statistics.median(layer_times)
    flops = 18 * int(group_sizes.sum()) * shape.d_model * shape.hidden  # SwiGLU: 3 GEMMs, x3 with backward
    peak = peak_flops(device)
    return Result(
        shape=shape.name,
        backend=backend,
        precision=precision,
        mode=mode,
        routing=routing,
        imbalance=float(routed.max() / routed.float().mean()),
        kept_fraction=float(group_sizes.sum() / routed.sum()),
        layer_s=layer_s,
        floor_s=statistics.median(floor_times),
        ratio=statistics.median(a / b for a, b in zip(layer_times, floor_times, strict=True)),
        strict_s=statistics.median(strict_times),
        strict_fraction=statistics.median(s / a for s, a in zip(strict_times, layer_times, strict=True)),
        best_ratio=min(layer_times) / min(floor_times),
        tokens_per_s=shape.tokens / layer_s,
        cast_s=copy_refresh_time(layer, precision, repeats, device),
        tflops=flops / layer_s / 1e12,
        peak_fraction=flops / layer_s / peak if peak else None,
    )


def print_table(results: list[Result]) -> None:
    header = (f"{'shape':<9} {'backend':<10} {'prec':<5} {'mode':<9} {'routing':<9} {'imbal':>6} {'kept':>6} "
              f"{'layer s':>8} {'floor s':>8} {'ratio':>6} {'best':>5} {'strict s':>8} {'strict':>6} {'tokens/s':>9} "
              f"{'cast':>6} "
              f"{'TFLOP/s':>8} {'peak':>6}")
    print(header)
    print("-" * len(header))
    for r in results:
        peak = f"{r.peak_fraction:>6.1%}" if r.peak_fraction is not None else f"{'-':>6}"
        print(f"{r.shape:<9} {r.backend:<10} {r.precision:<5} {r.mode:<9} {r.routing:<9} {r.imbalance:>6.2f} "
              f"{r.kept_fraction:>6.3f} {r.layer_s:>8.4f} {r.floor_s:>8.4f} {r.ratio:>6.2f} {r.best_ratio:>5.2f} "
              f"{r.strict_s:>8.4f} {r.strict_fraction:>6.2f} "
              f"{r.tokens_per_s:>9.0f} {100 * r.cast_s / r.layer_s:>5.1f}% {r.tflops:>8.2f} {peak}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: bf16, the standard and the Mixtral-shaped layer, torch and megablocks backends")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed steps per case (default: fp32 7, bf16 21; quick: 3)")
    parser.add_argument("--precision", choices=("fp32", "bf16", "both"), default=None,
                        help="default: both on a CPU, bf16 on a GPU (grouped GEMMs there are bf16 only)")
    parser.add_argument("--quick", action="store_true", help="3 repeats, random and balanced routing only")
    parser.add_argument("--json", type=Path, default=None, help="also write the settings and results here")
    parser.add_argument("--gpt-oss", action="store_true",
                        help="also the standard layer with GPT-OSS's router and expert biases and clamped SwiGLU")
    parser.add_argument("--library", action="store_true",
                        help="the library protocol instead (benchmarks/moe_layer_library.py): fresh processes, "
                             "the default allocator, the standard layer on CPU")
    parser.add_argument("--processes", type=int, default=5, help="--library: processes per figure (default 5)")
    parser.add_argument("--tuned-allocator", action="store_true",
                        help="--library: glibc's thresholds set as parallel.hardware.keep_freed_memory sets them")
    args = parser.parse_args()
    if args.library:
        if args.device != "cpu":
            parser.error("--library measures the CPU layer")
        precisions = ("fp32", "bf16") if args.precision in (None, "both") else (args.precision,)
        results = measure(precisions, args.processes, args.tuned_allocator)
        print_results(results, args.processes, args.tuned_allocator)
        if args.json is not None:
            args.json.write_text(json.dumps({"protocol": "library", "results": results}, indent=2))
        return

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here")
    precision = args.precision or ("both" if device.type == "cpu" else "bf16")
    if device.type == "cuda" and precision != "bf16":
        parser.error("--device cuda measures bf16 only: torch's grouped GEMM on CUDA is bf16")
    torch.set_num_threads(THREADS)
    keep_freed_memory(device.type)  # as train.py does
    precisions = ("fp32", "bf16") if precision == "both" else (precision,)
    repeats = {p: args.repeats or (3 if args.quick else DEFAULT_REPEATS[p]) for p in precisions}
    routings = ("random", "balanced") if args.quick else ROUTINGS
    shapes = (STANDARD,) if device.type == "cpu" else (STANDARD, MIXTRAL)
    shapes += (GPT_OSS,) if args.gpt_oss else ()
    backends = ["torch"]
    if device.type == "cuda" and megablocks_unavailable("cuda") is None:
        backends.append("megablocks")
    settings = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    shapes=[asdict(shape) for shape in shapes], backends=backends,
                    threads=torch.get_num_threads(), repeats=repeats, torch=torch.__version__)
    print("MoE layer vs expert-math floor, forward + backward: "
          + " ".join(f"{key}={value}" for key, value in settings.items() if key != "shapes")
          + " | " + "; ".join(f"{s.name}: E={s.num_experts} top-{s.top_k} d_model={s.d_model} "
                              f"hidden={s.hidden} tokens={s.tokens}" for s in shapes))
    results = [run_case(shape, backend, p, mode, routing, repeats[p], device)
               for shape in shapes for backend in backends for p in precisions
               for mode in CAPACITY_FACTORS for routing in routings]
    print_table(results)
    if args.json is not None:
        args.json.write_text(json.dumps({"settings": settings, "results": [asdict(r) for r in results]}, indent=2))


if __name__ == "__main__":
    main()
