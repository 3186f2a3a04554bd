"""The run's routing log: each interval's routing rows under ``run_dir/routing/``, and charts for wandb.

``RoutingLog`` appends the rows ``training/routing_stats.py`` reduced (``analysis/router.py`` reads them back)
and draws the charts: a per-layer bar chart of expert load and a layers x experts load heatmap.

Scalars (imbalance, dropped, ...) go to wandb with every metrics record; these richer charts are
logged only every few logging intervals, because each is a table or image file in the run. All of
them work offline: a bar chart is a ``wandb.Table`` plus wandb's bar preset, the heatmap a
``wandb.Table`` of the matrix and, when matplotlib is installed (the ``dev`` extra), a rendered image.
"""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import numpy as np

from training.metrics import LogWriteError, MetricsLogger
from training.routing_stats import ROUTING_DIR, IntervalRouting, append_rows, routing_rows

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def load_heatmap_figure(load: np.ndarray, row_labels: list[str], title: str, row_name: str = "layer"):
    """A matplotlib figure of ``load`` [rows, E] as a heatmap, share of assignments per cell.

    The colour scale is centred on the balanced share 1/E (white), so hot experts show red and
    starved ones blue whatever E is. A plain ``Figure`` (not pyplot's): no backend, no global state.
    """
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.figure import Figure

    rows, experts = load.shape
    fig = Figure(figsize=(1.5 + 0.45 * experts, 1.2 + 0.3 * rows), layout="constrained")
    ax = fig.subplots()
    balanced = 1.0 / experts
    norm = TwoSlopeNorm(vcenter=balanced, vmin=0.0, vmax=max(float(load.max()), 2 * balanced))
    image = ax.imshow(load, cmap="RdBu_r", norm=norm, aspect="auto", interpolation="nearest")
    ax.set_xticks(range(experts))
    ax.set_yticks(range(rows), labels=row_labels)
    ax.set_xlabel("expert")
    ax.set_ylabel(row_name)
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label=f"share of assignments (balanced = {balanced:.3g})")
    return fig


def log_routing_charts(logger: MetricsLogger, step: int, routing: IntervalRouting) -> None:
    """Bar chart per layer (``router/layer{i}/load_bar``) and the heatmap (``router/load_heatmap``)."""
    if not logger.uses_wandb:
        return
    import wandb

    load = routing.load
    experts = [str(e) for e in range(load.shape[1])]
    charts = {}
    for n, i in enumerate(routing.layers):
        rows = [[e, float(v)] for e, v in zip(experts, load[n], strict=True)]
        table = wandb.Table(columns=["expert", "load"], data=rows)
        charts[f"router/layer{i}/load_bar"] = wandb.plot.bar(
            table, "expert", "load", title=f"layer {i}: share of assignments per expert, step {step}")
    matrix = [[int(i), *map(float, row)] for i, row in zip(routing.layers, load, strict=True)]
    charts["router/load_matrix"] = wandb.Table(columns=["layer", *experts], data=matrix)
    if HAS_MATPLOTLIB:
        from PIL import Image  # matplotlib's own dependency

        fig = load_heatmap_figure(load, [str(i) for i in routing.layers], f"expert load, step {step}")
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=100)  # rendered here: wandb.Image(fig) would need pyplot's global state
        charts["router/load_heatmap"] = wandb.Image(Image.open(png))
    logger.log_wandb(step, charts)


class RoutingLog:
    """Appends each interval's routing rows under ``run_dir/routing/`` and draws the wandb charts.

    Charts go to wandb every ``charts_every``-th interval and at the last one (0 = never). Only the
    logger's rank (the main one) writes anything.
    """

    def __init__(self, run_dir: Path, logger: MetricsLogger, charts_every: int) -> None:
        self.folder = Path(run_dir) / ROUTING_DIR
        self.logger = logger
        self.charts_every = charts_every
        self.intervals = 0
        if logger.enabled:
            self.folder.mkdir(parents=True, exist_ok=True)

    def append(self, step: int, routing: IntervalRouting | None, last: bool = False) -> None:
        """Record one interval (``routing`` from :meth:`RoutingAccumulator.reduce`) at its last ``step``."""
        if not self.logger.enabled or routing is None:
            return
        for name, values in routing_rows(step, routing).items():
            try:
                append_rows(self.folder / f"{name}.npy", values)
            except OSError as exc:
                raise LogWriteError(self.folder / f"{name}.npy", step, exc) from exc
        if self.charts_every and (self.intervals % self.charts_every == 0 or last):
            log_routing_charts(self.logger, step, routing)
        self.intervals += 1
