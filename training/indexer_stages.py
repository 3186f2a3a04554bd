"""The lightning indexers' two training stages (DeepSeek-V3.2 technical report, sec. 2.1.1), for every attention kind
with an indexer (``moe.attention.indexer.IndexedAttention``: DeepSeek-V3.2's and GLM-5's sparse latent attention,
DeepSeek-V4's compressed sparse attention, whose report gives no other recipe).

The dense warm-up (the first ``train.indexer_warmup_steps`` steps): attention stays dense and only the lightning
indexers learn, from their KL loss against the main attention (``moe.attention.indexer.indexer_loss``); every other
weight is frozen. The sparse stage (every step after): attention runs over the selected keys and every weight learns,
the indexers from their loss alone (their inputs are detached in the model), the rest from the language-model loss.

The stage is a function of the step, so a run resumed on either side of the change is in the stage it left. Freezing
is done on the gradients, not on ``requires_grad`` (which FSDP and the pipeline fix when they wrap the model): the
frozen weights' gradients are dropped after backward, so the optimizer (AdamW and Muon skip a parameter without a
gradient: no update, no weight decay) and the gradient-norm clip see the indexers' alone. A checkpoint must still
hold every parameter's optimizer state (the loader expects one per parameter), so a run with a warm-up starts its
optimizer's state for every parameter at once (``start_optimizer_state``), in the state a first step would find.
"""

from __future__ import annotations

import torch
from torch import nn

from moe.attention.indexer import IndexedAttention


def sparse_attention_layers(model: nn.Module) -> list[IndexedAttention]:
    """The model's attention modules of a kind with an indexer (this rank's, under pipeline parallelism)."""
    return [module for module in model.modules() if isinstance(module, IndexedAttention)]


def in_dense_warmup(step: int, warmup_steps: int) -> bool:
    """Whether optimizer step ``step`` (from 1) belongs to the dense warm-up."""
    return step <= warmup_steps


def set_indexer_stage(layers: list[IndexedAttention], dense_warmup: bool) -> None:
    """Attention dense (the warm-up) or over the selected keys (the sparse stage) in every layer with an indexer."""
    for layer in layers:
        layer.dense_warmup = dense_warmup


def drop_frozen_gradients(model: nn.Module, layers: list[IndexedAttention]) -> None:
    """The warm-up's freeze: every gradient but the indexers' (of ``layers``, the model's layers with an indexer
    kind; GLM-5's shared-selection layers have none; V4's CSA indexer's own compressor is its) set to None, after
    backward and before the clip."""
    indexers = {id(param) for layer in layers if layer.indexer is not None for param in layer.indexer.parameters()}
    for param in model.parameters():
        if id(param) not in indexers:
            param.grad = None


def indexer_loss(layers: list[IndexedAttention]) -> torch.Tensor | None:
    """The latest training forward's indexer loss, the mean over this rank's layers with an indexer (None without
    any)."""
    losses = [layer.last_indexer_loss for layer in layers if layer.last_indexer_loss is not None]
    return torch.stack(losses).mean() if losses else None


def start_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Every parameter's optimizer state as a first step finds it: one step at learning rate 0 on zero gradients
    makes the state (zero moments and buffers: no weight moves, decoupled decay included), then each step count
    goes back to 0. The state is then what the optimizer would have made lazily at its first real step."""
    params = [param for group in optimizer.param_groups for param in group["params"] if param.grad is None]
    for param in params:
        param.grad = torch.zeros_like(param)
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    for param in params:
        param.grad = None
    for state in optimizer.state.values():
        if "step" in state:
            state["step"] = torch.zeros_like(state["step"]) if torch.is_tensor(state["step"]) else 0
