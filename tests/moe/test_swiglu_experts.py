"""``moe.swiglu_experts``: autograd's composition of the SwiGLU experts to the bit, keeping what it keeps, on
workspace buffers that are never overwritten while a graph still needs them."""

import pytest
import torch
import torch.nn.functional as F

from moe import workspace
from moe.experts import swiglu
from moe.swiglu_experts import swiglu_experts

COUNTS = [5, 0, 9, 2]  # an empty group included
D, H = 16, 24


@pytest.fixture(autouse=True)
def pool(monkeypatch):
    """Every storage of 1 KiB or more goes through a fresh workspace, so the tiny shapes here exercise it."""
    fresh = workspace.Workspace()
    monkeypatch.setattr(workspace, "MIN_BYTES", 1024)
    monkeypatch.setattr(workspace, "_CPU_WORKSPACE", fresh)
    return fresh


def composition(x, counts, w_gate, w_in, w_out):
    """The reference: torch's grouped_mm and autograd, as ``expert_ffn`` computes the experts elsewhere."""
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    gate = F.grouped_mm(x, w_gate, offs=offsets)
    up = F.grouped_mm(x, w_in, offs=offsets)
    return F.grouped_mm(swiglu(gate, up), w_out, offs=offsets)


def inputs(dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    rows = sum(COUNTS)
    x = torch.randn(rows, D, generator=generator).to(dtype).requires_grad_(True)
    weights = [(torch.randn(len(COUNTS), *shape, generator=generator) / 4).to(dtype).requires_grad_(True)
               for shape in ((D, H), (D, H), (H, D))]
    grad = torch.randn(rows, D, generator=generator).to(dtype)
    return x, weights, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_and_gradients_equal_autograds_to_the_bit(dtype, pool):
    counts = torch.tensor(COUNTS)
    for step in range(2):  # the second step runs on the first one's kept buffers
        x, weights, grad = inputs(dtype, seed=step)
        ours = swiglu_experts(x, counts, *weights)
        our_grads = torch.autograd.grad(ours, (x, *weights), grad)
        reference = composition(x, counts, *weights)
        ref_grads = torch.autograd.grad(reference, (x, *weights), grad)
        assert torch.equal(ours, reference)
        for mine, theirs in zip(our_grads, ref_grads, strict=True):
            assert torch.equal(mine, theirs)
    assert pool.storages()  # the buffers came from the workspace


def saved_bytes(function, *args):
    storages = {}

    def pack(tensor):
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function(*args)
    return sum(storages.values())


def test_it_saves_what_autograds_composition_saves_but_the_group_offsets():
    """What the memory model counts: x, gate, silu(gate), up, the product, and the weights; the group sizes are
    held on the host, where the composition saves int32 offsets (one tensor here, shared by its three GEMMs)."""
    x, weights, _ = inputs(torch.float32)
    counts = torch.tensor(COUNTS)
    offsets = len(COUNTS) * 4
    assert saved_bytes(swiglu_experts, x, counts, *weights) + offsets == saved_bytes(composition, x, counts, *weights)


def test_graphs_in_flight_keep_their_buffers():
    """Two micro-batches' forwards before either backward (gradient accumulation, a pipeline), and a graph
    kept for a second backward: every gradient equals one computed alone."""
    counts = torch.tensor(COUNTS)
    (x1, weights, grad1), (x2, _, grad2) = inputs(torch.float32, seed=1), inputs(torch.float32, seed=2)
    alone1 = torch.autograd.grad(composition(x1, counts, *weights), (x1, *weights), grad1)
    alone2 = torch.autograd.grad(composition(x2, counts, *weights), (x2, *weights), grad2)
    out1, out2 = swiglu_experts(x1, counts, *weights), swiglu_experts(x2, counts, *weights)
    for out, x, grad, alone in ((out2, x2, grad2, alone2), (out1, x1, grad1, alone1)):
        first = torch.autograd.grad(out, (x, *weights), grad, retain_graph=True)
        swiglu_experts(x2, counts, *weights).sum()  # another forward in between takes buffers too
        second = torch.autograd.grad(out, (x, *weights), grad)
        for a, b, c in zip(first, second, alone, strict=True):
            assert torch.equal(a, c) and torch.equal(b, c)
