"""Gated DeltaNet under context parallelism: each rank computes its own positions, the recurrence's state handed on
in sequence order.

Under ``parallel.cp`` rank r of cp holds chunks r and 2·cp - 1 - r of a sequence's 2·cp (``SequenceShards``). A
linear-attention layer needs, at the start of each chunk, what the positions before it left: the state of the
gated delta rule ([dk, dv] per value head) and the short convolution's last kernel - 1 inputs. Both come from
chunks other ranks hold.

The state is handed on as affine maps. Over a chunk the rule takes the state S it starts from to M S + B
(``delta_rule.state_map``: M [dk, dk] and B [dk, dv] depend on the chunk's keys, values, decays and write
strengths alone). So, in parallel, each rank computes the map of each of its two chunks; one all-gather over the cp
ranks gives every rank all 2·cp maps; each rank composes them in sequence order up to the chunks it holds (the
state entering chunk j is B_{j-1} + M_{j-1} (B_{j-2} + ...), a few [dk, dk] x [dk, dv] products per chunk); and it
runs the rule over each of its chunks from the state entering it. The rule's work is done about twice (the maps'
pass carries dk columns beside the dv of the values, and computes no outputs; the outputs' pass is the one-process
rule's on this rank's positions), in parallel on every rank: the alternative, a strict hand-off from rank to rank,
does the work once but serialises the 2·cp chunks (rank 0's front chunk, rank 1's, ..., the last rank's two, ...,
rank 0's back chunk), each rank idle for all but two of 2·cp steps. What crosses the network is 2·cp maps of
dk·(dk + dv) fp32 numbers per head and sequence, whatever the sequence's length. Gradients flow back through the
compositions and the all-gather (whose backward is a reduce-scatter), so a state's gradient reaches the ranks whose
chunks made it, and the results are one process's to rounding.

The convolution's inputs before each chunk: each rank's last min(kernel - 1, chunk) inputs of each of its chunks,
gathered likewise; the kernel - 1 before chunk j are the last of those of the chunks before it, in sequence order
(zeros before the first).

Shapes: B sequences, H value heads, Hk key heads, s = S / cp positions on this rank (two chunks of c = s / 2), C
convolution channels; ``gather`` is the layer's ``gather_sequence`` (an all-gather over the cp ranks along dim -2).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from moe.attention.delta_rule import gated_delta_rule, state_map
from moe.sequence_shards import SequenceShards

Gather = Callable[[Tensor], Tensor]


def convolution_history(inputs: Tensor, kernel: int, gather: Gather, shards: SequenceShards) -> list[Tensor]:
    """The convolution's kernel - 1 inputs before each of this rank's two chunks, [B, kernel - 1, C] each, from the
    inputs [B, s, C] of every rank's chunks (one all-gather of each chunk's last ones)."""
    width = kernel - 1
    chunk = inputs.shape[1] // 2
    kept = min(width, chunk)
    zeros = inputs.new_zeros(inputs.shape[0], width, inputs.shape[2])
    if kept == 0:
        return [zeros, zeros]
    own_tails = torch.cat((inputs[:, chunk - kept:chunk], inputs[:, 2 * chunk - kept:]), dim=1)
    pieces = gather(own_tails).split(kept, dim=1)  # 2·cp pieces, rank after rank
    tails = [pieces[i] for i in shards.sequence_order()]
    history = []
    for j in shards.chunks():
        before = torch.cat([zeros, *tails[:j]], dim=1)
        history.append(before[:, before.shape[1] - width:])
    return history


def sharded_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor, beta: Tensor, chunk_size: int,
                             gather: Gather, shards: SequenceShards) -> Tensor:
    """The rule's outputs [B, H, s, dv] at this rank's positions of the sequence, as one process's run over the
    whole sequence gives them (``gated_delta_rule``'s inputs, this rank's positions: q, k [B, Hk, s, dk], v
    [B, H, s, dv], log_decay and beta [B, H, s])."""
    front, back = zip(*(t.chunk(2, dim=2) for t in (q, k, v, log_decay, beta)), strict=True)
    maps = torch.stack([state_map(*part[1:], chunk_size) for part in (front, back)])  # [2, B, H, dk, dk + dv]
    # gathered along dim -2 (SequenceGather's): the chunk index put there, every map flattened after it
    gathered = gather(maps.flatten(1).T.unsqueeze(-1)).squeeze(-1).T.unflatten(1, maps.shape[1:])
    starts = _states_entering(gathered, shards, k.shape[-1])
    outs = [gated_delta_rule(*part, chunk_size, start)[0] for part, start in zip((front, back), starts, strict=True)]
    return torch.cat(outs, dim=2)


def _states_entering(gathered: Tensor, shards: SequenceShards, dk: int) -> list[Tensor | None]:
    """The states entering this rank's two chunks (None: zeros, the sequence's start), from every chunk's map
    [2·cp, B, H, dk, dk + dv] in the gather's order, composed in sequence order as far as this rank's back chunk."""
    maps = [gathered[i] for i in shards.sequence_order()]
    states: list[Tensor | None] = [None]  # states[j]: the state entering chunk j
    with torch.autocast(gathered.device.type, enabled=False):  # in fp32, as the rule
        for chunk_map in maps[:shards.chunks()[1]]:
            transition, offset = chunk_map.split((dk, chunk_map.shape[-1] - dk), dim=-1)
            states.append(offset if states[-1] is None else transition @ states[-1] + offset)
    return [states[j] for j in shards.chunks()]
