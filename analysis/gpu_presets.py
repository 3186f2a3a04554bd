"""GPU node presets for the planning tools: link bandwidths, peak FLOP/s, memory and HBM bandwidth, each figure's
source named beside it, NCCL's latencies and efficiencies, and the ``--gpu`` flags that choose a preset.

The communication model prices its traffic with them (``analysis.link_time``), the step-time estimate its compute
(``analysis.step_time``); ``train.py`` lists them for its start-up fit check.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass

from config.errors import ConfigError


@dataclass(frozen=True)
class Latency:
    """What a collective costs before its first byte counts: seconds per call, and per ring step on each link.

    A ring collective of n ranks runs 2(n − 1) steps (all-reduce) or n − 1 (all-gather, reduce-scatter), each
    waiting for the previous rank's chunk; the steps that cross to another node wait on the network
    (``startup``).
    """

    call: float  # seconds per call (launch and set-up)
    intra_step: float  # seconds per ring step inside a node
    inter_step: float  # seconds per ring step that crosses nodes


# NCCL's own cost model of a ring collective in the Simple protocol, the one it picks for the large messages of
# training (NVIDIA/nccl src/graph/tuning.cc, ncclTopoTuneModel: baseLat Ring/Simple 8.4 us per call, hwLat
# Ring/Simple 3.4 us per step on NVLink and 9.6 us per step on the network; latency = baseLat + (nsteps −
# nInterSteps)·intra + nInterSteps·inter, nsteps 2(n − 1) for all-reduce, n − 1 for all-gather and
# reduce-scatter).
NCCL_LATENCY = Latency(8.4e-6, 3.4e-6, 9.6e-6)

# What NCCL gets of NVLink's line rate: "with the protocol overhead (~20%) NCCL can get an effective NVLink
# bandwidth of 370GB/s" of H100's 450 (S. Jeaugey, NCCL's maintainer, NVIDIA/nccl-tests issue #212, 2024).
NCCL_EFFICIENCY = 0.8

# How much slower the matmuls run while FSDP's collectives run beside them (NCCL's kernels hold SMs and HBM
# bandwidth the matmuls would use), per second of overlapped traffic. Calibrated once from the ZeRO-3 rows of
# Narayanan et al. 2021 Table 2 whose compute outlasts their traffic (175B on 384 A100s, 530B on 640):
# ``analysis.published_layouts.calibrated_overlap_slowdown``; taken for every GPU.
OVERLAP_SLOWDOWN = 0.28

# What a rank's traffic across nodes gets of its own network adapter's line rate, calibrated once from the
# ZeRO-3 rows of Narayanan et al. 2021 Table 2 (``analysis.published_layouts.calibrated_network_efficiency``:
# the mean over the four rows whose step did not shrink with more GPUs, their FSDP bytes over their step less
# NCCL's latency); nccl-tests across nodes measure the same order (86 of 96 GB/s, NVIDIA/nccl issue #1048).
NETWORK_EFFICIENCY = 0.92


@dataclass(frozen=True)
class Hardware:
    """One kind of node: link bandwidths (bytes/s, one direction, per device), dense peak FLOP/s in ``precision``
    (the datasheet's bf16 for the GPUs), memory per device, and the collectives' latencies."""

    name: str
    gpus_per_node: int
    intra_node: float
    inter_node: float
    bf16_flops: float
    memory_gib: float  # nominal (the datasheet's GB)
    memory_bandwidth: float  # HBM bytes/s (the roofline of the planner's matmuls)
    source: str
    latency: Latency = NCCL_LATENCY
    precision: str = "bf16"  # what the planner trains in here: the bytes its traffic carries
    sharing: float = 1.0  # a rank's compute alone over its share when all run: above 1 where ranks share CPU cores
    overlap_slowdown: float = OVERLAP_SLOWDOWN  # compute's slowdown per second of collectives beside it
    network_efficiency: float = NETWORK_EFFICIENCY  # the share of its adapter's line rate a rank's traffic gets
    intra_efficiency: float = NCCL_EFFICIENCY  # the share of ``intra_node`` collectives get (1: measured so)


# Datasheet figures. NVLink totals are quoted for both directions together: one direction is half. The network
# is one adapter per GPU as the vendors' 8-GPU reference systems have it (DGX A100: 200 Gb/s HDR, 25 GB/s each
# way; DGX H100/H200/B200: 400 Gb/s, 50 GB/s). Peaks are dense bf16 tensor-core FLOP/s, without sparsity. HBM
# bandwidth from the same datasheets: A100 40GB 1,555 GB/s, 80GB 2,039 GB/s; H100 and H800 SXM 3.35 TB/s; H200
# 4.8 TB/s; B200 8 TB/s (HGX B200: 64 TB/s for 8 GPUs).
HARDWARE = {
    # NVIDIA A100 Tensor Core GPU datasheet: NVLink 3 600 GB/s, bf16 312 TFLOP/s, 40 or 80 GB; DGX A100 user
    # guide: 8 single-port 200 Gb/s HDR InfiniBand adapters for the compute fabric
    "a100-40gb": Hardware("A100 SXM4 40GB, NVLink 3, HDR InfiniBand", 8, 300e9, 25e9, 312e12, 40, 1555e9,
                          "NVIDIA A100 datasheet; DGX A100 user guide"),
    "a100-80gb": Hardware("A100 SXM4 80GB, NVLink 3, HDR InfiniBand", 8, 300e9, 25e9, 312e12, 80, 2039e9,
                          "NVIDIA A100 datasheet; DGX A100 user guide"),
    # NVIDIA H100 Tensor Core GPU datasheet (SXM5): NVLink 4 900 GB/s, bf16 989 TFLOP/s (1979 with sparsity),
    # 80 GB; one 400 Gb/s NDR InfiniBand adapter per GPU
    "h100": Hardware("H100 SXM5, NVLink 4, NDR InfiniBand", 8, 450e9, 50e9, 989e12, 80, 3350e9,
                     "NVIDIA H100 Tensor Core GPU datasheet"),
    # H800 SXM5: the H100's compute with NVLink cut to 400 GB/s (NVIDIA's H800 specifications); DeepSeek-V3's
    # report (arXiv:2412.19437 sec. 3.2.2) measures about 160 GB/s of NVLink and 50 GB/s of InfiniBand per GPU
    "h800": Hardware("H800 SXM5, NVLink 400 GB/s, NDR InfiniBand", 8, 200e9, 50e9, 989e12, 80, 3350e9,
                     "NVIDIA H800 specifications; DeepSeek-V3 technical report sec. 3.2.2"),
    # NVIDIA H200 Tensor Core GPU datasheet: the H100's compute and NVLink 4, 141 GB of HBM3e
    "h200": Hardware("H200 SXM, NVLink 4, NDR InfiniBand", 8, 450e9, 50e9, 989e12, 141, 4800e9,
                     "NVIDIA H200 Tensor Core GPU datasheet"),
    # NVIDIA HGX B200 / DGX B200 specifications: NVLink 5 1.8 TB/s per GPU, bf16 2.25 PFLOP/s dense (4.5 with
    # sparsity), 1,440 GB for 8 GPUs, 400 Gb/s ConnectX-7 per GPU
    "b200": Hardware("B200, NVLink 5, 400 Gb/s InfiniBand", 8, 900e9, 50e9, 2250e12, 180, 8000e9,
                     "NVIDIA HGX B200 and DGX B200 specifications"),
}


def add_hardware_arguments(parser: argparse.ArgumentParser) -> None:
    """``--gpu`` (a preset of ``HARDWARE``) and overrides of its figures, for the analysis CLIs."""
    parser.add_argument("--gpu", default="h100", choices=list(HARDWARE), help="the GPU node's preset (default h100)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the preset's, 8)")
    parser.add_argument("--nvlink-gbps", type=float, default=None, metavar="GB/S",
                        help="override: NVLink bandwidth per GPU, one direction")
    parser.add_argument("--network-gbps", type=float, default=None, metavar="GB/S",
                        help="override: network bandwidth per GPU, one direction")
    parser.add_argument("--peak-tflops", type=float, default=None, metavar="TFLOP/S",
                        help="override: dense bf16 peak per GPU")


def hardware_from_args(args: argparse.Namespace, memory_gib: float | None = None) -> Hardware:
    """The ``--gpu`` preset with the CLI's overrides (``memory_gib``: a ``--device-memory`` given)."""
    return hardware_with(args.gpu, args.gpus_per_node, args.nvlink_gbps, args.network_gbps, args.peak_tflops,
                         memory_gib)


def hardware_with(name: str, gpus_per_node: int | None = None, nvlink_gbps: float | None = None,
                  network_gbps: float | None = None, peak_tflops: float | None = None,
                  memory_gib: float | None = None) -> Hardware:
    """The preset ``name`` with any figure overridden (GB/s one direction per GPU, TFLOP/s, GiB)."""
    if name not in HARDWARE:
        raise ConfigError(f"--gpu {name!r} is not a preset; valid: {', '.join(HARDWARE)}")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node must be at least 1, got {gpus_per_node}")
    figures = {("--nvlink-gbps", "GB/s"): nvlink_gbps, ("--network-gbps", "GB/s"): network_gbps,
               ("--peak-tflops", "TFLOP/s"): peak_tflops, ("--device-memory", "GiB"): memory_gib}
    for (flag, unit), value in figures.items():
        if value is not None and not 0 < value < math.inf:  # NaN fails this too
            raise ConfigError(f"{flag} must be a positive number of {unit}, got {value}")
    overrides = {"gpus_per_node": gpus_per_node, "intra_node": nvlink_gbps and nvlink_gbps * 1e9,
                 "inter_node": network_gbps and network_gbps * 1e9, "bf16_flops": peak_tflops and peak_tflops * 1e12,
                 "memory_gib": memory_gib}
    return dataclasses.replace(HARDWARE[name], **{k: v for k, v in overrides.items() if v is not None})

