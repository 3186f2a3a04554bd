"""Manifold-constrained hyper-connections (mHC; Xie et al. 2026, used by DeepSeek-V4, its report sec. 2.2): the
block's residual, with the stream widened to n = ``model.hc_mult`` streams.

The model embeds each token once and copies it into n streams [B, S, n, D]. Around each branch of a block
(attention, feed-forward) a ``HyperConnection`` computes, per token, from the RMS-normalised concatenation of the
n streams (one matmul with a [(2 + n) n, n D] weight, a bias and three scales):

- ``pre`` [n] = sigmoid(.) + eps: the weights that collapse the streams into the branch's input, sum_j pre_j x_j;
- ``post`` [n] = 2 sigmoid(.): how the branch's output f is spread back over the streams;
- ``comb`` [n, n]: softmax(.) + eps, then made (nearly) doubly stochastic by Sinkhorn-Knopp iterations (columns
  normalised, then rows and columns alternately), so mixing the streams cannot blow up their norm with depth.

The block's output stream k is ``post_k f + sum_j comb[j, k] x_j``. At the top a ``HyperHead`` collapses the
streams with its own sigmoid weights before the final norm. With n = 1 (the default) none of this exists and the
block is the plain pre-norm residual (``moe/block.py``).

Everything here runs in fp32 with autocast off, as the reference does (``transformers``' ``deepseek_v4``): the
weights are small and the Sinkhorn normalisation divides by sums that bf16 would round.

Shapes: B sequences, S positions, n streams, D = d_model.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from config.model import ModelConfig
from moe.param_tensors import ParamTensor
from moe.saved_activations import FP32, MicroBatch


def _rms_normalised(flat: Tensor, eps: float) -> Tensor:
    """flat / rms(flat) over the last dim, no weight: the streams' scale must not decide the mixing weights."""
    return flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def sinkhorn(matrix: Tensor, iterations: int, eps: float) -> Tensor:
    """Sinkhorn-Knopp on the last two dims of a positive ``matrix``: columns normalised to sum to one, then
    ``iterations - 1`` rounds of rows and then columns, each sum offset by ``eps``."""
    matrix = matrix / (matrix.sum(-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        matrix = matrix / (matrix.sum(-1, keepdim=True) + eps)
        matrix = matrix / (matrix.sum(-2, keepdim=True) + eps)
    return matrix


class HyperConnection(nn.Module):
    """One branch's hyper-connection: collapse the streams into the branch's input (``forward``), ``merge`` its
    output back. A module call, so that tensor parallelism's hooks see it (under sequence parallelism it works on
    the rank's sequence slice, ``parallel/tensor.py``).

    Parameters: ``weight`` [(2 + n) n, n D] (the pre, post and comb projections stacked), ``bias`` [(2 + n) n] and
    ``scale`` [3] (one per projection). Initialised as the reference does: weight N(0, init_std), bias zeros,
    scale ones (``moe/init.py``'s rules by name).
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        n, d = config.hc_mult, config.d_model
        self.streams, self.iterations, self.eps, self.norm_eps = n, config.hc_sinkhorn_iters, config.hc_eps, \
            config.norm_eps
        self.weight = nn.Parameter(torch.empty((2 + n) * n, n * d))
        self.bias = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, streams: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """streams [B, S, n, D] -> (the branch's input [B, S, D], post [B, S, n], comb [B, S, n, n]), all fp32."""
        n = self.streams
        with torch.autocast(device_type=streams.device.type, enabled=False):
            streams = streams.float()
            mixes = _rms_normalised(streams.flatten(-2), self.norm_eps) @ self.weight.float().t()
            sizes = [n, n, n * n]
            pre, post, comb = (mix * scale + bias for mix, bias, scale in
                               zip(mixes.split(sizes, dim=-1), self.bias.float().split(sizes), self.scale.float(),
                                   strict=True))
            pre = torch.sigmoid(pre) + self.eps
            post = 2 * torch.sigmoid(post)
            comb = sinkhorn(torch.softmax(comb.unflatten(-1, (n, n)), dim=-1) + self.eps, self.iterations, self.eps)
            collapsed = (pre.unsqueeze(-1) * streams).sum(-2)
        return collapsed, post, comb

    @staticmethod
    def merge(streams: Tensor, output: Tensor, post: Tensor, comb: Tensor) -> Tensor:
        """The next streams [B, S, n, D]: stream k is post_k · output + sum_j comb[j, k] · streams_j (fp32)."""
        with torch.autocast(device_type=streams.device.type, enabled=False):
            mixed = comb.transpose(-1, -2) @ streams.float()
            return mixed.add_(post.unsqueeze(-1) * output.float().unsqueeze(-2))

    @staticmethod
    def saved_bytes(model: ModelConfig, mb: MicroBatch) -> int:
        """What one hyper-connection saves for backward (fp32, on the stream's tokens): its input streams, the
        normalisation's 1/rms and output, the projection's output (the mixes), pre's and post's sigmoids and
        themselves, comb's softmax, each Sinkhorn division's numerator and denominator and the final comb, and the
        branch's output as the merge takes it (fp32)."""
        t, n, d, divisions = mb.stream, model.hc_mult, model.d_model, 2 * model.hc_sinkhorn_iters - 1
        return FP32 * t * (2 * n * d + 1 + (2 + n) * n + 4 * n + n * n + (divisions + 1) * n * n + divisions * n + d)

    @staticmethod
    def flops_per_token(model: ModelConfig) -> float:
        """Training FLOPs of one token's stream products in one hyper-connection, beyond its projection's (counted
        with its parameters, 6 per weight): the collapse sum_j pre_j x_j (n · D multiply-adds), the merge's
        comb^T x (n² · D) and post_k f (n · D); 2 FLOPs a multiply-add, 3 times that for forward and backward:
        6 · n · D · (n + 2). The elementwise work (normalisation, sigmoids, softmax, Sinkhorn's divisions on
        n × n) is left out, as norms' and activations' is."""
        n = model.hc_mult
        return 6.0 * n * model.d_model * (n + 2)

    @staticmethod
    def parameter_tensors(model: ModelConfig, i: int | None) -> list[ParamTensor]:
        """Its weight, bias and scales: replicated under every layout, as the router's gate is."""
        n, d = model.hc_mult, model.d_model
        return [ParamTensor("hyper", i, ((2 + n) * n, n * d)), ParamTensor("hyper", i, ((2 + n) * n,)),
                ParamTensor("hyper", i, (3,))]


class HyperHead(nn.Module):
    """The streams' final collapse before the model's last norm: sum_j pre_j x_j, pre = sigmoid(.) + eps from the
    RMS-normalised streams (``weight`` [n, n D], ``bias`` [n], ``scale`` [1])."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        n, d = config.hc_mult, config.d_model
        self.eps, self.norm_eps = config.hc_eps, config.norm_eps
        self.weight = nn.Parameter(torch.empty(n, n * d))
        self.bias = nn.Parameter(torch.empty(n))
        self.scale = nn.Parameter(torch.empty(1))

    def forward(self, streams: Tensor) -> Tensor:
        """streams [B, S, n, D] -> [B, S, D] (fp32)."""
        with torch.autocast(device_type=streams.device.type, enabled=False):
            streams = streams.float()
            mixes = _rms_normalised(streams.flatten(-2), self.norm_eps) @ self.weight.float().t()
            pre = torch.sigmoid(mixes * self.scale.float() + self.bias.float()) + self.eps
            return (pre.unsqueeze(-1) * streams).sum(-2)

    @staticmethod
    def saved_bytes(model: ModelConfig, mb: MicroBatch) -> int:
        """Its input streams, the normalisation's 1/rms and output, the mixes, their sigmoid and pre (fp32)."""
        t, n, d = mb.stream, model.hc_mult, model.d_model
        return FP32 * t * (2 * n * d + 1 + 3 * n)

    @staticmethod
    def flops_per_token(model: ModelConfig) -> float:
        """Training FLOPs of one token's collapse sum_j pre_j x_j beyond the projection (``HyperConnection``'s
        terms): 6 · n · D."""
        return 6.0 * model.hc_mult * model.d_model

    @staticmethod
    def parameter_tensors(model: ModelConfig, i: int | None = None) -> list[ParamTensor]:
        """The model's head (i None), or a multi-token-prediction module's own (layer i, ``moe/mtp.py``)."""
        n, d = model.hc_mult, model.d_model
        return [ParamTensor("hyper", i, (n, n * d)), ParamTensor("hyper", i, (n,)), ParamTensor("hyper", i, (1,))]


def widen(embedded: Tensor, streams: int) -> Tensor:
    """The first block's streams: each token's embedding copied into every one of them, [B, S, D] -> [B, S, n, D]."""
    return embedded.unsqueeze(-2).expand(*embedded.shape[:-1], streams, embedded.shape[-1]).contiguous()
