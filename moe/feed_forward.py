"""The dense feed-forward kind: a SwiGLU FFN (the FFN of dense blocks, and the shared experts of MoE layers), and
what it costs.

Shapes: T tokens, D = d_model, H hidden units.
"""

from __future__ import annotations

from torch import Tensor, nn

from config.model import ModelConfig, MoEConfig
from moe.experts import limited_swiglu, swiglu
from moe.param_tensors import ParamTensor
from moe.saved_activations import MicroBatch, linear_input_bytes


class FeedForward(nn.Module):
    """A dense SwiGLU feed-forward: the FFN of dense blocks and the shared experts of MoE layers. With ``limit``
    (DeepSeek-V4's shared experts, ``moe.activation: limited_swiglu``) its activation is ``limited_swiglu``."""

    block_attribute = "ffn"  # its name in a block (``moe/block.py``): parameter names say ``layers.i.ffn.*``

    def __init__(self, d_model: int, hidden: int, limit: float | None = None):
        super().__init__()
        self.limit = limit
        self.w_in = nn.Linear(d_model, hidden, bias=False)
        self.w_gate = nn.Linear(d_model, hidden, bias=False)
        self.w_out = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.limit is None:
            return self.w_out(swiglu(self.w_gate(x), self.w_in(x)))
        return self.w_out(limited_swiglu(self.w_gate(x), self.w_in(x), self.limit))

    @classmethod
    def for_block(cls, model: ModelConfig, moe: MoEConfig) -> FeedForward:
        """A dense block's FFN, ``model.ffn_hidden`` wide."""
        return cls(model.d_model, model.ffn_hidden)

    # What this kind costs, stated beside its forward (summed by ``moe/accounting.py`` and ``analysis/``)

    @staticmethod
    def parameter_tensors(model: ModelConfig, moe: MoEConfig, i: int | None, hidden: int | None = None,
                          ) -> list[ParamTensor]:
        """w_in and w_gate column-parallel, w_out row-parallel (``parallel/tensor.py``), ``hidden`` wide (a dense
        block's ``model.ffn_hidden`` by default; the shared experts' width inside an MoE layer)."""
        d, hidden = model.d_model, model.ffn_hidden if hidden is None else hidden
        return [ParamTensor("ffn", i, (hidden, d), 0), ParamTensor("ffn", i, (hidden, d), 0),
                ParamTensor("ffn", i, (d, hidden), 1)]

    @staticmethod
    def saved_bytes(mb: MicroBatch, d: int, hidden: int, input_saved: bool = True, limited: bool = False) -> int:
        """On this rank's ``hidden`` units: its input (unless another module saved it already), then the gate
        pre-activation, silu(gate), the up projection and their product; ``limited`` (``limited_swiglu``) the gate
        and up before their clamps too."""
        return linear_input_bytes(mb, d, 2, input_saved) + (6 if limited else 4) * mb.tokens * hidden * mb.compute
