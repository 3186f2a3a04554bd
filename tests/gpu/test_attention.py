"""Attention on a GPU takes ``scaled_dot_product_attention``'s flash path in bf16.

Two checks: restricted to the flash backend alone, the model's attention runs forward and backward (SDPA raises
"No available kernel" where flash cannot take the inputs: dtype, head dim, GQA, masks); and unrestricted, the
profiler sees a flash kernel run, so the default choice is flash too.
"""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from tests.gpu.helpers import batch, moe_8x


@pytest.mark.parametrize("overrides", [[], ["model.n_kv_heads=2"]], ids=["mha", "gqa"])
def test_attention_runs_on_the_flash_backend(overrides):
    model, config = moe_8x("cuda", *overrides)
    inputs, _ = batch(config, "cuda")
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]), torch.autocast("cuda", dtype=torch.bfloat16):
        model(inputs).float().mean().backward()
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.autocast("cuda", dtype=torch.bfloat16):
        model(inputs).float().mean().backward()
    kernels = [event.key for event in prof.key_averages()]
    assert any("flash" in name.lower() for name in kernels), f"no flash kernel among {kernels}"
