"""Figures of routing over training and of probe results, for ``notebooks/router_analysis.ipynb``.

Each function draws one figure from :mod:`analysis.router` data and returns it; none computes
anything the unit-tested functions there do not. Figures are plain ``matplotlib.figure.Figure``
objects, not pyplot's: no global state, no backend needed; a notebook shows one with ``display(fig)``.
"""

from __future__ import annotations

import math

import numpy as np
from matplotlib.figure import Figure

from analysis.router import RunData, coselection_lift
from analysis.router_probe import CATEGORIES, ProbeResult, category_lift, expert_categories
from training.routing_log import load_heatmap_figure


def _log2_lift(lift: np.ndarray) -> np.ndarray:
    """log2 of a lift clipped to [1/4, 4] (a zero would be -inf); nan (undefined) stays blank."""
    return np.log2(np.clip(lift, 0.25, 4.0))


def load_over_training(run: RunData, layer: int) -> Figure:
    """Heatmap: one row per logging interval (its last step), one column per expert, colour = load share."""
    steps, tokens = run.per_layer("tokens_per_expert", layer)
    load = tokens / np.maximum(tokens.sum(1, keepdims=True), 1)
    labels = [str(s) for s in steps]
    fig = load_heatmap_figure(load, labels, f"{run.name}: layer {layer} expert load over training", row_name="step")
    ax = fig.axes[0]
    if len(labels) > 12:  # keep the step axis readable
        keep = np.linspace(0, len(labels) - 1, 12).round().astype(int)
        ax.set_yticks(keep, labels=[labels[k] for k in keep])
    return fig


def over_steps(runs: list[RunData], field: str, ylabel: str, per_layer: bool = True,
               reference: float | None = None) -> Figure:
    """A routing field against step: one line per layer (one run), or the layer mean per run (several)."""
    fig = Figure(figsize=(7, 3.5), layout="constrained")
    ax = fig.subplots()
    for run in runs:
        if per_layer and len(runs) == 1:
            for layer in run.layers:
                steps, values = run.per_layer(field, layer)
                ax.plot(steps, values, marker=".", label=f"layer {layer}")
        else:
            steps, _ = run.per_layer(field, run.layers[0])
            mean = np.mean([run.per_layer(field, layer)[1] for layer in run.layers], axis=0)
            ax.plot(steps, mean, marker=".", label=f"{run.name} (mean of {len(run.layers)} layers)")
    if reference is not None:
        ax.axhline(reference, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return fig


def coselection_figure(run: RunData, last_intervals: int | None = None) -> Figure:
    """Per layer, how often two experts are picked together against chance at their loads (log scale)."""
    layers = run.layers
    cols = min(4, len(layers))
    rows = math.ceil(len(layers) / cols)
    fig = Figure(figsize=(3.2 * cols + 1, 3.0 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, layer in zip(axes.flat, layers, strict=False):
        lift = coselection_lift(run.coselection(layer, last_intervals))
        image = ax.imshow(_log2_lift(lift), cmap="PuOr_r", vmin=-2, vmax=2, interpolation="nearest")
        ax.set_title(f"layer {layer}")
        ax.set_xticks(range(len(lift)))
        ax.set_yticks(range(len(lift)))
        ax.set_xlabel("expert")
        ax.set_ylabel("expert")
    for ax in list(axes.flat)[len(layers):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, label="log2(together / chance)")
    return fig


def specialisation_figure(result: ProbeResult) -> Figure:
    """Per layer, experts x token categories: how much more (or less) often than in the text an expert gets each."""
    layers = result.layers
    fig = Figure(figsize=(3.4 * len(layers) + 1, 0.35 * result.num_experts + 2), layout="constrained")
    axes = fig.subplots(1, len(layers), squeeze=False)
    for ax, layer in zip(axes[0], layers, strict=True):
        lift = category_lift(expert_categories(result, layer))
        image = ax.imshow(_log2_lift(lift), cmap="PuOr_r", vmin=-2, vmax=2, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(CATEGORIES)), labels=CATEGORIES, rotation=60, ha="right")
        ax.set_yticks(range(result.num_experts))
        ax.set_title(f"layer {layer}")
        ax.set_ylabel("expert")
    fig.colorbar(image, ax=axes, label="log2(share at expert / share in text)")
    if result.initial_weights:  # random routers also favour some categories; said where the eye lands first
        fig.suptitle("RANDOM INITIAL WEIGHTS (no checkpoint): routing before any training, not learned "
                     "specialisation", color="tab:red", fontweight="bold")
    return fig


def compare_runs(runs: list[RunData]) -> Figure:
    """Training loss, imbalance and dropped fraction of several runs on shared step axes."""
    fig = Figure(figsize=(13, 3.5), layout="constrained")
    axes = fig.subplots(1, 3)
    for run in runs:
        steps, loss = run.metric("train/loss")
        axes[0].plot(steps, loss, label=run.name)
        for ax, field in ((axes[1], "imbalance"), (axes[2], "dropped_frac")):
            steps, _ = run.per_layer(field, run.layers[0])
            ax.plot(steps, np.mean([run.per_layer(field, layer)[1] for layer in run.layers], axis=0), label=run.name)
    for ax, title in zip(axes, ("train loss", "imbalance (max/mean load, layer mean)", "dropped fraction"),
                         strict=True):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    return fig
