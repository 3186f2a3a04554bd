"""Attention on a GPU takes ``scaled_dot_product_attention``'s flash path in bf16, and a context-parallel rank's
chunks attend as one process does.

Two checks of the kernel: restricted to the flash backend alone, the model's attention runs forward and backward
(SDPA raises "No available kernel" where flash cannot take the inputs: dtype, head dim, GQA, masks); and
unrestricted, the profiler sees a flash kernel run, so the default choice is flash too.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile

from moe.sequence_shards import SequenceShards
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


@pytest.mark.parametrize("cp, kv_heads", [(2, 4), (4, 2)])
def test_context_parallel_chunks_attend_as_one_process_on_the_gpu(cp, kv_heads):
    """``SequenceShards.causal_attention``'s GPU branch (one SDPA per chunk under a lower-right causal mask, keys
    put back in position order) against one process's causal attention: each rank's output rows and the gradients
    of its queries and of the gathered keys and values are the full sequence's, in bf16 within its rounding."""
    seq, generator = 64, torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, heads, seq, 32, device="cuda", generator=generator).bfloat16().requires_grad_()
               for heads in (4, kv_heads, kv_heads))
    grad = torch.randn(2, 4, seq, 32, device="cuda", generator=generator).bfloat16()
    F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=kv_heads != 4).backward(grad)
    expected = [t.grad for t in (q, k, v)]
    with torch.no_grad():
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=kv_heads != 4)
    key_grads = [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
    for rank in range(cp):
        shards = SequenceShards(cp, rank)
        mine, keys = shards.positions(seq, "cuda"), shards.key_positions(seq, "cuda")
        queries = q.detach()[:, :, mine].requires_grad_()
        gathered = [t.detach()[:, :, keys].requires_grad_() for t in (k, v)]  # as the all-gather gives them
        out = shards.causal_attention(queries, *gathered, scale=0.2)
        torch.testing.assert_close(out, full[:, :, mine], rtol=2e-2, atol=2e-2)
        out.backward(grad[:, :, mine])
        torch.testing.assert_close(queries.grad, expected[0][:, :, mine], rtol=2e-2, atol=2e-2)
        for total, part in zip(key_grads, gathered, strict=True):  # the gather's backward sums the ranks'
            total[:, :, keys] += part.grad.float()
    for total, reference in zip(key_grads, expected[1:], strict=True):
        torch.testing.assert_close(total, reference.float(), rtol=3e-2, atol=3e-2)
