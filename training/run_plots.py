"""The PNGs every run leaves in ``run_dir/plots``: a look at the run without wandb, TensorBoard or a notebook.

Four figures, each drawn from the run directory's own files only (``metrics.jsonl`` for the curves,
``summary.json`` for the peak memory), so they show the whole run across resumed sessions, exactly as logged:

- ``loss.png``: training loss per logging interval and validation loss at each evaluation;
- ``throughput.png``: tokens per second per logging interval (the first includes start-up);
- ``memory.png``: peak memory per rank (live tensor bytes: a GPU's allocated memory, a CPU's measured live
  tensors), split into what was held before the model was built and the rest, beside the memory model's
  prediction;
- ``routing.png``: routing imbalance (the most-loaded expert's share over the mean share) per MoE layer,
  with 1.0, perfect balance, marked.

matplotlib is an optional dependency (the ``dev`` extra): without it :func:`write_run_plots` writes nothing and
returns why, for the run to say once. Figures are ``matplotlib.figure.Figure`` objects, not pyplot's, so no
backend or global state is involved and a worker without a display draws them the same.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from config.errors import ConfigError
from storage.files import atomic_output
from training.metrics import read_metrics

PLOTS_DIR = "plots"
NO_MATPLOTLIB = "plots: matplotlib is not installed, so no PNGs were written (pip install matplotlib)"


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key`` in the records that hold it, in the order logged."""
    rows = [(record["step"], record[key]) for record in records if isinstance(record.get(key), (int, float))]
    return [step for step, _ in rows], [value for _, value in rows]


def _axes(title: str, xlabel: str, ylabel: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.subplots()
    ax.set_title(title, fontsize="medium")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def loss_figure(records: list[dict], name: str):
    fig, ax = _axes(f"{name}: loss", "step", "loss (nats per token)")
    ax.plot(*_series(records, "train/loss"), marker=".", label="training (mean over each log interval)")
    val_steps, val = _series(records, "val/loss")
    if val:
        ax.plot(val_steps, val, marker="o", linestyle="--", label="validation")
    ax.legend(fontsize="small")
    return fig


def throughput_figure(records: list[dict], name: str):
    fig, ax = _axes(f"{name}: throughput", "step", "tokens per second")
    steps, rate = _series(records, "perf/tokens_per_s")
    ax.plot(steps, rate, marker=".")
    ax.set_ylim(bottom=0)
    return fig


def memory_figure(summary: dict, name: str):
    """Bars of each rank's peak, the part held before the model shaded apart; the prediction as a dashed line."""
    peaks = summary.get("perf/memory_peak_gib_per_rank") or []
    before = summary.get("perf/memory_before_model_gib_per_rank") or [0.0] * len(peaks)
    fig, ax = _axes(f"{name}: peak memory per rank", "rank", "GiB")
    ranks = list(range(len(peaks)))
    width = 0.6 if len(ranks) > 1 else 0.3
    ax.bar(ranks, before, width, color="lightgrey", label="held before the model")
    ax.bar(ranks, [peak - held for peak, held in zip(peaks, before, strict=True)], width, bottom=before,
           color="tab:blue", label="the rest of the peak (model, optimizer, activations)")
    predicted = summary.get("perf/memory_predicted_gib")
    if isinstance(predicted, (int, float)):
        ax.axhline(predicted, color="tab:red", linestyle="--", label=f"memory model: {predicted:.2f} GiB")
    top = max([*peaks, predicted if isinstance(predicted, (int, float)) else 0.0, 1e-3])
    ax.set_ylim(0, top * 1.5)  # room above the bars for the legend
    ax.set_xticks(ranks)
    ax.legend(fontsize="small", loc="upper left")
    return fig


def routing_figure(records: list[dict], name: str):
    fig, ax = _axes(f"{name}: routing imbalance per MoE layer", "step", "max expert load / mean load")
    layers = sorted({int(key.split("/")[1][len("layer"):]) for record in records for key in record
                     if key.startswith("router/layer") and key.endswith("/imbalance")})
    for layer in layers:
        ax.plot(*_series(records, f"router/layer{layer}/imbalance"), marker=".", label=f"layer {layer}")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1, label="balanced")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize="small", ncols=2)
    return fig


def run_label(run_dir: Path) -> str:
    """How figures name a run, so two runs' figures tell apart: the run directory's name, then what its
    ``summary.json`` says of it (config, optimizer, precision, layout): ``no-aux (dropless, adamw, bf16, 1 rank)``."""
    summary_path = Path(run_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    said = [str(summary[key]) for key in ("config", "optimizer", "precision", "layout") if key in summary]
    return Path(run_dir).name + (f" ({', '.join(said)})" if said else "")


def run_figures(run_dir: Path, name: str) -> dict[str, object]:
    """The run's figures by file name, from its metrics.jsonl and summary.json."""
    records = read_metrics(run_dir / "metrics.jsonl")
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    return {"loss.png": loss_figure(records, name), "throughput.png": throughput_figure(records, name),
            "memory.png": memory_figure(summary, name), "routing.png": routing_figure(records, name)}


def check_plots_folder(run_dir: Path) -> None:
    """Refuse, before the run starts, a ``plots`` path in ``run_dir`` that cannot be the figures' folder (a file, a
    dangling link): the figures are written at the end, and would fail there, after the work is done."""
    folder = Path(run_dir) / PLOTS_DIR
    if (folder.exists() or folder.is_symlink()) and not folder.is_dir():
        raise ConfigError(f"{folder} is not a folder, and the run writes its figures there at the end; move it "
                          "away, or set logging.plots=false")


def write_run_plots(run_dir: Path, name: str) -> list[Path] | str:
    """Write the figures into ``run_dir/plots``; the paths written, or why none were (matplotlib missing)."""
    if importlib.util.find_spec("matplotlib") is None:
        return NO_MATPLOTLIB
    folder = run_dir / PLOTS_DIR
    folder.mkdir(exist_ok=True)
    written = []
    for file, fig in run_figures(run_dir, name).items():
        with atomic_output(folder / file, durable=False) as handle:  # replaces a link there, never its target
            fig.savefig(handle, format="png", dpi=100)
        written.append(folder / file)
    return written
