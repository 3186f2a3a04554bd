"""The expert sweep as a figure: the project's headline, the footprint moving from activations to weights as
experts are added, seen at a glance (``python -m analysis.memory ... --sweep-experts 8,16,32 --plot FILE.png``).

One stacked bar per expert count, one colour per component of the memory model, the device's memory as a
line. The components are ``sweep_components``'s, the same split the sweep's table prints, so the figure and the
table cannot disagree. matplotlib is optional (the ``dev`` extra): ``--plot`` without it is refused before any
estimate is made.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from config.cli import check_outputs
from config.errors import ConfigError
from storage.files import atomic_output

GIB = 2**30
COLOURS = ("tab:blue", "tab:cyan", "tab:purple", "tab:olive", "tab:orange")


def check_plot_path(path: Path, overwrite: bool) -> None:
    """Refuse, before any work, a --plot that cannot be written: no matplotlib, not a .png, no such folder, an
    existing file without --overwrite."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("--plot needs matplotlib, which is not installed (pip install matplotlib, or the dev "
                          "extra); leave out --plot for the table alone")
    if path.suffix.lower() != ".png":
        raise ConfigError(f"--plot {path}: give a .png file name")
    if not path.parent.is_dir():
        raise ConfigError(f"--plot {path}: the folder {path.parent} does not exist")
    check_outputs([path], [], overwrite)


def save_png(fig, path: Path) -> None:
    """Whole or not at all, as every output of the toolkit."""
    with atomic_output(path) as handle:
        fig.savefig(handle, format="png", dpi=100)


def sweep_figure(rows: list[tuple[int, dict[str, int]]], device_gib: float, title: str):
    """Stacked GiB per expert count (``rows``: expert count, component -> bytes), the device memory dashed."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.5, 4.2), layout="constrained")
    ax = fig.subplots()
    labels = [str(experts) for experts, _ in rows]
    bottoms = [0.0] * len(rows)
    for name, colour in zip(rows[0][1], COLOURS, strict=True):
        heights = [parts[name] / GIB for _, parts in rows]
        ax.bar(labels, heights, bottom=bottoms, color=colour, label=name)
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, (total, (_, parts)) in enumerate(zip(bottoms, rows, strict=True)):
        share = parts["activations (+ logits)"] / max(1, sum(parts.values()))
        ax.annotate(f"{total:.1f} GiB\n{100 * share:.0f}% activations", (x, total), ha="center", va="bottom",
                    fontsize="small")
    ax.axhline(device_gib, color="tab:red", linestyle="--", label=f"device memory ({device_gib:g} GiB)")
    ax.set_ylim(0, max(max(bottoms), device_gib) * 1.25)
    ax.set_xlabel("moe.num_experts")
    ax.set_ylabel("GiB per rank (the largest pipeline rank)")
    ax.set_title(title, fontsize="medium")
    ax.legend(fontsize="small", loc="upper left")
    ax.grid(alpha=0.3, axis="y")
    return fig
