"""``keep_freed_memory``: freed memory is reused rather than faulted in again (a fresh process each case)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from parallel.hardware import datasheet_bf16_peak, keep_freed_memory, model_flops_utilization

ROOT = Path(__file__).resolve().parents[2]

# Allocate and free twenty 3 MiB tensors twice; print the page faults of the second round.
SCRIPT = """
import resource, sys, torch
sys.path.insert(0, {root!r})
from parallel.hardware import datasheet_bf16_peak, keep_freed_memory, model_flops_utilization
if {keep}:
    assert keep_freed_memory("cpu")
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(2):
    before = faults()
    tensors = [torch.ones(768 * 1024) for _ in range(20)]
    del tensors
print(faults() - before)
"""


def second_round_faults(keep: bool) -> int:
    env = {name: value for name, value in os.environ.items()
           if not name.startswith("MALLOC_") and name != "GLIBC_TUNABLES"}
    run = subprocess.run([sys.executable, "-c", SCRIPT.format(root=str(ROOT), keep=keep)], capture_output=True,
                         text=True, check=True, timeout=120, env=env)
    return int(run.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings: Linux only")
def test_freed_activations_are_reused_not_faulted_in_again():
    pages = 20 * 3 * 2**20 // 4096
    assert second_round_faults(keep=False) > pages // 2  # glibc's default hands the memory back: faults again
    # kept: the second round reuses most of the first's pages. Some whole tensors (768 pages each) land in fresh
    # memory all the same: 0 to 2 of the 20 in a lone run here, 5 (3,840 pages) inside a full suite run, where
    # bounds of a tenth and a quarter each failed once; so the bound is half, which the 15,360 faults of glibc's
    # default (and of a keep_freed_memory that did nothing) still fail by twice. Why some tensors miss: not known.
    assert second_round_faults(keep=True) < pages // 2


def test_an_allocator_setting_from_the_environment_wins(monkeypatch):
    """``benchmarks/large_model.py`` runs train.py with ``MALLOC_MMAP_THRESHOLD_`` set; a GPU run needs nothing."""
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert not keep_freed_memory("cpu")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    assert not keep_freed_memory("cuda")


def test_the_datasheet_peak_tells_the_h100_variants_apart():
    names = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
             "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA H800": 989e12, "NVIDIA H800 PCIe": 756e12,
             "NVIDIA A100-SXM4-80GB": 312e12,
             "NVIDIA A10": 125e12, "NVIDIA GeForce RTX 4090": None}
    assert {name: datasheet_bf16_peak(name) for name in names} == names


def test_mfu_is_a_per_device_figure():
    # 1,000 tokens/s of a 1e9-FLOP token is 1e12 FLOP/s: half of one 2e12 device, a quarter of two
    assert model_flops_utilization(1000.0, 1e9, 2e12, devices=1) == 0.5
    assert model_flops_utilization(1000.0, 1e9, 2e12, devices=2) == 0.25
