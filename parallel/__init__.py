"""How the model is spread over ranks: applied from outside to an unchanged ``moe`` model.

``parallelize`` is the one entry point. It applies, in a fixed order, the techniques the
layout enables. Implemented so far: sharded data parallelism (dp_shard, with HSDP over
dp_replicate). Tensor, expert and pipeline parallelism are refused by ``check_supported``
before any process group exists.
"""

from __future__ import annotations

from moe.config import ConfigError
from moe.transformer import MoETransformer
from parallel.groups import Layout, ParallelGroups
from parallel.sharding import apply_fsdp

SUPPORTED = ("dp_replicate", "dp_shard")


def check_supported(layout: Layout) -> None:
    """Refuse, with the reason, the degrees this version cannot run yet."""
    for key in ("pp", "tp", "ep", "etp"):
        if layout.degree(key) > 1:
            raise ConfigError(f"parallel.{key}={layout.degree(key)}: this version supports data parallelism only "
                              f"({', '.join('parallel.' + k for k in SUPPORTED)}); set parallel.{key}=1")


def parallelize(model: MoETransformer, groups: ParallelGroups) -> MoETransformer:
    """Apply the layout's parallelism to ``model`` in place and return it."""
    check_supported(groups.layout)
    layout = groups.layout
    if layout.dp > 1:
        axes = ("dp_replicate", "dp_shard") if layout.dp_replicate > 1 else ("dp_shard",)
        apply_fsdp(model, groups.mesh(*axes))
    return model
