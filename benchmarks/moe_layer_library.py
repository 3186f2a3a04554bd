"""The MoE layer used as a library: what a user who imports ``MoELayer`` into their own trainer sees.

``benchmarks/moe_layer.py`` times the layer inside a process tuned as ``train.py`` tunes it (glibc told to keep
freed memory: ``parallel.hardware.keep_freed_memory``) and against floors made from the layer's own routing.
Here the protocol is the one other projects' layers were compared with (issue 43), so that the figures stand
beside theirs:

- one fresh process per measurement, ``torch.set_num_threads(2)``, the default allocator (every ``MALLOC_*``
  variable and ``GLIBC_TUNABLES`` removed from the child's environment; ``--tuned-allocator`` sets glibc's
  thresholds as ``keep_freed_memory`` does, for the comparison);
- the standard layer (8 experts, top-2, d_model 512, expert hidden 1024, SwiGLU, dropless, the balancing and
  z losses attached), fp32 input [1, 4096, 512] with ``requires_grad``, forward, then backward of
  ``out.float()`` with a fixed random upstream gradient, gradients set to None every step;
- bf16: ``torch.autocast("cpu", torch.bfloat16)`` around the forward, the experts' bf16 copies remade every
  step (each step is a whole optimizer step of one micro-batch, ``moe.experts.release_compute_copies``);
- 3 warm-up steps, then the median of 10; ``--processes`` (default 5) processes each for the layer and the
  floor, alternating which starts first; the figure is the median over processes;
- the floor: the bare grouped GEMMs of the three expert matrices, forward and backward, on 1,024 rows per
  expert (``T·k/E``), no activation (``moe_layer.make_strict_floor_step``), in the same precision.

``of floor`` is the layer's tokens per second over the floor's: 1.0 would be a layer that costs nothing but its
expert GEMMs. The host line names the CPU, whether it has AMX, and the floor's TFLOP/s: a host with slow
multiplies flatters every ratio, so a figure is only comparable with others taken on the same host.

    python benchmarks/moe_layer.py --library [--precision fp32|bf16|both] [--processes N] [--tuned-allocator]
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
THREADS = 2
WARMUP, STEPS = 3, 10
TUNED_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": "33554432", "MALLOC_TRIM_THRESHOLD_": "2147483647"}


def _layer_step(precision: str):
    from benchmarks.moe_layer_cases import STANDARD, make_layer
    from moe.experts import release_compute_copies

    layer = make_layer(STANDARD, None, "random", "torch", torch.device("cpu"))
    x = torch.randn(1, STANDARD.tokens, STANDARD.d_model, requires_grad=True)
    grad = torch.randn(1, STANDARD.tokens, STANDARD.d_model)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        release_compute_copies(layer)  # one micro-batch per optimizer step: the copies are remade
        if precision == "bf16":
            with torch.autocast("cpu", torch.bfloat16):
                out = layer(x)
        else:
            out = layer(x)
        out.float().backward(grad)

    return step


def _floor_step(precision: str):
    from benchmarks.moe_layer_cases import STANDARD, make_layer, make_strict_floor_step

    layer = make_layer(STANDARD, None, "random", "torch", torch.device("cpu"))
    return make_strict_floor_step(layer, STANDARD, precision)


def child(kind: str, precision: str) -> tuple[float, float]:
    """Tokens per second of ``kind`` ("layer" or "floor") in this process, the median of 10 steps after 3, and the
    MiB of pages faulted in per step over them (minor faults: fresh memory the allocator mapped; unlike times,
    they do not depend on what else the machine runs)."""
    from benchmarks.moe_layer_cases import STANDARD

    torch.set_num_threads(THREADS)
    torch.manual_seed(0)
    step = _layer_step(precision) if kind == "layer" else _floor_step(precision)
    for _ in range(WARMUP):
        step()
    times = []
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(STEPS):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    faulted = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) * resource.getpagesize() / STEPS / 2**20
    return STANDARD.tokens / statistics.median(times), faulted


def _run_child(kind: str, precision: str, tuned_allocator: bool) -> tuple[float, float]:
    environment = {key: value for key, value in os.environ.items()
                   if not (key.startswith("MALLOC_") and key.endswith("_")) and key != "GLIBC_TUNABLES"}
    if tuned_allocator:
        environment.update(TUNED_ALLOCATOR)
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, "-m", "benchmarks.moe_layer_library", kind, precision],
                          env=environment, cwd=ROOT, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["tokens_per_s"], result["faulted_mib_per_step"]


def host() -> str:
    """The CPU's model name and whether it has AMX (its bf16 and int8 tile multiplies)."""
    model, flags = "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    amx = sorted(flag for flag in flags if flag.startswith("amx"))
    return f"{model}, {'AMX (' + ', '.join(amx) + ')' if amx else 'no AMX'}, {os.cpu_count()} logical CPUs"


def measure(precisions: tuple[str, ...], processes: int, tuned_allocator: bool) -> list[dict]:
    """Per precision: the median over processes of the layer's and the floor's tokens per second."""
    from benchmarks.moe_layer_cases import STANDARD

    results = []
    for precision in precisions:
        layer, floor, faulted = [], [], []
        for p in range(processes):
            order = ("layer", "floor") if p % 2 == 0 else ("floor", "layer")
            for kind in order:
                tokens_per_s, mib = _run_child(kind, precision, tuned_allocator)
                (layer if kind == "layer" else floor).append(tokens_per_s)
                if kind == "layer":
                    faulted.append(mib)
        floor_tokens = statistics.median(floor)
        floor_flops = 18 * STANDARD.tokens * STANDARD.top_k * STANDARD.d_model * STANDARD.hidden
        results.append(dict(precision=precision, layer_tokens_per_s=statistics.median(layer),
                            floor_tokens_per_s=floor_tokens,
                            of_floor=statistics.median(layer) / floor_tokens,
                            floor_tflops=floor_tokens / STANDARD.tokens * floor_flops / 1e12,
                            layer_faulted_mib_per_step=statistics.median(faulted),
                            layer_per_process=layer, floor_per_process=floor))
    return results


def print_results(results: list[dict], processes: int, tuned_allocator: bool) -> None:
    allocator = "glibc thresholds as keep_freed_memory sets them" if tuned_allocator else "default allocator"
    print(f"MoE layer as a library: {host()}; torch {torch.__version__}, {THREADS} threads, {allocator}, "
          f"{processes} processes each, median of {STEPS} steps after {WARMUP}")
    print(f"{'prec':<5} {'layer tok/s':>12} {'floor tok/s':>12} {'of floor':>9} {'floor TFLOP/s':>14} "
          f"{'layer MiB faulted/step':>23}")
    for r in results:
        print(f"{r['precision']:<5} {r['layer_tokens_per_s']:>12.0f} {r['floor_tokens_per_s']:>12.0f} "
              f"{r['of_floor']:>9.2f} {r['floor_tflops']:>14.2f} {r['layer_faulted_mib_per_step']:>23.1f}")


if __name__ == "__main__":
    tokens_per_s, faulted = child(sys.argv[1], sys.argv[2])
    print(json.dumps({"tokens_per_s": tokens_per_s, "faulted_mib_per_step": faulted}))
