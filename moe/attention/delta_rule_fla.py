"""The gated delta rule on a CUDA GPU through flash-linear-attention's Triton kernels (``fla-core``, optional).

The torch form (``moe/attention/delta_rule.py``) is the reference and the CPU path: its chunks run one after
another in a Python loop of small matmuls, which a GPU spends mostly launching. fla's ``chunk_gated_delta_rule``
computes the same recurrence (Yang, Kautz, Hatamizadeh 2025) in a few fused kernels, with grouped value heads
(each key head serving consecutive value heads, as here) and an initial and final state, so it takes the place of
``gated_delta_rule`` where it can run: ``model.linear_backend`` chooses, as ``moe.backend`` does for the experts.

    torch  the reference path everywhere;
    fla    fla's kernels (a CUDA GPU with ``fla-core`` installed; refused before any work where it cannot run);
    auto   fla on a CUDA GPU where it is installed, else torch. Unlike megablocks (which ``auto`` takes only where a
           benchmark measured it faster), fla replaces a Python loop over the sequence's chunks: there is no shape at
           which that loop can win on a GPU. The GPU check (``tests/gpu/test_fla_delta_rule.py``) holds the two
           equal within Triton's TF32 matmul precision.

What differs from the torch path: fla saves its own tensors for backward (the inputs and each chunk's [C, C]
triangular solve), where the memory model counts the torch path's (the inputs alone, chunks recomputed), so on a
GPU with fla the planner's figure for a linear layer's saved activations is low by the [B, S, H, C] fp32 solve.
Generation's one-token steps keep the torch step form (one position: nothing to fuse).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from config.errors import ConfigError

INSTALL_FLA = ("install flash-linear-attention's kernels on the CUDA machine (`pip install fla-core`; triton comes "
               "with CUDA builds of torch; without network: `scripts/gpu_check.sh --prepare DIR` fetches the wheel), "
               "or set model.linear_backend=torch")


@functools.cache
def fla_unavailable(device_type: str) -> str | None:
    """Why fla's kernels cannot run on ``device_type`` here, or None when they can."""
    if device_type != "cuda":
        return f"fla's kernels are Triton kernels for CUDA GPUs and this run computes on {device_type}"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except Exception as exc:  # ImportError, or triton failing to load: either way fla cannot run
        return f"fla-core cannot be imported ({type(exc).__name__}: {exc})"
    return None


def check_linear_backend(requested: str, device_type: str) -> None:
    """Refuse ``model.linear_backend=fla`` before any work where it cannot run, saying why and what to do."""
    if requested == "fla" and (reason := fla_unavailable(device_type)) is not None:
        raise ConfigError(f"model.linear_backend=fla: {reason}; {INSTALL_FLA}")


def uses_fla(requested: str, device: torch.device) -> bool:
    """Whether the rule runs through fla for ``model.linear_backend=requested`` on ``device``."""
    if requested == "torch":
        return False
    return requested == "fla" or fla_unavailable(device.type) is None


def fla_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor,
                         state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``delta_rule.gated_delta_rule``'s contract (heads first: q, k [B, Hk, S, dk], v [B, H, S, dv], log_decay
    and beta [B, H, S], state [B, H, dk, dv]; q already scaled) through fla, whose tensors are sequence first."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    q, k, v, log_decay, beta = (t.transpose(1, 2).contiguous() for t in (q, k, v, log_decay, beta))
    out, final = chunk_gated_delta_rule(q, k, v, log_decay, beta, scale=1.0, initial_state=state,
                                        output_final_state=True)
    return out.transpose(1, 2), final
