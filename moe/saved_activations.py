"""The terms in which a module kind states what autograd saves for backward in one micro-batch on one rank.

Each attention and feed-forward kind states its own saved bytes beside its forward (``moe/attention/``,
``moe/experts.py``) in these terms, and ``analysis/memory_activations.py`` sums the statements over the layer
pattern; ``tests/analysis/test_memory.py`` holds the sums equal, byte for byte, to what autograd saves
(``saved_activation_bytes``).

Shapes: T tokens of a micro-batch on a rank (b sequences of s positions: S/cp under context parallelism).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe.norm import uses_fused_backward

FP32 = 4
INDEX = 8  # int64 ids and indices


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch on one rank: T = b·s tokens (s = S/cp under context parallelism), ``stream`` of them in
    the residual stream (T/tp under SP); attention's keys are cp times its queries."""

    tokens: int
    stream: int
    sequences: int
    compute: int  # bytes of the compute dtype
    bf16: bool
    bf16_weights: bool = False  # dense weights in FSDP units gathering bf16 (``parallel.sharding.mixed_precision``)
    group_rows: int = 1  # experts' groups padded to a multiple of this many rows (``moe.experts.row_multiple_on``)
    cp: int = 1  # context-parallel ranks: the keys of a sequence are cp times this rank's positions of it
    cp_rank: int | None = None  # which context-parallel rank (None: the one that saves the most)
    cpu: bool = False  # on a CPU a cp rank's chunks attend without masks (``moe.sequence_shards._ChunkAttention``)

    @property
    def positions(self) -> int:
        """Positions per sequence on this rank: S (S/cp), or S - k in multi-token prediction's module k."""
        return self.tokens // self.sequences


def norm_bytes(rows: int, d: int, fused: bool) -> int:
    """RMSNorm over ``rows`` rows of ``d``, all saved in fp32: the input and the [rows] rstd where its backward
    is fused (``moe.norm.uses_fused_backward``: an fp32 plain-tensor input); the normalised input too where
    autograd differentiates the decomposed ops (DTensor inputs under tensor parallelism; bf16 inputs, q/k under
    autocast and the residual stream under FSDP's bf16 weights, whose fp32 upcast is what it saves)."""
    return rows * ((1 if fused else 2) * d + 1) * FP32


def head_norm_bytes(mb: MicroBatch, rows: int, d: int, tp: int) -> int:
    """A per-head RMSNorm over ``rows`` rows (tokens × this rank's heads) of ``d``, on the activations' dtype."""
    return norm_bytes(rows, d, uses_fused_backward(torch.bfloat16 if mb.bf16 else torch.float32, distributed=tp > 1))


def linear_input_bytes(mb: MicroBatch, d: int, consumers: int, saved_in_fp32: bool = True,
                       rows: int | None = None) -> int:
    """The [T, d] input (``rows`` rows if given: T) of ``consumers`` column-parallel projections: one fp32 tensor,
    or one bf16 cast each (autocast casting it per matmul), or one bf16 cast they share when their weights are
    gathered in bf16 (measured: ``tests/analysis/test_memory.py``'s bf16 FSDP layouts)."""
    rows = mb.tokens if rows is None else rows
    if mb.bf16 and mb.bf16_weights:
        return rows * d * mb.compute
    if mb.bf16:
        return consumers * rows * d * mb.compute
    return rows * d * FP32 if saved_in_fp32 else 0
