"""Gated DeltaNet linear attention (Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks"; Qwen3-Next's and
Qwen3.5-MoE's "linear_attention" layers), and what it costs.

Instead of attending to every earlier position, each head keeps a [dk, dv] state that every position decays and
corrects (the gated delta rule, ``moe/attention/delta_rule.py``) and reads with its query: a token costs the same
at any position, and generation's cache is the state alone, constant in the sequence's length.

Shapes: B sequences, S positions, D = d_model, nk key heads of dk (queries have as many), nv value heads of dv
(each key head serves r = nv / nk consecutive value heads), C = nk·dk + nk·dk + nv·dv convolution channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from config.model import LayerSpec, ModelConfig
from moe.attention.base import AttentionKind
from moe.attention.delta_rule import gated_delta_rule, recurrent_gated_delta_rule
from moe.attention.delta_rule_fla import fla_gated_delta_rule, uses_fla
from moe.documents import Documents
from moe.kv_cache import LayerCache
from moe.norm import RMSNorm, uses_fused_backward
from moe.param_tensors import ParamTensor
from moe.saved_activations import FP32, MicroBatch, linear_input_bytes, norm_bytes
from moe.sequence_shards import SequenceShards

L2_EPS = 1e-6  # inside the square root of q's and k's L2 norms (the fla kernels' and Qwen3-Next's value)


class GatedDeltaAttention(AttentionKind):
    """One Gated DeltaNet layer: projections of the block input to queries ``wq``, keys ``wk``, values ``wv``, the
    output gate ``wz`` (per value channel), the write strength ``wb`` (beta = sigmoid, per value head) and the
    decay input ``wa``; a short causal depthwise convolution over the last ``linear_conv_kernel`` positions of
    each q, k and v channel (``conv_q``, ``conv_k``, ``conv_v``: [channels, 1, kernel], no bias), then SiLU; q and k
    L2-normalised per head, q scaled by dk^-0.5; the decay per value head and position
    g = -exp(``log_decay_rate``) · softplus(wa x + ``decay_bias``) (Mamba-2's discretisation, as Gated DeltaNet
    takes it); the delta rule over the sequence; each value head's output RMS-normalised (``out_norm``, one
    weight [dv] shared by the heads) and gated by SiLU(z); ``wo`` back to D.

    No rotary positions: the convolution and the recurrence's order carry them (``cos``, ``sin`` are unused).
    Training computes the rule by chunks of ``linear_chunk_size``; in generation the state and the convolution's
    last inputs live in the ``LayerCache``, a prompt runs by chunks from them and a single new token by the
    step form. Every parameter but ``out_norm`` and ``wo`` is per head (or per channel), so tensor parallelism
    can split them with the heads, each key head with its value heads.
    """

    reads_document_tables = False  # no rotary positions

    def __init__(self, config: ModelConfig, layer: LayerSpec):
        super().__init__()
        d = config.d_model
        self.key_heads, self.value_heads = config.linear_key_heads, config.linear_value_heads
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        self.kernel, self.chunk_size = config.linear_conv_kernel, config.linear_chunk_size
        self.backend = config.linear_backend  # torch, fla or auto: moe/attention/delta_rule_fla.py
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.wq = nn.Linear(d, keys, bias=False)
        self.wk = nn.Linear(d, keys, bias=False)
        self.wv = nn.Linear(d, values, bias=False)
        self.wz = nn.Linear(d, values, bias=False)
        self.wb = nn.Linear(d, self.value_heads, bias=False)
        self.wa = nn.Linear(d, self.value_heads, bias=False)
        self.conv_q = nn.Parameter(torch.empty(keys, 1, self.kernel))  # [channels, 1, kernel]: conv1d's depthwise
        self.conv_k = nn.Parameter(torch.empty(keys, 1, self.kernel))
        self.conv_v = nn.Parameter(torch.empty(values, 1, self.kernel))
        # initialised by ``moe/init.py``'s rules by name: the bias zeros, the rate N(0, init_std) (so exp ~ 1)
        self.decay_bias = nn.Parameter(torch.empty(self.value_heads))
        self.log_decay_rate = nn.Parameter(torch.empty(self.value_heads))
        self.out_norm = RMSNorm(self.value_dim, eps=config.norm_eps)
        self.wo = nn.Linear(values, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: LayerCache | None = None,
                documents: Documents | None = None) -> Tensor:
        """x: [B, S, D] (the interface of ``AttentionKind``; no rotary tables are read)."""
        q, k, v, beta_in, decay_in = self._projections(x, documents)  # this tp rank's heads
        batch, seq = q.shape[:2]
        widths = [q.shape[-1], k.shape[-1], v.shape[-1]]
        q, k, v = self._convolve(torch.cat((q, k, v), dim=-1), cache).float().split(widths, dim=-1)
        q = _l2_normalised(q.view(batch, seq, -1, self.key_dim)) * self.key_dim ** -0.5
        k = _l2_normalised(k.view(batch, seq, -1, self.key_dim))
        v = v.view(batch, seq, -1, self.value_dim)
        beta = torch.sigmoid(beta_in.float())
        rate, bias = _local(self.log_decay_rate).float(), _local(self.decay_bias).float()
        log_decay = -rate.exp() * F.softplus(decay_in.float() + bias)
        q, k, v, beta, log_decay = (t.transpose(1, 2) for t in (q, k, v, beta, log_decay))  # heads first
        state = None if cache is None else cache.state
        if cache is not None and seq == 1 and state is not None:
            out, state = recurrent_gated_delta_rule(q, k, v, log_decay, beta, state)
        elif uses_fla(self.backend, q.device):
            out, state = fla_gated_delta_rule(q, k, v, log_decay, beta, state)
        else:
            out, state = gated_delta_rule(q, k, v, log_decay, beta, self.chunk_size, state)
        if cache is not None:
            cache.advance(state, seq)
        out = out.transpose(1, 2).to(x.dtype)  # [B, S, nv, dv]
        if documents is not None:  # this context-parallel rank's positions of the whole sequence's outputs
            out = _own_chunks(out, documents.shards)
        gate = self.wz(x).view(*x.shape[:2], -1, self.value_dim)
        return self.wo((self.out_norm(out) * F.silu(gate)).reshape(*x.shape[:2], -1))

    def _projections(self, x: Tensor, documents: Documents | None) -> list[Tensor]:
        """q, k, v, beta's and the decay's inputs [B, S, width] of the positions the recurrence runs over: x's, or
        under context parallelism every rank's, gathered (``gather_sequence``) and put in sequence order. The
        recurrence then runs over the whole sequence on every cp rank, which keeps its own positions' outputs:
        cp times the rule's FLOPs, in exchange for one gather a layer (handing the state from rank to rank in
        sequence order instead is not built)."""
        parts = [self.wq(x), self.wk(x), self.wv(x), self.wb(x), self.wa(x)]
        if documents is None:
            return parts
        if not documents.sharded:
            raise NotImplementedError("linear attention does not take packed documents yet (the config refuses "
                                      "data.document_mask with it: config/run.py)")
        whole = _in_sequence_order(self.gather_sequence(torch.cat(parts, dim=-1)), documents.shards)
        return list(whole.split([part.shape[-1] for part in parts], dim=-1))

    def _convolve(self, qkv: Tensor, cache: LayerCache | None) -> Tensor:
        """The causal depthwise convolution of [B, S, C] over each channel's last ``kernel`` positions, then SiLU:
        before the first position, zeros, or in generation the inputs the cache kept (which it then updates)."""
        weight = torch.cat([_local(w) for w in (self.conv_q, self.conv_k, self.conv_v)])  # [C, 1, kernel]
        channels_first = qkv.transpose(1, 2)
        if cache is None or cache.conv_inputs is None:
            past = channels_first.new_zeros(*channels_first.shape[:2], self.kernel - 1)
        else:
            past = cache.conv_inputs
        padded = torch.cat((past, channels_first), dim=-1)
        if cache is not None:
            cache.conv_inputs = padded[..., padded.shape[-1] - (self.kernel - 1):]
        return F.silu(F.conv1d(padded, weight.to(padded.dtype), groups=weight.shape[0])).transpose(1, 2)

    # What this kind costs, stated beside its forward and summed over the layer pattern by ``analysis/`` and
    # ``moe/accounting.py`` (``tests/moe/test_gated_delta.py`` holds them to the module).

    @staticmethod
    def parameter_tensors(model: ModelConfig, i: int | None) -> list[ParamTensor]:
        """Layer i's weights in the module's order (its own parameters, then its submodules') and how tp would cut
        them: the convolutions, the per-head decay parameters and the projections to q, k, v, z, beta and a by
        heads (dim 0), ``out_norm`` whole, ``wo`` by its input."""
        d, kernel = model.d_model, model.linear_conv_kernel
        keys = model.linear_key_heads * model.linear_key_head_dim
        heads = model.linear_value_heads
        values = heads * model.linear_value_head_dim
        return [ParamTensor("attention", i, (keys, 1, kernel), 0), ParamTensor("attention", i, (keys, 1, kernel), 0),
                ParamTensor("attention", i, (values, 1, kernel), 0), ParamTensor("attention", i, (heads,), 0),
                ParamTensor("attention", i, (heads,), 0),
                ParamTensor("attention", i, (keys, d), 0), ParamTensor("attention", i, (keys, d), 0),
                ParamTensor("attention", i, (values, d), 0), ParamTensor("attention", i, (values, d), 0),
                ParamTensor("attention", i, (heads, d), 0), ParamTensor("attention", i, (heads, d), 0),
                ParamTensor("norm", i, (model.linear_value_head_dim,)), ParamTensor("attention", i, (d, values), 1)]

    @staticmethod
    def flops_per_token(model: ModelConfig) -> float:
        """Training FLOPs of one token's delta rule (3 x its forward's matmuls, by chunks of c = min(chunk, S)),
        per value head: the chunk's k·k and q·k products (2·c·dk each), the two triangular solves (c·dv, c·dk),
        the scores times the corrections (2·c·dv), and three [dk, dv] products with the state (6·dk·dv). Linear
        in S over a sequence, unlike softmax attention's quadratic cost."""
        c = min(model.linear_chunk_size, model.seq_len)
        dk, dv = model.linear_key_head_dim, model.linear_value_head_dim
        return 3.0 * model.linear_value_heads * (c * (5 * dk + 3 * dv) + 6 * dk * dv)

    @staticmethod
    def projection_gemms(model: ModelConfig, tp: int, tokens: int) -> list[tuple[float, int, int, int]]:
        """The projections' matmuls on one rank, (count, M, K, N): wq, wk; wv, wz; wb, wa split by heads, wo by
        its input."""
        d, heads = model.d_model, model.linear_value_heads // tp
        keys = model.linear_key_heads // tp * model.linear_key_head_dim
        values = heads * model.linear_value_head_dim
        return [(2, tokens, d, keys), (2, tokens, d, values), (2, tokens, d, heads), (1, tokens, values, d)]

    @staticmethod
    def sequence_gather_width(model: ModelConfig, tp: int) -> int:
        """Elements per position that context parallelism gathers in one layer: this tp rank's q, k, v and the
        inputs of beta and the decay (``_projections``)."""
        heads = model.linear_value_heads // tp
        return 2 * model.linear_key_heads // tp * model.linear_key_head_dim + heads * model.linear_value_head_dim \
            + 2 * heads

    @staticmethod
    def input_gradient_sums(model: ModelConfig) -> tuple[tuple[str, int], ...] | None:
        """Every projection reads the block input column-parallel: nothing of its own."""
        return None

    @staticmethod
    def saved_bytes(model: ModelConfig, layer: LayerSpec, tp: int, mb: MicroBatch) -> int:
        """On this rank's heads, with C = 2·nk·dk + nv·dv channels: the block input read by the six projections
        (``linear_input_bytes``); the convolution's input, zero-padded by kernel - 1 positions, and its output
        (SiLU's input), in the compute dtype, and its concatenated weight [C, 1, kernel] (under autocast its one
        cast, which the weights' autocast copies count: ``ParamTensor.autocast_copy``); SiLU's output in fp32
        (under bf16 its fp32 copy), of which v is a view; the L2 norms' inverses [T, nk] for q and k and the
        normalised q (scaled) and k; beta, softplus's input and output and the decay, [T, nv] each, with the
        decay rate's exp and its negation [nv]; the delta rule's output [T, nv·dv] fp32, which the gated norm
        saves with its rstd (and the normalised input where it runs decomposed: on a DTensor under tp; under
        FSDP's bf16 weights the output is cast to the bf16 stream, and the norm saves its fp32 upcast), the
        norm's output, the gate and its SiLU (compute dtype), and wo's input. The delta rule saves nothing else
        (``moe/attention/delta_rule.py``: backward computes its chunks again). Under context parallelism the
        convolution and the rule run over the whole sequence (cp·s positions), the rest over this rank's s (put in
        sequence order and taken back by slices, which keep nothing)."""
        t, a, fp32 = mb.tokens, mb.compute, FP32
        key_heads, value_heads = model.linear_key_heads // tp, model.linear_value_heads // tp
        dk, dv, kernel = model.linear_key_head_dim, model.linear_value_head_dim, model.linear_conv_kernel
        channels = 2 * key_heads * dk + value_heads * dv
        total = linear_input_bytes(mb, model.d_model, 6)
        autocast = mb.bf16 and not mb.bf16_weights  # bf16 compute from fp32 weights
        total += 0 if autocast else channels * kernel * a  # under autocast: the weights' copies (ParamTensor)
        whole = t * mb.cp  # the recurrence's positions: under cp every rank's (``_projections``)
        total += (mb.sequences * channels * (mb.positions * mb.cp + kernel - 1) + whole * channels) * a
        total += whole * channels * fp32 + 2 * whole * key_heads * (dk + 1) * fp32
        total += (4 * whole * value_heads + 2 * value_heads) * fp32
        if mb.bf16_weights:  # a bf16 stream: the rule's output cast to bf16, the norm decomposed, its output bf16
            total += norm_bytes(t * value_heads, dv, fused=False) + t * value_heads * dv * a
        else:  # an fp32 input: fused, unless a DTensor under tp
            fused = uses_fused_backward(torch.float32, distributed=tp > 1)
            total += norm_bytes(t * value_heads, dv, fused) + t * value_heads * dv * fp32
        return total + 3 * t * value_heads * dv * a

    def heads_to_clip(self) -> list[tuple[Tensor, Tensor]]:
        raise NotImplementedError("QK-clip has no logits to clip in linear attention (its q and k are "
                                  "L2-normalised); the config refuses train.qk_clip_threshold with it")


