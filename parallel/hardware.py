"""What this hardware does well: which precision to train in (the one rule, for the run and the plans), its
matmul peak for MFU, the memory it has used, and whether it can run a config at all."""

from __future__ import annotations

import ctypes
import math
import os
import resource
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from config.errors import ConfigError
from moe.attention.delta_rule_fla import check_linear_backend
from moe.experts import check_backend
from parallel.compile import compile_unavailable

# Dense bf16 tensor-core peaks from NVIDIA's datasheets (no sparsity: half the "with sparsity" figure), FLOP/s, by
# a part of the name torch reports. The first key found in the name wins, so a variant comes before its family:
# the H100 PCIe (756) and the NVL parts (835) clock lower than the SXM parts (989), whose names ("NVIDIA H100 80GB
# HBM3", "NVIDIA H200") carry no form factor.
GPU_BF16_PEAK = {"H100 PCIe": 756e12, "H800 PCIe": 756e12, "H100 NVL": 835e12, "H200 NVL": 835e12, "H200": 989e12,
                 "H100": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}

# bf16 must beat fp32 by this much to be worth its rounding on a CPU.
BF16_SPEEDUP_THRESHOLD = 1.5


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str  # "fp32" or "bf16"
    reason: str
    peak_flops: float  # FLOP/s of dense matmuls in that precision, for MFU
    peak_source: str  # "datasheet" or "measured"


def datasheet_bf16_peak(device_name: str) -> float | None:
    """The dense bf16 peak (FLOP/s) of the GPU torch calls ``device_name``, from ``GPU_BF16_PEAK``; None if unknown."""
    return next((flops for key, flops in GPU_BF16_PEAK.items() if key in device_name), None)


def model_flops_utilization(tokens_per_s: float, flops_per_token: float, peak_flops: float, devices: int) -> float:
    """MFU per device: the model FLOPs the whole job does per second (its ``tokens_per_s`` over all ranks times
    ``flops_per_token``) over what its ``devices`` together could do at ``peak_flops`` each. Dividing by one
    device's peak would report N times the figure on N ranks (each rank computes a share of every token)."""
    return tokens_per_s * flops_per_token / (peak_flops * devices)


def keep_freed_memory(device_type: str) -> bool:
    """On a ``device_type`` of "cpu", have glibc's malloc keep freed memory for reuse instead of handing it back
    to the OS (a GPU run's activations live in CUDA's own caching allocator: nothing to do there).

    A training step frees its activations in backward and allocates them again in the next forward. glibc
    serves allocations from about 128 KiB up (the activations of any real model) with fresh ``mmap``s, or
    trims its heap once the top is free, so every step's activations started as untouched pages: thousands of
    page faults per step, each an interrupt and a page zeroed (up to about 0.3 ms for a 3 MB tensor whose
    computation takes 0.05 ms). With allocations up to 32 MiB (glibc's largest setting) kept in the heap and
    no trimming, the process keeps its peak and reuses it, as PyTorch's CUDA caching allocator does on a GPU;
    PyTorch's CPU performance guide suggests jemalloc or TCMalloc for the same reason. The ``moe-8x`` CPU
    step ran 3-4% faster (``benchmarks/train_step.py``, alternating runs). Returns whether it was applied
    (on CPU with glibc on Linux only). Settings the environment already gives glibc win: with any
    ``MALLOC_*_`` variable or ``GLIBC_TUNABLES`` set the allocator is left alone (``benchmarks/large_model.py``
    asks for the opposite, every large tensor returned when freed, so that the resident peak tracks the live
    tensors).
    """
    if (device_type != "cpu" or not sys.platform.startswith("linux") or "GLIBC_TUNABLES" in os.environ
            or any(name.startswith("MALLOC_") and name.endswith("_") for name in os.environ)):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # another C library (musl): leave its allocator alone
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # malloc.h
    return bool(libc.mallopt(m_mmap_threshold, 32 << 20)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.15) -> float:
    """Peak FLOP/s of a square matmul on this device: from the fastest of repeated timed calls.

    The fastest call is the one other processes disturbed least, so the figure (and the precision
    chosen from it) holds on a shared machine too; an average over a stalled interval once made
    bf16 look 0.0x as fast as fp32 here.
    """
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    a @ b  # warm-up: oneDNN picks and JIT-compiles its kernel on the first call
    fastest, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < seconds or fastest == math.inf:
        began = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        fastest = min(fastest, time.perf_counter() - began)
    return 2.0 * size**3 / fastest


