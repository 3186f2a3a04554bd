"""The optimizer (AdamW with decoupled weight decay on matrices only, or Muon: ``training/muon.py``) and a
warmup + cosine learning-rate schedule."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from config.run import TrainConfig
from moe.experts import release_compute_copies
from moe.hidden_matrices import outside_hidden_matrices
from training.muon import Muon


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """``train.optimizer``'s optimizer for ``model``: AdamW (below) or Muon (``build_muon``).

    AdamW: matrices (and expert stacks) decay, vectors (norm gains, biases) do not (``decays``).

    Decaying norm gains pulls them toward zero, which only fights the normalisation
    (the convention of GPT-3 and nanoGPT). ``fused`` runs the whole update of a tensor in one
    kernel (CPU and CUDA): one pass over weights, gradients and moments, and no temporaries,
    where ``foreach`` makes a pass per elementwise op and a buffer the size of a group's
    second moments (on the CPU ``moe-8x`` step, 2.5 ms against 14.5 ms, caches flushed). It
    refuses to mix plain tensors and DTensors in one call (tensor parallelism shards some
    weights of a block and leaves the rest whole), so each of the two groups is split
    further by the weights' kind. The fused kernel writes the weights without bumping their
    version counters, so the experts' bf16 copies are dropped by a hook before each step
    rather than noticed as stale afterwards.
    """
    if config.optimizer == "muon":
        return build_muon(model, config)
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups.setdefault((decays(name, param), isinstance(param, DTensor)), []).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": params, "weight_decay": config.weight_decay if decay else 0.0}
         for (decay, _), params in sorted(groups.items(), key=lambda item: item[0], reverse=True)],
        lr=config.lr, betas=(config.beta1, config.beta2), fused=True)
    # the experts' bf16 copies go stale with the step; dropping them first also keeps them out of its peak
    optimizer.register_step_pre_hook(lambda *_: release_compute_copies(model))
    return optimizer


def decays(name: str, param: nn.Parameter) -> bool:
    """Whether weight decay applies to ``param``: matrices and expert stacks, not norm gains or biases (the
    routed experts' biases are ``[experts, width]``, a vector per expert, and decay no more than other biases)."""
    return param.dim() >= 2 and not name.endswith("bias")


def build_muon(model: nn.Module, config: TrainConfig) -> Muon:
    """Muon for the hidden matrices (attention projections, dense and shared-expert FFNs, each routed expert's
    matrices one expert at a time), AdamW for what ``moe.hidden_matrices.outside_hidden_matrices`` lists
    (embeddings, output head, router, norms and biases); only matrices decay, as under AdamW.

    Sharded matrices (DTensors: FSDP, tensor and expert tensor parallelism) are put back together for their
    orthogonalisation, once per step, by ``training.muon.orthogonalised``.
    """
    for_adamw = outside_hidden_matrices(model)
    groups = {"muon": [], "adamw_decay": [], "adamw_plain": []}
    for name, param in model.named_parameters():
        if param.requires_grad:
            kind = ("adamw_decay" if decays(name, param) else "adamw_plain") if id(param) in for_adamw else "muon"
            groups[kind].append(param)
    optimizer = Muon(
        [{"params": groups["muon"], "use_muon": True, "weight_decay": config.weight_decay},
         {"params": groups["adamw_decay"], "use_muon": False, "weight_decay": config.weight_decay},
         {"params": groups["adamw_plain"], "use_muon": False, "weight_decay": 0.0}],
        lr=config.lr, weight_decay=config.weight_decay, momentum=config.muon_momentum,
        nesterov=config.muon_nesterov, ns_steps=config.muon_ns_steps, update_rms=config.muon_update_rms,
        ns_dtype=torch.float32 if config.muon_ns_dtype == "fp32" else torch.bfloat16,
        betas=(config.beta1, config.beta2))
    optimizer.register_step_pre_hook(lambda *_: release_compute_copies(model))
    return optimizer


def learning_rate(step: int, config: TrainConfig) -> float:
    """LR for optimizer step ``step`` (1-based): linear warmup, then cosine decay to ``lr * min_lr_ratio``.

    A run shorter than its warmup simply warms up for all its steps.
    """
    warmup = min(config.warmup_steps, config.steps)
    if step <= warmup:
        return config.lr * step / warmup
    progress = (step - warmup) / max(1, config.steps - warmup)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    floor = config.lr * config.min_lr_ratio
    return floor + (config.lr - floor) * cosine


SCHEDULE_KEYS = ("steps", "warmup_steps", "lr", "min_lr_ratio")


def schedule_summary(config: TrainConfig) -> str:
    """The learning-rate curve in one phrase, for the start-up banner (``learning_rate``'s key points)."""
    warmup = min(config.warmup_steps, config.steps)
    if warmup >= config.steps:
        return f"lr rising linearly to {config.lr:.3g} over all {config.steps} steps (warmup is the whole run)"
    rise = f"linear warmup to {config.lr:.3g} over {warmup} steps, then " if warmup else f"lr {config.lr:.3g}, "
    return f"{rise}cosine decay to {learning_rate(config.steps, config):.3g} at step {config.steps}"


def warmup_note(config: TrainConfig) -> str | None:
    """What a run whose warmup is longer than the run does, said at its start (``learning_rate`` warms it up
    over all its steps: it never reaches ``train.lr`` until its last step, and never decays)."""
    if config.warmup_steps <= config.steps:
        return None
    return (f"schedule: train.warmup_steps={config.warmup_steps} is longer than train.steps={config.steps}, so "
            f"the whole run warms up: lr {learning_rate(1, config):.3g} at step 1 rising to {config.lr:.3g} at step "
            f"{config.steps}, with no decay; set train.warmup_steps below {config.steps} for a cosine decay")


def restretch_note(saved: dict, config: TrainConfig, step: int) -> str | None:
    """What changes in the learning-rate curve when a run resumed after ``step`` has other schedule settings than
    its checkpoint (``saved``, the checkpoint's ``train`` section): the schedule is a function of the step and
    these settings, so the curve is redrawn from the next step on. Its key points, before and after: the next
    step's lr, where warmup ends, and where and at what lr the decay ends. None when nothing changed."""
    old = dataclasses.replace(config, **{key: saved[key] for key in SCHEDULE_KEYS if key in saved})
    if all(getattr(old, key) == getattr(config, key) for key in SCHEDULE_KEYS):
        return None

    def points(train: TrainConfig) -> str:
        warmup = min(train.warmup_steps, train.steps)
        return (f"lr {learning_rate(step + 1, train):.3g} at step {step + 1}, warmup ending at step {warmup}, "
                f"decay ending at step {train.steps} at lr {learning_rate(train.steps, train):.3g}")

    changed = ", ".join(f"train.{key} {getattr(old, key)} -> {getattr(config, key)}" for key in SCHEDULE_KEYS
                        if getattr(old, key) != getattr(config, key))
    return f"schedule redrawn at resume ({changed}): was {points(old)}; now {points(config)}"
