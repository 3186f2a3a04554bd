"""Which of a model's parameters are hidden matrices: the linear maps of the hidden state whose update Muon
orthogonalises (attention projections, dense and shared-expert FFNs, each routed expert's matrices, multi-token
prediction's projections), told apart from the lookup tables, scores and vectors it must not touch. A fact about
the model's parameters, here so that the optimizer and the dry run ask one rule."""

from __future__ import annotations

from torch import nn

from moe.router import TopKRouter


def outside_hidden_matrices(model: nn.Module) -> set[int]:
    """The ids of the parameters that are not hidden matrices: what Muon (``training/muon.py``) leaves to AdamW,
    and the memory model counts with AdamW's two moments (the dry run's built side, ``analysis/dry_run.py``).

    - Embeddings and the output head: their rows are looked up or scored one token at a time, not a linear map
      of the hidden state whose singular values matter (Jordan et al. 2024; Liu et al. 2025 keep them on AdamW);
      a tied head is the embedding.
    - The router's gate ``[experts, d_model]``: each row scores one expert; orthogonalising would make every
      expert's score move by the same amount whatever its gradient, fighting the load-balancing signal, and it
      is the choice of Moonlight and Megatron-Core's Muon.
    - Every tensor of fewer than two dimensions (norm gains, biases): no matrix to orthogonalise; and every bias
      of more (the routed experts' ``[experts, width]`` biases, GPT-OSS): a vector per expert, not a matrix.
    """
    # the head of each model this rank holds: the whole model's, or under pipeline parallelism each local stage's
    # (a ``parallel.pipeline.PipelineModel`` is not a module; its ``stages`` are)
    outputs = {id(getattr(stage, "output", None)) for stage in getattr(model, "stages", [model])} - {id(None)}
    chosen: set[int] = set()
    for module in model.modules():
        whole = isinstance(module, nn.Embedding) or id(module) in outputs or isinstance(module, TopKRouter)
        for name, param in module.named_parameters(recurse=False):
            if whole or param.dim() < 2 or name.endswith("bias"):
                chosen.add(id(param))
    return chosen
