"""Activation checkpointing: keep fewer activations for backward and recompute the rest.

``parallel.activation_checkpointing`` picks what is recomputed:

- ``none``: everything forward saves is kept (fastest, most memory).
- ``full``: each transformer block keeps only its input; backward re-runs the block.
- ``moe``: only the MoE layers (router, permutation, experts, combine) are re-run. Their
  expert activations, k·T rows of the expert hidden size each, are what grows with
  top-k and expert width; attention keeps its activations. Under expert parallelism the
  recompute repeats the layer's all-to-alls, the price of not storing what they brought.

The recompute is torch's non-reentrant ``torch.utils.checkpoint`` on the module's own
forward, installed on the instance so parameter names and ``model.moe_layers()`` stay as
they are (no wrapper module in the state dict). The RNG state is restored for the recompute,
so router jitter draws the same noise and the recomputed routing equals the original; the
aux losses are injected once (their autograd node belongs to the original graph). Apply it
before FSDP, whose pre-backward hook gathers a block's parameters before its recompute runs.
"""

from __future__ import annotations

from functools import partial

from torch import nn
from torch.utils.checkpoint import checkpoint

from moe.transformer import MoETransformer

MODES = ("none", "full", "moe")


def _checkpoint_forward(module: nn.Module) -> None:
    module.forward = partial(checkpoint, module.forward, use_reentrant=False)


def apply_activation_checkpointing(model: MoETransformer, mode: str) -> None:
    """Make the blocks (``full``) or the MoE layers (``moe``) of ``model`` recompute in backward, in place."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode '{mode}' is not one of {', '.join(MODES)}")
    if mode == "full":
        for block in model.blocks():
            _checkpoint_forward(block)
    elif mode == "moe":
        for layer in model.moe_layers().values():
            _checkpoint_forward(layer)
