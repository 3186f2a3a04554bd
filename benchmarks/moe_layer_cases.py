"""The MoE layers the layer benchmarks measure, and the strict floor they are held to.

Shared by ``benchmarks/moe_layer.py`` (the layer against its floors inside one tuned process) and
``benchmarks/moe_layer_library.py`` (the layer as a library: fresh processes, the default allocator).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from config.model import MoEConfig
from moe.experts import grouped_matmul
from moe.init import initialize
from moe.layer import MoELayer


@dataclass(frozen=True)
class Shape:
    name: str
    d_model: int
    hidden: int  # expert hidden size
    batch: int
    seq: int
    num_experts: int = 8
    top_k: int = 2
    gpt_oss: bool = False  # GPT-OSS's experts: router and expert biases, the clamped SwiGLU

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


STANDARD = Shape("standard", 512, 1024, 4, 1024)  # 4096 tokens
GPT_OSS = Shape("gpt-oss", 512, 1024, 4, 1024, gpt_oss=True)  # the standard layer with GPT-OSS's options
MIXTRAL = Shape("mixtral", 4096, 14336, 2, 4096)  # Mixtral 8x7B's MoE layer on 8192 tokens
def make_layer(shape: Shape, capacity_factor: float | None, routing: str, backend: str,
               device: torch.device) -> MoELayer:
    options = dict(activation="clamped_swiglu", router_bias=True, expert_proj_bias=True) if shape.gpt_oss else {}
    config = MoEConfig(num_experts=shape.num_experts, top_k=shape.top_k, expert_hidden=shape.hidden,
                       capacity_factor=capacity_factor, force_balance=routing == "balanced", backend=backend,
                       **options)
    layer = MoELayer(shape.d_model, config).to(device)
    initialize(layer, seed=0, std=0.02, out_std=0.01)
    return layer


def make_strict_floor_step(layer: MoELayer, shape: Shape, precision: str) -> Callable[[], None]:
    """Forward + backward of the three bare grouped GEMMs on uniform groups (``T·k/E`` rows each), no activation.

    ``gate = x @ w_gate`` and ``up = x @ w_in`` per group, ``out = up @ w_down``; backward starts from ``out``
    and from ``gate`` (given its own gradient, as the activation's backward would give it), so all nine GEMMs
    run (three forward, six backward) and the only other work is adding ``x``'s two gradients, as any SwiGLU
    layer must."""
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    experts, device = layer.experts, layer.experts.w_in.device
    w_in, w_gate, w_out = (w.detach().to(dtype).requires_grad_(True)
                           for w in (experts.w_in, experts.w_gate, experts.w_out))
    rows = shape.tokens * shape.top_k
    group_sizes = torch.full((shape.num_experts,), rows // shape.num_experts, device=device)
    x = torch.randn(rows, shape.d_model, dtype=dtype, device=device, requires_grad=True)
    grad_out = torch.randn(rows, shape.d_model, dtype=dtype, device=device)
    grad_gate = torch.randn(rows, shape.hidden, dtype=dtype, device=device)
    backend = layer.config.backend

    def step() -> None:
        for leaf in (x, w_in, w_gate, w_out):
            leaf.grad = None
        gate, up = grouped_matmul(x, w_gate, group_sizes, backend), grouped_matmul(x, w_in, group_sizes, backend)
        out = grouped_matmul(up, w_out, group_sizes, backend)
        torch.autograd.backward((out, gate), (grad_out, grad_gate))

    return step
