"""Activation offloading on a GPU: the gradients of offloaded blocks are those without offloading (the copies
are exact: all gradients together differ no more than two runs without offloading differ from each other,
CUDA's atomic adds in some backward kernels summing in varying order), and the device's peak memory falls.

Step time and memory beside activation checkpointing's are printed (``-s``; scripts/gpu_check.sh keeps the log)
rather than asserted: they are measurements, not pass/fail."""

import time

import pytest
import torch

from analysis.memory_activations import micro_batch_activations
from parallel.activation_checkpoint import apply_activation_checkpointing
from parallel.activation_offload import apply_activation_offload
from parallel.resolve import resolve_layout
from parallel.tensor import lm_loss
from tests.gpu.helpers import batch, moe_8x

SHAPE = ["model.d_model=1024", "model.n_heads=16", "model.n_layers=4", "model.seq_len=2048",
         "moe.expert_hidden=2816", "moe.capacity_factor=null", "train.precision=bf16"]


def step(setting: str):
    """Forward + backward of a 4-block, d_model 1024 MoE on 4 × 2048 tokens: gradients, peak bytes, seconds."""
    mode, value = setting.split("=")
    model, config = moe_8x("cuda", *SHAPE, f"parallel.{mode}={value}")
    if mode == "activation_offload":
        apply_activation_offload(model, value)
    else:
        apply_activation_checkpointing(model, value)
    inputs, targets = batch(config, "cuda", sequences=4)
    seconds = []
    for _ in range(3):  # the first allocates the caches and pinned blocks
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        began = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = lm_loss(model(inputs), targets)
        loss.backward()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
    grads = [p.grad.clone() for p in model.parameters()]
    return grads, torch.cuda.max_memory_allocated() - base, min(seconds), config


def difference(tensors, others) -> float:
    """The norm of the difference of two lists of tensors, as one vector."""
    return torch.stack([(a.float() - b.float()).norm() for a, b in zip(tensors, others, strict=True)]).norm().item()


@pytest.mark.parametrize("mode", ["blocks", "moe"])
def test_offloading_keeps_gradients_and_lowers_peak_memory(mode):
    reference, peak, seconds, config = step("activation_offload=none")
    again, _, _, _ = step("activation_offload=none")
    grads, offloaded_peak, offloaded_seconds, offloaded_config = step(f"activation_offload={mode}")
    # over all gradients at once: a per-tensor noise norm of a small tensor (a norm's weight) is too few samples
    noise, error = difference(again, reference), difference(grads, reference)
    assert error <= 2 * noise + 1e-6 * difference(reference, [torch.zeros_like(g) for g in reference]), \
        f"offloaded gradients differ by {error:.3g}, two runs without offloading by {noise:.3g}"
    assert offloaded_peak < peak
    layout = resolve_layout(config, 1)[0]
    predicted_saving = (sum(micro_batch_activations(config, layout, 4, "bf16").values())
                        - sum(micro_batch_activations(offloaded_config, layout, 4, "bf16").values()))
    _, recompute_peak, recompute_seconds, _ = step(f"activation_checkpointing={'full' if mode == 'blocks' else 'moe'}")
    print(f"\noffload {mode}: peak {offloaded_peak / 2**30:.2f} GiB vs {peak / 2**30:.2f} GiB "
          f"(saved {(peak - offloaded_peak) / 2**30:.2f}, memory model {predicted_saving / 2**30:.2f}), "
          f"step {offloaded_seconds / seconds:.2f}x; recompute: peak {recompute_peak / 2**30:.2f} GiB, "
          f"step {recompute_seconds / seconds:.2f}x")
