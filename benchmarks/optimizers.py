"""Muon against AdamW on one config: validation loss at the same steps and at the same wall time, over seeds.

Each (seed, optimizer) pair trains ``train.py --config CONFIG`` from scratch with the same learning-rate schedule
(the config's, or ``--set``'s) and evaluates every ``--eval-every`` steps; the runs alternate optimizers seed by
seed so that a shared machine's load falls on both alike. Printed: each optimizer's final validation loss (mean
and spread over the seeds), its seconds per step (the median of the logged intervals' throughput), and the
validation loss each reaches within the wall time of the slower one's last evaluation. ``--plot FILE.png``
draws the curves against steps and against seconds (matplotlib). A measurement, never a pass/fail test.

    python benchmarks/optimizers.py [--config moe-8x] [--steps 120] [--eval-every 30] [--seeds 0 1 2]
                                    [--set key=value ...] [--json PATH] [--plot PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from config.run import load_config  # noqa: E402
from training.metrics import read_metrics  # noqa: E402

OPTIMIZERS = ("adamw", "muon")


def train(config: str, run_dir: Path, optimizer: str, seed: int, steps: int, eval_every: int,
          overrides: list[str]) -> dict:
    """One run; its validation curve [(step, seconds, loss)] and seconds per step."""
    command = [sys.executable, str(ROOT / "train.py"), "--config", config, "--run-dir", str(run_dir), "--set",
               f"train.optimizer={optimizer}", f"train.seed={seed}", f"train.steps={steps}",
               f"train.eval_interval={eval_every}", "logging.wandb=disabled", "logging.progress=lines",
               "logging.plots=false", "checkpoint.interval=null", *overrides]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"optimizers: {optimizer} seed {seed} failed:\n{done.stderr[-3000:]}")
    resolved = load_config(config, [f"train.optimizer={optimizer}", *overrides])
    tokens_per_step = resolved.train.global_batch_size * resolved.model.seq_len
    records = read_metrics(run_dir / "metrics.jsonl")
    step_seconds = statistics.median(tokens_per_step / r["perf/tokens_per_s"] for r in records
                                     if "perf/tokens_per_s" in r and "train/loss" in r)
    curve = [(r["step"], r["step"] * step_seconds, r["val/loss"]) for r in records if "val/loss" in r]
    return {"optimizer": optimizer, "seed": seed, "step_seconds": step_seconds, "curve": curve}


def loss_within(curve: list[tuple[int, float, float]], seconds: float) -> float | None:
    """The last validation loss evaluated within ``seconds`` of training (None: no evaluation that early)."""
    within = [loss for _, at, loss in curve if at <= seconds * (1 + 1e-9)]
    return within[-1] if within else None


def summarise(runs: list[dict]) -> dict:
    by = {name: [r for r in runs if r["optimizer"] == name] for name in OPTIMIZERS}
    budget = min(max(r["curve"][-1][1] for r in by[name]) for name in OPTIMIZERS)  # the faster one's whole run
    out = {"same_seconds": budget}
    for name, group in by.items():
        finals = [r["curve"][-1][2] for r in group]
        timed = [loss for loss in (loss_within(r["curve"], budget) for r in group) if loss is not None]
        out[name] = {"final_val_loss_mean": statistics.mean(finals),
                     "final_val_loss_spread": max(finals) - min(finals),
                     "step_seconds": statistics.median(r["step_seconds"] for r in group),
                     "val_loss_at_same_seconds": statistics.mean(timed) if len(timed) == len(group) else None}
    return out


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (by_step, by_time) = plt.subplots(1, 2, figsize=(11, 4))
    colours = {"adamw": "tab:blue", "muon": "tab:red"}
    for run in runs:
        steps, seconds, losses = zip(*run["curve"], strict=True)
        label = f"{run['optimizer']}, seed {run['seed']}"
        by_step.plot(steps, losses, color=colours[run["optimizer"]], alpha=0.7, label=label)
        by_time.plot(seconds, losses, color=colours[run["optimizer"]], alpha=0.7)
    by_step.set(xlabel="step", ylabel="validation loss", title="at the same steps")
    by_time.set(xlabel="seconds of training (median step time × step)", title="at the same wall time")
    by_step.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="moe-8x")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--eval-every", type=int, default=30)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--set", dest="overrides", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.steps < 1 or not 1 <= args.eval_every <= args.steps:
        print(f"optimizers: --steps {args.steps} and --eval-every {args.eval_every} must satisfy "
              "1 <= eval-every <= steps", file=sys.stderr)
        return 2
    load_config(args.config, args.overrides)  # a bad config fails here, before any run
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for seed in args.seeds:
            for name in OPTIMIZERS:
                runs.append(train(args.config, Path(scratch) / f"{name}-{seed}", name, seed, args.steps,
                                  args.eval_every, args.overrides))
                last = runs[-1]
                print(f"{name} seed {seed}: val loss {last['curve'][-1][2]:.4f} at step {args.steps}, "
                      f"{last['step_seconds']:.3f} s/step", flush=True)
    summary = summarise(runs)
    for name in OPTIMIZERS:
        figures = summary[name]
        timed = figures["val_loss_at_same_seconds"]
        print(f"{name:<6} final val loss {figures['final_val_loss_mean']:.4f} (spread "
              f"{figures['final_val_loss_spread']:.4f} over {len(args.seeds)} seeds), "
              f"{figures['step_seconds']:.3f} s/step, val loss "
              f"{'(no evaluation that early)' if timed is None else f'{timed:.4f}'} within "
              f"{summary['same_seconds']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    if args.plot:
        plot(runs, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
