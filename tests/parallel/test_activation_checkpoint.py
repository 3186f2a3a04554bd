"""Activation checkpointing recomputes exactly what it dropped: same loss, aux losses and gradients, less kept."""

import pytest
import torch
import torch.nn.functional as F

from config.model import ModelConfig, MoEConfig
from moe.documents import document_ids
from moe.transformer import MoETransformer
from parallel.activation_checkpoint import apply_activation_checkpointing

MODEL = ModelConfig(vocab_size=256, d_model=32, n_layers=3, n_heads=4, seq_len=16, ffn_hidden=64, moe_every=2)
END = 7  # the end-of-document token where documents are masked
MOE = MoEConfig(num_experts=4, top_k=2, expert_hidden=32, capacity_factor=1.0, jitter_eps=0.1,
                aux_loss_coef=0.01, z_loss_coef=0.001)


def _run(mode: str, documents: bool = False) -> tuple[float, dict[str, torch.Tensor], int]:
    """(loss, gradients, bytes saved for backward) of one forward + backward from fixed weights and RNG;
    ``documents``: packed documents masked from each other (every fifth token ends one)."""
    torch.manual_seed(0)
    model = MoETransformer(MODEL, MOE)
    apply_activation_checkpointing(model, mode)
    tokens = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(1))
    if documents:
        tokens[:, 3::5] = END
    saved = 0

    def pack(tensor):
        nonlocal saved
        saved += tensor.numel() * tensor.element_size()
        return tensor

    torch.manual_seed(2)  # router jitter draws from here; the recompute must draw the same noise
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(tokens[:, :-1], documents=document_ids(tokens[:, :-1], END) if documents else None)
    loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return float(loss.detach()), grads, saved


@pytest.mark.parametrize("mode, documents", [("full", False), ("moe", False), ("full", True)])
def test_recompute_gives_the_same_gradients_and_keeps_less(mode, documents):
    ref_loss, ref_grads, ref_saved = _run("none", documents)
    loss, grads, saved = _run(mode, documents)
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys()  # no wrapper in the parameter names
    for name, grad in grads.items():
        # the aux/z-loss gradients reach the router exactly once, as without recompute
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=0, msg=name)
    assert saved < ref_saved
    if mode == "full":
        # each block keeps little more than its input; the MoE-only mode sits in between
        _, _, moe_saved = _run("moe", documents)
        assert saved < moe_saved < ref_saved


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="'some' is not one of none, full, moe"):
        apply_activation_checkpointing(MoETransformer(MODEL, MOE), "some")
