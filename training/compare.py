"""Two or more runs side by side: one figure of their loss curves, and a table of what each run was and reached.

    python -m training.compare runs/adamw runs/muon                      # writes compare.png, prints the table
    python -m training.compare runs/a runs/b runs/c --out figures/abc.png --x tokens

Each run is read from its own directory (``metrics.jsonl`` for the curves, ``summary.json`` for what it was: its
config, optimizer, precision and layout), so runs on other machines or layouts, or resumed ones, compare as
logged. The curves are plotted against the step, or with ``--x tokens`` against the tokens trained on (runs of
different batch sizes then line up by the data they have seen). The loss compares across runs only with the same
tokenizer and data; the table says each run's so.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from config.cli import add_overwrite, check_outputs, command_parser, run_command
from config.errors import ConfigError
from training.metrics import read_metrics
from training.run_plots import NO_MATPLOTLIB, run_label


def run_record(run_dir: Path) -> dict:
    """What the table and the curves need of one run: its label, summary, tokens per step and metric records."""
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise ConfigError(f"{run_dir}: no metrics.jsonl, so not a run directory (train.py --run-dir writes one)")
    config_path = run_dir / "config.yaml"
    config = yaml.safe_load(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text(encoding="utf-8")) if summary_path.is_file() else {}
    train, model, data = config.get("train", {}), config.get("model", {}), config.get("data", {})
    tokens_per_step = train.get("global_batch_size", 0) * model.get("seq_len", 0)
    return {"name": run_dir.name, "label": run_label(run_dir), "summary": summary, "tokens_per_step": tokens_per_step,
            "data": f"{data.get('source', '?')} / {data.get('tokenizer', '?')}", "records": read_metrics(metrics)}


def _series(records: list[dict], key: str, scale: int) -> tuple[list[float], list[float]]:
    rows = [(record["step"] * scale, record[key]) for record in records if isinstance(record.get(key), (int, float))]
    return [x for x, _ in rows], [y for _, y in rows]


def compare_figure(runs: list[dict], x: str = "step"):
    """Training loss (solid) and validation loss (dashed, same colour) of each run on one pair of axes."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7.2, 4.2), layout="constrained")
    ax = fig.subplots()
    ax.set_title("loss of " + ", ".join(run["name"] for run in runs), fontsize="medium")
    ax.set_xlabel("tokens trained on" if x == "tokens" else "step")
    ax.set_ylabel("loss (nats per token)")
    ax.grid(alpha=0.3)
    for index, run in enumerate(runs):
        colour, scale = f"C{index}", run["tokens_per_step"] if x == "tokens" else 1
        ax.plot(*_series(run["records"], "train/loss", scale), color=colour, label=f"{run['label']}: training")
        val_x, val = _series(run["records"], "val/loss", scale)
        if val:
            ax.plot(val_x, val, color=colour, linestyle="--", marker="o", label=f"{run['label']}: validation")
    ax.legend(fontsize="x-small")
    return fig


def compare_table(runs: list[dict]) -> str:
    """One line per run: its label, steps, last training and validation loss, throughput, and its data."""
    lines = []
    for run in runs:
        summary = run["summary"]
        losses = (("train/loss", "train loss"), ("val/loss", "val loss"))
        figures = [f"{summary['steps']} steps" if "steps" in summary else "unfinished",
                   *(f"{name} {summary[key]:.4f}" for key, name in losses if isinstance(summary.get(key), float)),
                   *([f"{summary['perf/tokens_per_s']:,.0f} tokens/s"] if "perf/tokens_per_s" in summary else [])]
        lines.append(f"{run['label']}: {', '.join(figures)}; data {run['data']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("moe-compare", __doc__)
    parser.add_argument("runs", nargs="+", type=Path, help="two or more run directories")
    parser.add_argument("--out", type=Path, default=Path("compare.png"), help="the figure to write (PNG)")
    parser.add_argument("--x", choices=("step", "tokens"), default="step", help="the curves' horizontal axis")
    add_overwrite(parser)
    args = parser.parse_args(argv)

    def body() -> None:
        if len(args.runs) < 2:
            raise ConfigError(f"give two or more run directories to compare, got {len(args.runs)}")
        runs = [run_record(run_dir) for run_dir in args.runs]
        check_outputs([args.out], [], args.overwrite)
        print(compare_table(runs))
        try:
            fig = compare_figure(runs, args.x)
        except ImportError:
            print(NO_MATPLOTLIB, file=sys.stderr)
            return
        args.out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.out, dpi=100)
        print(f"wrote {args.out}", file=sys.stderr)

    return run_command(body)


if __name__ == "__main__":
    sys.exit(main())
