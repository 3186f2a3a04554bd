"""One parameter tensor of the model, its global shape and how tensor and expert parallelism cut it: the terms in
which each module kind states its parameters (``moe/attention/``, ``moe/experts.py``, ``moe/layer.py``), summed
by ``moe/accounting.py`` and divided by ``analysis/memory_states.py`` as ``parallel/`` divides them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor of the model and how tensor / expert parallelism cut it."""

    kind: str  # norm, attention, ffn (dense or shared experts), router, experts, embedding, head, projection (MTP's)
    layer: int | None  # block index; None for the embedding, final norm and head
    shape: tuple[int, ...]
    tp_dim: int | None = None  # dim split over tp (column-parallel: 0 of [out, in]; row-parallel: 1)
    expert_hidden_dim: int | None = None  # routed-expert stacks [E, ...]: dim 0 over ep, this dim over etp
    # false for a matmul whose input needs no gradient (sparse attention's indexer reads detached inputs): its
    # backward does not need the weight, so autocast's copy of it is not saved
    input_grad: bool = True

    @property
    def expert(self) -> bool:
        return self.kind == "experts"

    @property
    def autocast_copy(self) -> bool:
        """Whether bf16 autocast casts it for a matmul that saves the copy (not the fp32 router, norms, lookup; not
        a Linear's bias, which its backward does not need, nor the sinks, cast into the queries, nor a weight whose
        input needs no gradient)."""
        return self.kind in ("attention", "ffn", "experts", "head", "projection") and len(self.shape) > 1 \
            and self.input_grad

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count
