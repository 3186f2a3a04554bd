"""``train.compile``: each transformer block compiled with ``torch.compile`` (TorchInductor), in place.

Per block rather than the whole model, as torchtitan does: blocks repeat, so the compiled code of one serves
all of them (parameters are graph inputs), compilation stays short, and FSDP2's per-block hooks stay outside the
compiled code. Applied after activation checkpointing and before FSDP (``parallelize``), with the block's own
``nn.Module.compile``, so parameter names and ``model.moe_layers()`` are unchanged.

Where it breaks (graph breaks: the block runs as compiled pieces around an eager step). With a capacity factor,
at ``plan_dispatch``'s boolean selection of the kept assignments (``aten.nonzero``: the kept count sizes the
grouped tensor, a data-dependent shape); dropless routing keeps every shape fixed (N = T·k rows) and does not
break. Outside bf16, at each grouped GEMM (``moe.experts._eager_grouped_matmul``: torch's meta kernel of
``grouped_mm`` takes bf16 only). So bf16 dropless blocks compile whole; ``tests/parallel/test_compile.py`` holds
both cases to eager and counts the breaks. The option is off by default: on CPU, compiling moe-8x's blocks
takes minutes on a 2-core machine, and the GPU gain is unmeasured (docs/gpu.md).
"""

from __future__ import annotations

import shutil

import torch

from moe.transformer import MoETransformer

# TorchInductor, torch.compile's default; the CPU tests swap in "aot_eager" (the same graph capture, autograd and
# graph breaks, without generating C++), since Inductor's code generation takes minutes on a 2-core CI machine
BACKEND = "inductor"


def compile_unavailable(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot compile for ``device_type`` here, or None when it can."""
    from torch._dynamo.eval_frame import is_dynamo_supported

    if not is_dynamo_supported():
        return f"this torch ({torch.__version__}) does not support torch.compile on this Python"
    if device_type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return "TorchInductor needs Triton for CUDA kernels and it is not installed (pip install triton)"
    elif not any(shutil.which(name) for name in ("g++", "c++", "clang++")):
        return "TorchInductor compiles CPU kernels with a C++ compiler and none is on PATH (install g++)"
    return None


def apply_compile(model: MoETransformer) -> None:
    """Compile every block of ``model`` in place (``nn.Module.compile``)."""
    for block in model.blocks():
        block.compile(backend=BACKEND)
