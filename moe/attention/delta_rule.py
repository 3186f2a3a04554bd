"""The gated delta rule, the recurrence of Gated DeltaNet linear attention, in its two forms: by chunks (training,
and generation's first pass over the prompt) and step by step (generation's one new token).

Per head, with a state S of [dk, dv] (keys to values), each position t with query q_t, key k_t (both [dk]),
value v_t [dv], a write strength beta_t in (0, 1) and a decay exp(g_t) in (0, 1] (g_t <= 0, "log_decay"):

    S_t = exp(g_t) (I - beta_t k_t k_tᵀ) S_{t-1} + beta_t k_t v_tᵀ,      o_t = S_tᵀ q_t

(Yang, Kautz, Hatamizadeh 2025, "Gated Delta Networks", eq. 10): the state decays, then the value it stores
under k_t is moved a fraction beta_t of the way toward v_t (the delta rule of Widrow & Hoff). Written with the
correction delta_t = beta_t (v_t - exp(g_t) S_{t-1}ᵀ k_t) it is S_t = exp(g_t) S_{t-1} + k_t delta_tᵀ, which the
step form computes as it stands.

By chunks of C positions (Yang et al. 2024, "Parallelizing Linear Transformers with the Delta Rule over Sequence
Length", sec. 3, with the decay of Gated DeltaNet sec. 3.3): with gamma_t the sum of g over the chunk up to t
and S_0 the state entering the chunk, unrolling the recurrence gives, for the chunk's positions at once,

    (I + A) Delta = beta·V - (beta·exp(gamma)·K) S_0,   A[t, s] = beta_t exp(gamma_t - gamma_s) k_t·k_s  (s < t)

so Delta = U - W S_0 with U = (I + A)^-1 beta·V and W = (I + A)^-1 beta·exp(gamma)·K (the "UT transform": one
triangular inverse per chunk, ``unit_lower_inverse``, independent of S_0, so every chunk's runs in parallel); then

    o_t = exp(gamma_t) S_0ᵀ q_t + sum_{s <= t} exp(gamma_t - gamma_s) (q_t·k_s) delta_s
    S_C = exp(gamma_C) S_0 + sum_s exp(gamma_C - gamma_s) k_s delta_sᵀ

leaving one short loop over the chunks, each step a few [C, dk] x [dk, dv] matmuls. All of it in fp32, whatever
the autocast around it.

The state a span of positions ends at is an affine function of the state it starts from (``state_map``): what
context parallelism hands from rank to rank (``moe/attention/delta_rule_shards.py``).

In training (``gated_delta_rule``) autograd keeps only the rule's inputs: backward computes the chunks' matrices
again from them (each [C, C] per chunk and head, several of them, plus the per-chunk operands: a few times the
inputs' size), as the fla kernels do, so that a layer saves what its memory model states exactly.

Shapes: B sequences, H value heads, Hk key heads (H a multiple: each key head serves H / Hk consecutive value
heads), S positions; q, k [B, Hk, S, dk], v [B, H, S, dv], log_decay and beta [B, H, S], state [B, H, dk, dv].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor, chunk_size: int,
                     state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``chunked_gated_delta_rule`` in fp32; where a gradient is wanted, one that saves only its inputs."""
    inputs = [t.float() for t in (q, k, v, log_decay, beta)] + ([] if state is None else [state.float()])
    return _recomputed(lambda *x: chunked_gated_delta_rule(*x[:5], chunk_size, *x[5:]), inputs)


def state_map(k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor, chunk_size: int) -> Tensor:
    """The rule's effect on the state over these positions, as the affine map it is: [M | B] [B, H, dk, dk + dv],
    such that from a state S before them the rule ends at M S + B (M [dk, dk], B [dk, dv]; B is the state reached
    from zeros). Each column of the state moves alone (S_t = exp(g_t) (I - beta_t k_t k_tᵀ) S_{t-1} +
    beta_t k_t v_tᵀ acts on each column by the same matrix, plus that column's own value), so the rule run from
    [I | 0] over the values [0 | v], dk columns more, ends at [M | B] in one pass. In fp32; where a gradient is
    wanted, saving only its inputs (as ``gated_delta_rule``)."""
    inputs = [t.float() for t in (k, v, log_decay, beta)]
    return _recomputed(lambda *x: _state_map(*x, chunk_size), inputs)


