"""Building a rank's model: meta build -> pipeline cut -> parallelize -> materialise, the one door for every caller.

The run (``training/loop.py``), the dry run (``analysis/dry_run.py``) and the tests build models here, so what
a dry run measures is what a run trains. The whole model is never allocated: see ``build_model``.
"""

from __future__ import annotations

import torch

from config.run import RunConfig
from moe.transformer import MoETransformer
from parallel import parallelize
from parallel.groups import ParallelGroups
from parallel.materialize import materialize
from parallel.pipeline import PipelineModel, build_pipeline
from parallel.tensor import lm_loss


def build_model(config: RunConfig, groups: ParallelGroups, device: torch.device, micro: int, microbatches: int,
                autocast, allocate: bool = True, param_dtype: torch.dtype | None = None
                ) -> MoETransformer | PipelineModel:
    """This rank's part of the model, parallelized by ``groups``' layout, on ``device``, initialised.

    The whole model is only ever a description on the meta device: it is cut into this rank's pipeline
    stages (if any) and parallelized there, and only then are this rank's shards allocated and
    initialised (``parallel.materialize``), with the single-process weights for ``train.seed``.
    ``allocate=False`` leaves it on meta (``train.py --dry-run`` measures the shards' shapes).
    ``param_dtype`` is FSDP's compute dtype (bf16: ``parallel.sharding.mixed_precision``).
    """
    with torch.device("meta"):
        model = MoETransformer(config.model, config.moe)
    par = config.parallel
    if groups.layout.pp > 1:  # this rank's stages, each parallelized like the whole model
        model = build_pipeline(model, config.moe, groups, device, par, microbatches, micro, lm_loss, autocast,
                               param_dtype)
    else:
        model = parallelize(model, groups, par, param_dtype, compile_blocks=config.train.compile)
    if allocate:
        for part in model.stages if isinstance(model, PipelineModel) else [model]:
            materialize(part, device, config.train.seed)
    return model