def auto_precision(device_type: str, bf16_speedup: float | None = None) -> str:
    """The one rule for ``train.precision: auto``: bf16 on a GPU (every bf16-capable one: Ampere and newer); on
    a CPU bf16 only where its matmuls run at least ``BF16_SPEEDUP_THRESHOLD`` times fp32 (``bf16_speedup``,
    measured: it depends on AMX / AVX-512-BF16 and the oneDNN build, and a CPU without them emulates bf16 and
    runs it slower than fp32)."""
    if device_type == "cuda":
        return "bf16"
    if bf16_speedup is None:
        raise ValueError("auto_precision on a CPU needs its measured bf16 speedup (choose_precision measures it)")
    return "bf16" if bf16_speedup >= BF16_SPEEDUP_THRESHOLD else "fp32"


def planned_precision(requested: str, device_type: str = "cuda") -> str:
    """The precision ``train.precision`` means on a device of ``device_type``, by the same rule as the run's
    (``auto_precision``): ``auto`` is bf16 for a GPU, which the planning tools assume without one to ask;
    for a CPU, this machine's is measured (``choose_precision``), as the run itself will measure it."""
    if requested != "auto":
        return requested
    if device_type == "cuda":
        return auto_precision("cuda")
    return choose_precision(requested, torch.device("cpu")).precision


def choose_precision(requested: str, device: torch.device) -> PrecisionChoice:
    """Resolve ``train.precision`` on ``device`` (``auto_precision``), with its matmul peak for MFU.

    A GPU's peak is its datasheet's where known; a CPU's, or an unknown GPU's, is measured here.
    """
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        bf16_ok = torch.cuda.is_bf16_supported()
        precision = requested if requested != "auto" else (auto_precision("cuda") if bf16_ok else "fp32")
        peak = datasheet_bf16_peak(name)
        if peak is not None and precision == "bf16":
            return PrecisionChoice(precision, f"{name}: bf16 tensor cores", peak, "datasheet")
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        return PrecisionChoice(precision, name, measure_matmul_flops(device, dtype, size=4096), "measured")

    if requested != "auto":  # only the MFU peak is needed: measure the requested precision alone
        # (an emulated bf16 matmul takes seconds on a CPU without AVX-512-BF16 or AMX)
        dtype = torch.bfloat16 if requested == "bf16" else torch.float32
        return PrecisionChoice(requested, "requested", measure_matmul_flops(device, dtype), "measured")
    fp32 = measure_matmul_flops(device, torch.float32)
    bf16 = measure_matmul_flops(device, torch.bfloat16)
    speedup = bf16 / fp32
    precision = auto_precision("cpu", speedup)
    reason = f"auto: bf16 matmuls run {speedup:.1f}x fp32 here (threshold {BF16_SPEEDUP_THRESHOLD}x)"
    return PrecisionChoice(precision, reason, bf16 if precision == "bf16" else fp32, "measured")


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory so far: CUDA's peak allocated bytes on a GPU, peak resident memory on a CPU.

    The CPU figure (``getrusage``'s maximum resident set) counts everything the process touched, the
    interpreter and torch's libraries too (a few hundred MiB), so it bounds the training state from above.
    """
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def gather_per_rank(mine: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``mine`` (as many integers on each), in rank order: one collective over the default group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [list(mine)]
    local = torch.tensor(mine, dtype=torch.int64, device=device)  # NCCL takes device tensors
    # all_gather into a list: torch 2.13 deprecates all_gather_into_tensor with a FutureWarning that every rank
    # printed at every log line, and its replacement does not exist in the older torch that pyproject allows
    every = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(every, local)
    return [[int(value) for value in values] for values in every]


def check_hardware(config, device_type: str) -> None:
    """Refuse, before any work, a config that this machine cannot run (a ConfigError saying why and what to do).

    ``device_type`` is where the run would compute: "cuda" when torch sees a GPU, else "cpu". Each option that
    needs particular hardware or software checks it here, so ``train.py`` and ``launch.py`` refuse it before a
    process group, a run directory or a tensor exists.
    """
    if config.train.device == "cuda" and device_type != "cuda":
        raise ConfigError(f"config '{config.name}' is sized for a GPU (train.device=cuda) and torch sees no CUDA GPU "
                          "here: run it on a GPU machine, or pick a CPU config such as moe-8x (--set "
                          "train.device=auto runs it here anyway)")
    check_backend(config.moe.backend, device_type)
    if config.model.linear_attention:
        check_linear_backend(config.model.linear_backend, device_type)
    if config.parallel.activation_offload != "none" and device_type != "cuda":
        raise ConfigError(f"parallel.activation_offload={config.parallel.activation_offload} moves activations from "
                          "GPU memory to pinned host memory, and this run has no GPU (on a CPU they are in host memory "
                          "already): set parallel.activation_offload=none, or parallel.activation_checkpointing to "
                          "save memory here")
    if config.train.compile:
        reason = compile_unavailable(device_type)
        if reason is not None:
            raise ConfigError(f"train.compile=true: {reason}; or set train.compile=false")
