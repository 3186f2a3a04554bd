"""The checks of the model's hyper-connection keys (``model.hc_mult``, ``hc_sinkhorn_iters``, ``hc_eps``; the module
is ``moe/hyper_connections.py``), kept beside ``config/model.py`` so that module stays about the transformer's
shape."""

from __future__ import annotations

import math

from config.schema import require


def validate_hyper_connections(model) -> None:
    """Refuse impossible hyper-connection settings of ``model`` (a ``config.model.ModelConfig``) before any tensor
    exists."""
    require(model.hc_mult >= 1, f"model.hc_mult={model.hc_mult} must be >= 1 (1: the plain residual stream; "
                                "DeepSeek-V4: 4 streams)")
    require(model.hc_sinkhorn_iters >= 1, f"model.hc_sinkhorn_iters={model.hc_sinkhorn_iters} must be >= 1 "
                                          "(DeepSeek-V4: 20 Sinkhorn-Knopp iterations)")
    require(model.hc_eps > 0 and math.isfinite(model.hc_eps),
            f"model.hc_eps={model.hc_eps} must be a small positive number (DeepSeek-V4: 1e-6)")
