"""Host-device synchronisations of a training step on one GPU, counted with ``torch.cuda.set_sync_debug_mode``.

Expected, per MoE layer and forward pass (one process; under expert parallelism the per-layer count exchange
adds its own): none when dropless; one with a capacity factor (how many assignments were kept sizes the
grouped tensor: ``plan_dispatch``'s boolean selection); one more with the megablocks backend (its cuBLAS
grouped GEMM reads the group sizes on the host). Backward adds none. The optimizer step as the loop runs it
adds two: the step's loss and gradient norm, read once each to decide whether to apply the update.
"""


import pytest
import torch

from moe.experts import megablocks_unavailable
from parallel.tensor import lm_loss
from tests.gpu.helpers import batch, host_syncs, moe_8x
from training.optim import build_optimizer
from training.step import IntervalStats, StepContext, train_step

CASES = {"dropless": (["moe.capacity_factor=null", "moe.backend=torch"], 0),
         "capacity": (["moe.backend=torch"], 1),
         "megablocks dropless": (["moe.capacity_factor=null", "moe.backend=megablocks"], 1)}


@pytest.mark.parametrize("case", CASES)
def test_syncs_per_moe_layer_in_forward_and_backward(case):
    overrides, per_layer = CASES[case]
    if "megablocks" in case and megablocks_unavailable("cuda"):
        pytest.skip(f"megablocks backend unavailable: {megablocks_unavailable('cuda')}")
    model, config = moe_8x("cuda", *overrides)
    inputs, targets = batch(config, "cuda")
    losses = []

    def forward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            losses.append(lm_loss(model(inputs), targets))

    def backward():
        losses.pop().backward()

    forward()  # warm-up: first calls may load kernels and sync once
    backward()
    forward_syncs, backward_syncs = host_syncs(forward), host_syncs(backward)
    expected = per_layer * config.model.n_moe_layers
    assert (len(forward_syncs), len(backward_syncs)) == (expected, 0), \
        f"host syncs: forward {forward_syncs}, backward {backward_syncs}; expected {expected} and none"


def test_syncs_of_a_whole_training_step():
    model, config = moe_8x("cuda", "moe.capacity_factor=null", "moe.backend=torch")
    optimizer = build_optimizer(model, config.train)
    inputs, targets = batch(config, "cuda", sequences=config.train.global_batch_size)

    context = StepContext(model, optimizer, inputs.shape[0], config.train.grad_clip,
                          lambda: torch.autocast("cuda", dtype=torch.bfloat16))

    def step():
        train_step(context, inputs, targets, IntervalStats())

    step()  # warm-up: the optimizer's state is created on the first step
    syncs = host_syncs(step)
    assert len(syncs) == 2, f"{len(syncs)} host syncs in a dropless step, expected 2 (loss, grad norm): {syncs}"


