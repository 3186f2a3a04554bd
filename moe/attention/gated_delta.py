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
from moe.attention.delta_rule_shards import convolution_history, sharded_gated_delta_rule
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
    step form. Under context parallelism a rank computes its own positions alone, from the state and the
    convolution inputs that the positions before each of its chunks leave (``delta_rule_shards``). Every
    parameter but ``out_norm`` and ``wo`` is per head (or per channel), so tensor parallelism can split them with
    the heads, each key head with its value heads.
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
        shards = None if documents is None else documents.shards
        qkv = torch.cat((q, k, v), dim=-1)
        q, k, v = self._convolve(qkv, self._convolution_history(qkv, cache, shards), cache).float().split(widths, -1)
        q = _l2_normalised(q.view(batch, seq, -1, self.key_dim)) * self.key_dim ** -0.5
        k = _l2_normalised(k.view(batch, seq, -1, self.key_dim))
        v = v.view(batch, seq, -1, self.value_dim)
        beta = torch.sigmoid(beta_in.float())
        rate, bias = _local(self.log_decay_rate).float(), _local(self.decay_bias).float()
        log_decay = -rate.exp() * F.softplus(decay_in.float() + bias)
        q, k, v, beta, log_decay = (t.transpose(1, 2) for t in (q, k, v, beta, log_decay))  # heads first
        state = None if cache is None else cache.state
        if shards is not None:  # this cp rank's positions, the state handed on from the ranks before (torch rule)
            out = sharded_gated_delta_rule(q, k, v, log_decay, beta, self.chunk_size, self.gather_sequence, shards)
        elif cache is not None and seq == 1 and state is not None:
            out, state = recurrent_gated_delta_rule(q, k, v, log_decay, beta, state)
        elif uses_fla(self.backend, q.device):
            out, state = fla_gated_delta_rule(q, k, v, log_decay, beta, state)
        else:
            out, state = gated_delta_rule(q, k, v, log_decay, beta, self.chunk_size, state)
        if cache is not None:
            cache.advance(state, seq)
        out = out.transpose(1, 2).to(x.dtype)  # [B, S, nv, dv]
        gate = self.wz(x).view(*x.shape[:2], -1, self.value_dim)
        return self.wo((self.out_norm(out) * F.silu(gate)).reshape(*x.shape[:2], -1))

    def _projections(self, x: Tensor, documents: Documents | None) -> list[Tensor]:
        """q, k, v, beta's and the decay's inputs [B, S, width] of x's positions."""
        if documents is not None and not documents.sharded:
            raise NotImplementedError("linear attention does not take packed documents yet (the config refuses "
                                      "data.document_mask with it: config/run.py)")
        return [self.wq(x), self.wk(x), self.wv(x), self.wb(x), self.wa(x)]

    def _convolution_history(self, qkv: Tensor, cache: LayerCache | None,
                             shards: SequenceShards | None) -> list[Tensor]:
        """The kernel - 1 inputs [B, C, kernel - 1] before each piece of qkv [B, S, C] the convolution runs over:
        zeros before a sequence's start, the inputs generation's cache kept, or under context parallelism the
        ones before each of this rank's two chunks (``convolution_history``)."""
        if shards is not None:
            history = convolution_history(qkv, self.kernel, self.gather_sequence, shards)
            return [before.transpose(1, 2) for before in history]
        if cache is not None and cache.conv_inputs is not None:
            return [cache.conv_inputs]
        return [qkv.new_zeros(qkv.shape[0], qkv.shape[2], self.kernel - 1)]

    def _convolve(self, qkv: Tensor, history: list[Tensor], cache: LayerCache | None) -> Tensor:
        """The causal depthwise convolution of [B, S, C] over each channel's last ``kernel`` positions, then SiLU:
        qkv cut into as many equal pieces as ``history`` holds inputs before them, each piece convolved after its
        own; in generation the cache keeps the last inputs."""
        weight = torch.cat([_local(w) for w in (self.conv_q, self.conv_k, self.conv_v)])  # [C, 1, kernel]
        weight = weight.to(qkv.dtype)
        pieces = qkv.transpose(1, 2).chunk(len(history), dim=-1)
        padded = [torch.cat((before, piece), dim=-1) for before, piece in zip(history, pieces, strict=True)]
        if cache is not None:
            cache.conv_inputs = padded[-1][..., padded[-1].shape[-1] - (self.kernel - 1):]
        convolved = [F.conv1d(inputs, weight, groups=weight.shape[0]) for inputs in padded]
        return F.silu(torch.cat(convolved, dim=-1) if len(convolved) > 1 else convolved[0]).transpose(1, 2)

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
    def context_flops_per_token(model: ModelConfig, cp: int) -> float:
        """Under cp > 1 the pass that makes each chunk's state map (``delta_rule.state_map``), counted as
        ``flops_per_token`` counts the rule, per value head: the chunk's k·k product (2·c·dk) and its two
        triangular solves on dk + dv columns and dk (c·(2·dk + dv)), and two [dk, dk + dv] products with the state
        (4·dk·(dk + dv)); no queries, no outputs. The maps' composition (a few [dk, dk] x [dk, dv] products per
        chunk and sequence) is left out."""
        if cp == 1:
            return 0.0
        c = min(model.linear_chunk_size, model.seq_len // (2 * cp))
        dk, dv = model.linear_key_head_dim, model.linear_value_head_dim
        return 3.0 * model.linear_value_heads * (c * (4 * dk + dv) + 4 * dk * (dk + dv))

    @staticmethod
    def projection_gemms(model: ModelConfig, tp: int, tokens: int) -> list[tuple[float, int, int, int]]:
        """The projections' matmuls on one rank, (count, M, K, N): wq, wk; wv, wz; wb, wa split by heads, wo by
        its input."""
        d, heads = model.d_model, model.linear_value_heads // tp
        keys = model.linear_key_heads // tp * model.linear_key_head_dim
        values = heads * model.linear_value_head_dim
        return [(2, tokens, d, keys), (2, tokens, d, values), (2, tokens, d, heads), (1, tokens, values, d)]

    @staticmethod
    def context_gathers(model: ModelConfig, tp: int, cp: int, act: int) -> tuple[tuple[str, int], ...]:
        """Under context parallelism (``delta_rule_shards``), per sequence: every chunk's last min(kernel - 1,
        S / 2cp) convolution inputs (this tp rank's C channels, the activations' dtype), and every chunk's state map
        [nv, dk, dk + dv] in fp32, 2·cp chunks of each; nothing that grows with the sequence."""
        heads = model.linear_value_heads // tp
        dk, dv = model.linear_key_head_dim, model.linear_value_head_dim
        channels = 2 * model.linear_key_heads // tp * dk + heads * dv
        kept = min(model.linear_conv_kernel - 1, model.seq_len // (2 * cp))
        gathers = (("convolution inputs before each chunk", 2 * cp * kept * channels * act),
                   ("each chunk's state map", 2 * cp * heads * dk * (dk + dv) * FP32))
        return tuple(gather for gather in gathers if gather[1])

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
        (``moe/attention/delta_rule.py``: backward computes its chunks again). Under context parallelism
        (``delta_rule_shards``) everything is on this rank's positions: the convolution's input is padded before
        each of its two chunks; besides, the gathered state maps [2·cp, B, nv, dk, dk + dv] fp32 and the states
        composed from them, [B, nv, dk, dv] fp32 each: 2·cp - 2 - r on cp rank r (the ones entering chunks 2 ..
        2·cp - 1 - r; the one entering chunk 1 is a view of the maps)."""
        t, a, fp32 = mb.tokens, mb.compute, FP32
        key_heads, value_heads = model.linear_key_heads // tp, model.linear_value_heads // tp
        dk, dv, kernel = model.linear_key_head_dim, model.linear_value_head_dim, model.linear_conv_kernel
        channels = 2 * key_heads * dk + value_heads * dv
        total = linear_input_bytes(mb, model.d_model, 6)
        autocast = mb.bf16 and not mb.bf16_weights  # bf16 compute from fp32 weights
        total += 0 if autocast else channels * kernel * a  # under autocast: the weights' copies (ParamTensor)
        pieces = 2 if mb.cp > 1 else 1  # the convolution's runs, each after its kernel - 1 earlier inputs
        total += (mb.sequences * channels * (mb.positions + pieces * (kernel - 1)) + t * channels) * a
        total += t * channels * fp32 + 2 * t * key_heads * (dk + 1) * fp32
        total += (4 * t * value_heads + 2 * value_heads) * fp32
        if mb.cp > 1:
            composed = 2 * mb.cp - 2 - (mb.cp_rank or 0)  # rank 0 composes the most
            total += mb.sequences * value_heads * dk * (2 * mb.cp * (dk + dv) + composed * dv) * fp32
        if mb.bf16_weights:  # a bf16 stream: the rule's output cast to bf16, the norm decomposed, its output bf16
            total += norm_bytes(t * value_heads, dv, fused=False) + t * value_heads * dv * a
        else:  # an fp32 input: fused, unless a DTensor under tp
            fused = uses_fused_backward(torch.float32, distributed=tp > 1)
            total += norm_bytes(t * value_heads, dv, fused) + t * value_heads * dv * fp32
        return total + 3 * t * value_heads * dv * a

    def heads_to_clip(self) -> list[tuple[Tensor, Tensor]]:
        raise NotImplementedError("QK-clip has no logits to clip in linear attention (its q and k are "
                                  "L2-normalised); the config refuses train.qk_clip_threshold with it")


def _local(param: Tensor) -> Tensor:
    """This tp rank's heads of a parameter split with them (a DTensor under tensor parallelism)."""
    return param.to_local() if isinstance(param, DTensor) else param


def _l2_normalised(x: Tensor) -> Tensor:
    """x / sqrt(|x|² + eps) over the last dim (the L2 norm Gated DeltaNet puts on its queries and keys)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + L2_EPS)