def _in_sequence_order(gathered: Tensor, shards: SequenceShards) -> Tensor:
    """[B, S, W] as the cp ranks' gather gives it (rank r's front chunk r, then its back chunk 2·cp - 1 - r, rank
    after rank: ``SequenceShards``) -> in sequence order, by slices (no index kept for backward)."""
    chunks = gathered.chunk(2 * shards.cp, dim=1)  # gathered chunk 2r is sequence chunk r, 2r + 1 is 2cp - 1 - r
    return torch.cat([chunks[2 * j] for j in range(shards.cp)]
                     + [chunks[2 * (2 * shards.cp - 1 - j) + 1] for j in range(shards.cp, 2 * shards.cp)], dim=1)


def _own_chunks(whole: Tensor, shards: SequenceShards) -> Tensor:
    """This cp rank's positions (its front and back chunk) of [B, S, ...] in sequence order."""
    chunks = whole.chunk(2 * shards.cp, dim=1)
    return torch.cat((chunks[shards.rank], chunks[2 * shards.cp - 1 - shards.rank]), dim=1)


def _local(param: Tensor) -> Tensor:
    """This tp rank's heads of a parameter split with them (a DTensor under tensor parallelism)."""
    return param.to_local() if isinstance(param, DTensor) else param


def _l2_normalised(x: Tensor) -> Tensor:
    """x / sqrt(|x|² + eps) over the last dim (the L2 norm Gated DeltaNet puts on its queries and keys)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2_EPS)