def _state_map(k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor, chunk_size: int) -> Tensor:
    batch, heads, _, dv = v.shape
    dk = k.shape[-1]
    identity = torch.eye(dk, dtype=v.dtype, device=v.device).expand(batch, heads, dk, dk)
    start = torch.cat((identity, v.new_zeros(batch, heads, dk, dv)), dim=-1)
    return chunked_gated_delta_rule(None, k, F.pad(v, (dk, 0)), log_decay, beta, chunk_size, start)[1]


def _recomputed(rule, inputs: list[Tensor]):
    """``rule(*inputs)`` with autocast off; under autograd through ``_Recomputed``, which saves the inputs alone."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return _Recomputed.apply(rule, *inputs)
    with torch.autocast(inputs[0].device.type, enabled=False):
        return rule(*inputs)


class _Recomputed(torch.autograd.Function):
    """A form of the rule (a function of tensors), saving its inputs alone; backward computes it again with
    autograd and differentiates."""

    @staticmethod
    def forward(ctx, rule, *inputs: Tensor):
        ctx.rule = rule
        ctx.save_for_backward(*inputs)
        with torch.autocast(inputs[0].device.type, enabled=False):
            return rule(*inputs)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> tuple[Tensor | None, ...]:
        inputs = [t.detach().requires_grad_(needed) for t, needed in zip(ctx.saved_tensors, ctx.needs_input_grad[1:],
                                                                          strict=True)]
        with torch.enable_grad(), torch.autocast(inputs[0].device.type, enabled=False):
            outputs = ctx.rule(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        wanted = [t for t in inputs if t.requires_grad]
        computed = iter(torch.autograd.grad(outputs, wanted, grads))
        return None, *(next(computed) if t.requires_grad else None for t in inputs)


def chunked_gated_delta_rule(q: Tensor | None, k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor,
                             chunk_size: int, state: Tensor | None = None) -> tuple[Tensor | None, Tensor]:
    """The outputs [B, H, S, dv] and the final state of the gated delta rule from ``state`` (zeros if None), by
    chunks of ``chunk_size`` positions; without queries (q None) the final state alone (``state_map``). A last
    partial chunk is padded with positions that change nothing (zero key and value, beta 0, no decay) and their
    outputs dropped."""
    k = _to_value_heads(k, v)
    batch, heads, seq, dk = k.shape
    dv = v.shape[-1]
    pad = -seq % chunk_size
    k, v = (F.pad(x, (0, 0, 0, pad)) for x in (k, v))
    log_decay, beta = F.pad(log_decay, (0, pad)), F.pad(beta, (0, pad))
    chunks = (seq + pad) // chunk_size
    k, v = (x.reshape(batch, heads, chunks, chunk_size, -1) for x in (k, v))
    gamma = log_decay.reshape(batch, heads, chunks, chunk_size).cumsum(-1)  # decay from the chunk's start, in logs
    beta = beta.reshape(batch, heads, chunks, chunk_size, 1)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=k.device).tril()
    # exp(gamma_t - gamma_s) for s <= t: masked before exp, so that no later position's (positive) gap overflows
    gaps = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta
    inverse = unit_lower_inverse(((k_beta @ k.mT) * gaps).tril(-1))  # (I + A)^-1
    u, w = inverse @ (v * beta), inverse @ (k_beta * gamma.exp().unsqueeze(-1))
    reads = None  # each chunk's queries from its start and its scores, where outputs are wanted
    if q is not None:
        q = F.pad(_to_value_heads(q, v), (0, 0, 0, pad)).reshape(batch, heads, chunks, chunk_size, -1)
        reads = zip((q * gamma.exp().unsqueeze(-1)).unbind(2), ((q @ k.mT) * gaps).unbind(2), strict=True)
    k_to_end = k * (gamma[..., -1:] - gamma).exp().unsqueeze(-1)
    chunk_decay = gamma[..., -1].exp()[..., None, None]  # [B, H, n, 1, 1]
    if state is None:
        state = k.new_zeros(batch, heads, dk, dv)
    outputs = []
    # per chunk, unbound once: indexing each chunk would make backward write each slice's gradient into a zero
    # tensor of the whole
    for u_i, w_i, k_i, decay_i in zip(*(t.unbind(2) for t in (u, w, k_to_end, chunk_decay)), strict=True):
        delta = u_i - w_i @ state
        if reads is not None:
            q_i, scores_i = next(reads)
            outputs.append(q_i @ state + scores_i @ delta)
        state = state * decay_i + k_i.mT @ delta
    if q is None:
        return None, state
    out = torch.stack(outputs, dim=2).reshape(batch, heads, chunks * chunk_size, dv)
    return out[:, :, :seq], state


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor,
                               state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The same outputs and final state, one position at a time (the form generation's single new token takes)."""
    q, k = _to_value_heads(q, v), _to_value_heads(k, v)
    batch, heads, seq, dk = k.shape
    if state is None:
        state = q.new_zeros(batch, heads, dk, v.shape[-1])
    outputs = []
    for t in range(seq):
        state = state * log_decay[:, :, t].exp()[..., None, None]
        key = k[:, :, t]
        delta = beta[:, :, t, None] * (v[:, :, t] - (key.unsqueeze(-2) @ state).squeeze(-2))
        state = state + key.unsqueeze(-1) * delta.unsqueeze(-2)
        outputs.append((q[:, :, t].unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outputs, dim=2), state


def unit_lower_inverse(strict: Tensor) -> Tensor:
    """(I + A)^-1 for strictly lower triangular A [..., C, C], by halves: the inverse of [[L11, 0], [L21, L22]] is
    [[L11^-1, 0], [-L22^-1 L21 L11^-1, L22^-1]], so from the inverses of the C 1 x 1 diagonal blocks (ones) each
    level joins pairs of blocks with two batched matmuls, log2(C) levels in all (C padded to a power of two with
    the identity). The same numbers as a triangular solve to rounding (each level is forward substitution by
    blocks), in matmuls: CPU's batched ``solve_triangular`` took 40 times longer on [4·16, 64, 64] systems with 128
    right-hand sides (``benchmarks/delta_rule.py``'s shapes)."""
    size = strict.shape[-1]
    padded = 1 << max(size - 1, 0).bit_length()
    strict = F.pad(strict, (0, padded - size, 0, padded - size))
    batch = strict.shape[:-2]
    blocks = strict.new_ones(*batch, padded, 1, 1)  # the inverses of the diagonal blocks, [..., n, b, b]
    width = 1
    while width < padded:
        count = padded // width
        tiles = strict.reshape(*batch, count, width, count, width).transpose(-3, -2)  # [..., n, n, b, b]
        rows, cols = (torch.arange(start, count, 2, device=strict.device) for start in (1, 0))
        lower = tiles[..., rows, cols, :, :]  # L21 of each pair
        first, second = blocks[..., 0::2, :, :], blocks[..., 1::2, :, :]
        corner = -(second @ lower @ first)
        top = torch.cat((first, torch.zeros_like(first)), dim=-1)
        blocks = torch.cat((top, torch.cat((corner, second), dim=-1)), dim=-2)
        width *= 2
    return blocks[..., 0, :size, :size]


def _to_value_heads(x: Tensor, v: Tensor) -> Tensor:
    """Queries or keys [B, Hk, S, dk] repeated to v's H heads, each key head to its H / Hk consecutive ones."""
    return x if x.shape[1] == v.shape[1] else x.repeat_interleave(v.shape[1] // x.shape[1], dim=1)
